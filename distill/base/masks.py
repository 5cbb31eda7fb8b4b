"""A caller's attention mask, given to every layer as that layer attends: sliding windows and eager attention.

A windowed layer (Mistral, Gemma 3, gpt-oss, Qwen3 with windows) lets the token at position ``p``
attend to keys at positions ``k`` with ``p - window < k <= p`` (transformers' ``sliding_window_overlay``).
When a model builds its own masks it applies every layer's window; a finished 4-D mask of the caller's
(a draft tree's ancestors, a batch's rows, PARD's mask blocks) reaches every layer unchanged, window or
not. :class:`LayerMasks` gives each windowed layer the caller's mask with its window cut in, by the
*positions* of queries and keys (a tree node's position is its depth, not its slot; a PARD mask slot's
is its anchor's plus its index), through a pre-hook on the layer's attention for the duration of the
forward; and converts a boolean mask to the additive form eager attention adds to its scores.

The decoding loops keep every layer's whole history (:func:`serve_eval.kv.inplace_cache`: transformers'
sliding cache keeps only the last ``window - 1`` entries and cannot be rolled back past a rejected
draft), so there a forward without a mask of its own (a prompt, a chain) lets the model apply its
windows to absolute positions, exactly as over its own sliding cache, and a forward with one goes
through :class:`LayerMasks`.

Invariant: each token's attention sees exactly the keys the model's own causal forward gives it, so the
loops stay lossless on windowed targets and PARD trains what it serves (tested per family, with
contexts past the window).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from distill.base.features import decoder_layers

#: the attention kinds the decoding loops reproduce (a config's ``layer_types``)
LOOP_LAYER_KINDS = ("full_attention", "sliding_attention")


def unsupported_layers(config: dict) -> str | None:
    """Why the decoding loops cannot run a target of this ``config.json`` (its text config for a
    multimodal one), or None: layer kinds other than full and sliding-window attention (Llama 4's
    chunked attention, linear-attention layers) would be verified with the wrong masks."""
    text = config.get("text_config") or config
    kinds = sorted(set(text.get("layer_types") or ()) - set(LOOP_LAYER_KINDS))
    if kinds:
        return (
            f"{text.get('model_type', 'this model')} has {', '.join(kinds)} layers; the decoding loop supports "
            f"{' and '.join(LOOP_LAYER_KINDS)} only"
        )
    return None


def layer_windows(target) -> list[int | None]:
    """Each decoder layer's sliding window (None: it attends to the whole context). An attention
    module's own ``sliding_window`` wins (Gemma 3, gpt-oss, Qwen3); else the config's ``layer_types``
    with ``sliding_window`` (or every layer windowed, Mistral's way). Other layer kinds (chunked
    attention) are refused: the loops would not reproduce them."""
    config = target.config
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    out = []
    why = unsupported_layers(config.to_dict())
    if why:
        raise ValueError(why)
    for i, layer in enumerate(decoder_layers(target)):
        kind = types[i] if types else "sliding_attention"
        attention = getattr(layer, "self_attn", None)
        if attention is not None and hasattr(attention, "sliding_window"):
            out.append(attention.sliding_window)
        else:
            out.append(window if kind == "sliding_attention" else None)
    return out


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive one eager attention adds to its scores (0 / dtype min)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


class LayerMasks:
    """Per-layer attention masks for a target's forward with a caller's 4-D visibility mask: the mask as
    given where a layer sees everything, the mask with the layer's window cut in where it has one, each
    converted to the additive form where the model attends eagerly (eager attention adds its mask)."""

    def __init__(self, target):
        self.windowed: list[
            tuple[Any, int]
        ] = []  # (attention module, window) of each windowed layer; no window: no layer lookup (any model)
        if getattr(target.config, "sliding_window", None) is not None:
            self.windowed = [
                (layer.self_attn, w) for layer, w in zip(decoder_layers(target), layer_windows(target)) if w is not None
            ]
        self.eager = target.config._attn_implementation == "eager"
        self.dtype = next(target.parameters()).dtype

    def prepare(self, mask: torch.Tensor) -> torch.Tensor:
        return additive(mask, self.dtype) if self.eager and mask.dtype == torch.bool else mask

    @contextlib.contextmanager
    def applied(self, mask: torch.Tensor | None, query_positions: torch.Tensor, key_positions: torch.Tensor | None):
        """Within: ``mask`` [B, 1, n, S] (boolean, or None) is what the model gets (:meth:`prepare`d), and each
        windowed layer's attention gets ``mask & (query position - key position < window)``. Query
        positions [B, n]; key positions [B, S] (None: a key's slot is its position)."""
        if mask is None or not self.windowed:
            yield None if mask is None else self.prepare(mask)
            return
        if key_positions is None:
            key_positions = torch.arange(mask.shape[-1], device=mask.device)[None]
        distance = query_positions.to(mask.device)[:, None, :, None] - key_positions.to(mask.device)[:, None, None, :]
        cut = {w: self.prepare(mask & (distance < w)) for w in {w for _, w in self.windowed}}
        handles = [
            attention.register_forward_pre_hook(functools.partial(_with_mask, cut[w]), with_kwargs=True)
            for attention, w in self.windowed
        ]
        try:
            yield self.prepare(mask)
        finally:
            for handle in handles:
                handle.remove()


def _with_mask(mask, _module, args, kwargs):
    if "attention_mask" not in kwargs:
        raise RuntimeError(
            "a windowed attention layer was called without an attention_mask keyword: the decoding "
            "loop cannot cut its window in"
        )
    return args, {**kwargs, "attention_mask": mask}
