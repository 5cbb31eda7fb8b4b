"""Drafters: DFlash and DSpark on the shared block-drafter core, and the EAGLE-3 baseline.

Each is a ``transformers`` ``PreTrainedModel`` with its own config. Importing the package registers
them with the Auto classes (``AutoModel.from_pretrained(folder)`` loads any of them); that is its
only effect at import. :data:`DRAFTERS` is the one registry of drafter kinds: a recipe's
``drafter.kind``, a config's ``model_type`` (``draftsmith_<kind>``) and :func:`kind_of` all read it.
"""

from typing import Any

import torch
from transformers import AutoConfig, AutoModel

from .base import DrafterBase, DrafterConfig, DrafterOutput  # noqa: F401  (public API)
from .block import BlockDrafter
from .dflash import DFlashConfig, DFlashDrafter
from .dspark import DSparkConfig, DSparkDrafter
from .eagle3 import Eagle3Config, Eagle3Drafter
from .target_io import save_without_target_io, shares_target_io  # noqa: F401  (public API)

DRAFTERS: dict[str, tuple[type[DrafterConfig], type[DrafterBase]]] = {
    "dflash": (DFlashConfig, DFlashDrafter),
    "dspark": (DSparkConfig, DSparkDrafter),
    "eagle3": (Eagle3Config, Eagle3Drafter),
}

for _config, _model in DRAFTERS.values():
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)


def kind_of(config) -> str | None:
    """The drafter kind (``"dflash"``, ``"dspark"``, ``"eagle3"``) of a config, a model or a config dict;
    None for anything else (a causal LM drafting for its target, a student, Parcae)."""
    config = getattr(config, "config", config)
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    kind = str(model_type or "").removeprefix("draftsmith_")
    return kind if kind in DRAFTERS and model_type == DRAFTERS[kind][0].model_type else None


def unwrapped(model):
    """The model inside any training wrapper (``torch.compile``, DDP, FSDP, a DeepSpeed engine): what its
    kind is read from. Wrappers hide the class, so ``isinstance`` on a wrapped model is always False.
    (accelerate's ``extract_model_from_parallel`` does the same but imports DeepSpeed on every call; an
    engine exists only where DeepSpeed was imported already.)"""
    import sys

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    wrappers: tuple[type[Any], ...] = (DistributedDataParallel, DataParallel, FullyShardedDataParallel)
    if "deepspeed" in sys.modules:
        wrappers += (sys.modules["deepspeed"].DeepSpeedEngine,)
    while True:
        if isinstance(model, torch.nn.Module) and "_orig_mod" in model.__dict__.get("_modules", {}):
            model = model._orig_mod  # torch.compile's OptimizedModule
        elif isinstance(model, wrappers):
            model = model.module
        else:
            return model


def is_block_drafter(model) -> bool:
    """DFlash / DSpark (bare or wrapped, :func:`unwrapped`): one forward drafts a whole block from the target's features."""
    return isinstance(unwrapped(model), BlockDrafter)
