"""The language-modelling loss the trainer runs (:mod:`distill.base.lm` holds its parts and the
held-out evaluation that model packages share)."""

from __future__ import annotations

from .base.lm import inputs_and_labels, next_token_ce
from .data import Batch


def lm_loss(model, batch: Batch):
    inputs, labels = inputs_and_labels(batch)
    return next_token_ce(model(input_ids=inputs).logits, labels), {}
