"""One step of the target as the decoding loop runs it: logits and the features a drafter reads."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from distill.base.features import FeatureCapture, TargetFeatures
from distill.base.masks import LayerMasks


class TargetForward:
    """``(input_ids, position_ids, attention_mask, cache)`` -> logits [B, n, V] and the features
    ``capture`` names (None without one); with ``logits_at`` [B] the logits at that position of each
    row only, [B, 1, V] (a prefill reads the last prompt token's, and the head's product over the other
    positions is skipped where the model takes ``logits_to_keep``).

    The model's own forward with ``capture``'s hooks, unless a backend hands in ``walk``: a callable with
    :class:`serve_eval.cpu.lean.LeanForward`'s signature that computes the same bits (the CPU backend's
    walk of the modules without transformers' module machinery)."""

    def __init__(self, target, capture: FeatureCapture | None = None, walk: Callable | None = None):
        self.target, self.capture, self.walk = target, capture, walk
        self.keeps = "logits_to_keep" in inspect.signature(target.forward).parameters
        self.masks = LayerMasks(target)  # a caller's mask, per layer (sliding windows, eager attention's form)

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache,
        logits_at: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, TargetFeatures | None]:
        """``attention_mask``: None (causal over the cache) or a boolean [B, 1, n, slots] visibility mask;
        ``key_positions`` [B, slots]: each slot's position where it is not the slot's index (a tree's
        nodes), for windowed layers (:mod:`distill.base.masks`)."""
        capture = self.capture
        if self.walk is not None:
            mask = None if attention_mask is None else self.masks.prepare(attention_mask)
            logits, captured = self.walk(
                input_ids, position_ids, mask, cache, None if capture is None else capture.layer_ids, logits_at
            )
            return logits, None if capture is None else capture.features(captured)
        with self.masks.applied(attention_mask, position_ids, key_positions) as mask:
            kwargs = dict(
                input_ids=input_ids, position_ids=position_ids, attention_mask=mask, cache=cache, use_cache=True
            )
            if logits_at is not None and self.keeps:  # each row's own position (transformers' slice_logits_to_keep)
                kwargs["logits_to_keep"], logits_at = logits_at.to(input_ids.device)[:, None], None
            if capture is None:
                logits, features = self.target(**kwargs).logits, None
            else:
                with capture.hooks() as captured:
                    logits = self.target(**kwargs).logits
                features = capture.features(captured)
        if logits_at is not None:  # a model that computes every position's logits: read the rows' own
            logits = torch.take_along_dim(logits, logits_at.to(logits.device)[:, None, None], dim=1)
        return logits, features
