"""Drafters: DFlash and DSpark on the shared block-drafter core, and the EAGLE-3 baseline.

Each is a ``transformers`` ``PreTrainedModel`` with its own config (registered with the Auto classes, so
``AutoModel.from_pretrained(folder)`` loads any of them)."""

import distill  # noqa: F401  (first: it quiets third-party import-time warnings)
from transformers import AutoConfig, AutoModel

from .core import DrafterConfig, DrafterOutput, save_without_target_io, shares_target_io  # noqa: F401  (public API)
from .dflash import DFlashConfig, DFlashDrafter
from .dspark import DSparkConfig, DSparkDrafter
from .eagle3 import Eagle3Config, Eagle3Drafter

DRAFTERS = {"dflash": (DFlashConfig, DFlashDrafter), "dspark": (DSparkConfig, DSparkDrafter),
            "eagle3": (Eagle3Config, Eagle3Drafter)}

for _config, _model in DRAFTERS.values():
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
