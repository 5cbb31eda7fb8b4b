"""Draftsmith's training engine: recipes' typed configs, data, targets, trainer, checkpoints, logging."""

import logging as _logging

# torchao (imported by transformers) warns on every CPU-only import that its CUDA kernels cannot load,
# and torch warns about torchao's enum registration; neither is actionable for a user.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
