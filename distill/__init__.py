"""Draftsmith's training engine: recipes' typed configs, data, targets, trainer, checkpoints, logging."""

import logging as _logging
import os as _os

# Our own progress bar reports training; per-file "Loading weights" / "Writing model shards" bars from
# transformers and huggingface_hub would interleave with it on every checkpoint. Set to 0 to restore.
_os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
_os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # distill.kd uses TRL's GKD divergence, from trl.experimental

# Not actionable for a user: torchao (imported by transformers) warns on every CPU-only import that its
# CUDA kernels cannot load; torch warns about torchao's enum registration; accelerate warns on every
# checkpoint that a tied LM head is stored once (it is re-tied on load, which the tests check).
for _name in ("torchao", "torch.utils._pytree", "accelerate.utils.other"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
