"""The target's embeddings and LM head in a drafter: which weights they are, how a drafter saved
without them is recognised, and how features and hidden states from the target are brought to the
dtypes of the drafter's weights that read them.

A drafter reads its target's token embeddings and LM head, frozen (:class:`drafters.base.DrafterBase`
copies or shares them); a shipped drafter leaves them out (:data:`TARGET_IO`) and loads them from the
target, as serving engines do.
"""

from __future__ import annotations

import torch
from torch import nn

#: the weights a drafter shares with its target; a shipped drafter leaves them out (:func:`save_without_target_io`)
TARGET_IO = ("embed_tokens.weight", "lm_head.weight")


def _as_input_of(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` in ``weight``'s dtype where they differ and autocast is off for ``x``'s device; else ``x``."""
    if x.dtype == weight.dtype or torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(weight.dtype)


def own_target_io(drafter):
    """Give a drafter that shares its target's embeddings and head (:meth:`DrafterBase.share_target_io`)
    copies of its own: saving needs them when the target ties the two (one tensor under two names,
    which ``save_pretrained`` refuses). Returns the drafter."""
    for module in (drafter.embed_tokens, drafter.lm_head):
        module.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=False)
    return drafter._restrict_to_draft_vocab()


def save_without_target_io(drafter, folder, dtype: torch.dtype = torch.float16) -> None:
    """``save_pretrained`` of the drafter's own weights in ``dtype``: the target's embeddings and LM head
    are left out (:func:`load_drafter` copies them from the target, as serving engines do)."""
    state = {k: v.to(dtype) for k, v in drafter.state_dict().items() if k not in TARGET_IO}
    drafter.save_pretrained(folder, state_dict=state)


def shares_target_io(folder) -> bool:
    """Whether the drafter folder left the target's embeddings and LM head out (they load from the target)."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    keys = set()
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            keys.update(h.keys())
    return bool(files) and not any(k in keys for k in TARGET_IO)
