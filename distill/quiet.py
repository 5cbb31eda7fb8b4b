"""What a command does before it imports torch or transformers: third-party noise a user cannot act on
turned off. Standard library only, so that importing it imports nothing that logs."""

from __future__ import annotations

import os


def quiet_third_party() -> None:
    """What the command line does first: no per-file progress bars from transformers / huggingface_hub
    (they would interleave with the trainer's own bar on every checkpoint; set
    ``HF_HUB_DISABLE_PROGRESS_BARS=0`` to restore them), and no warnings a user cannot act on: torchao's
    CUDA kernels that cannot load on a CPU machine, torch's note on torchao's enum registration,
    accelerate's note on every checkpoint that a tied LM head is stored once (it is re-tied on load,
    which the tests check), TRL's notice on its experimental GKD divergence (:mod:`distill.kd`)."""
    import logging

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("torchao", "torch.utils._pytree", "accelerate.utils.other"):
        logging.getLogger(name).setLevel(logging.ERROR)
