"""Per-position losses of a drafted block against the target, and how block positions are weighted.

For block position ``k`` (``k = 1..K-1``) with the drafter's distribution ``q_k``, the target's ``p_k``
(softmax of the logits the target produced at that position) and the data's token ``x_k``:

    ce   CE(q_k, x_k)                                  the data's token (the target's own, when regenerated)
    kl   KL(p_k || q_k) = sum_v p log(p / q)             forward KL: the whole target distribution
    tv   TV(p_k, q_k) = 1/2 sum_v |p - q|                 DSpark; 1 - TV is the acceptance probability
    lk   -log alpha_k,  alpha_k = sum_v min(p, q)        acceptance-rate (LK) loss: maximises alpha directly

``alpha_k = 1 - TV_k`` is the probability that speculative sampling accepts a token drawn from ``q_k``.
A draft at position ``k`` only counts if every earlier one was accepted, so positions are weighted:

    exp     w_k = exp(-(k-1) / gamma)                   fixed decay (DFlash's reference, gamma = 7 at K = 16)
    dpace   w_k = prod_{j<k} alpha_j  (detached)        the probability that position k is reached at all
                                                         (D-PACE; speculators' default), per block

The loss is ``sum_terms weight_t * sum_k w_k l_t(k) / sum_k w_k`` over scored positions only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TERMS = ("ce", "kl", "tv", "lk")
POSITION_WEIGHTINGS = ("exp", "dpace")


def acceptance_probability(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """``alpha = sum_v min(p, q) = 1 - TV(p, q)`` over the last dimension."""
    return torch.minimum(p_logits.float().softmax(-1), q_logits.float().softmax(-1)).sum(-1)


def position_loss(term: str, draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Loss ``term`` at every position: logits [..., V], labels [...] -> [...]."""
    q = draft_logits.float()
    if term == "ce":
        return F.cross_entropy(q.flatten(0, -2), labels.flatten(), reduction="none").view_as(labels)
    if term == "kl":
        log_p = target_logits.float().log_softmax(-1)
        return (log_p.exp() * (log_p - q.log_softmax(-1))).sum(-1)
    if term == "tv":
        return 1.0 - acceptance_probability(target_logits, q)
    if term == "lk":
        return -acceptance_probability(target_logits, q).clamp_min(1e-6).log()
    raise ValueError(f"unknown loss term {term!r}; expected one of {LOSS_TERMS}")


def position_weights(num: int, gamma: float, device=None) -> torch.Tensor:
    """Loss weights ``exp(-(k-1)/gamma)`` for block positions ``k = 1..num``."""
    return torch.exp(-torch.arange(num, device=device, dtype=torch.float32) / gamma)


def block_weights(weighting: str, gamma: float, draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per-position weights, broadcastable to [..., K-1] (see the module doc); never carry gradients."""
    if weighting == "exp":
        return position_weights(draft_logits.shape[-2], gamma, draft_logits.device)
    if weighting == "dpace":
        with torch.no_grad():
            alpha = acceptance_probability(target_logits, draft_logits)
            reach = torch.cat([torch.ones_like(alpha[..., :1]), alpha[..., :-1]], dim=-1).cumprod(-1)
        return reach
    raise ValueError(f"unknown position weighting {weighting!r}; expected one of {POSITION_WEIGHTINGS}")


def weighted_mean(values: torch.Tensor, weights: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``values`` [..., K] with ``weights`` (broadcastable), over the ``scored`` entries only."""
    w = weights.expand_as(values)
    if scored is not None:
        w = w * scored
    return (values * w).sum() / w.sum().clamp_min(1e-12)


def block_loss(terms: dict[str, float], weighting: str, gamma: float, draft_logits: torch.Tensor,
               target_logits: torch.Tensor, labels: torch.Tensor, scored: torch.Tensor | None):
    """``(loss, parts)``: the weighted sum of ``terms`` (name -> weight) and each term's weighted mean."""
    w = block_weights(weighting, gamma, draft_logits, target_logits)
    parts = {t: weighted_mean(position_loss(t, draft_logits, target_logits, labels), w, scored) for t, c in terms.items() if c}
    loss = sum(terms[t] * v for t, v in parts.items())
    return loss, parts, w
