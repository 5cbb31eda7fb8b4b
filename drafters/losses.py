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

**With a draft vocabulary** ``D`` (:mod:`drafters.vocab`; ``q`` is 0 outside it): ``tv`` and ``lk`` stay
as they are (``alpha = sum_{v in D} min(p, q)`` is what serving accepts); ``ce`` scores only labels in
``D`` (elsewhere ``q`` is 0: no draft can be right); ``kl`` and ``soft_ce`` compare ``q`` with ``p``
renormalized over ``D`` (EAGLE-3's training). ``accept`` and the argmaxes are serving's: ``p`` over the
whole vocabulary, so the simulated tau counts the target's choices outside ``D`` as rejections.

**At real vocabulary sizes** (a Qwen3 target: 151,936 tokens) the logits of one batch do not fit: a
DFlash batch of 8 x 512 anchors x 15 positions is 61k positions, 37 GB in fp32 for the drafter's
logits alone, again for the target's. :func:`block_scores` therefore takes the *hidden states* and
the functions that map them to logits, and with ``chunk`` set walks the blocks ``chunk`` positions at
a time under activation checkpointing: a chunk's logits exist only while its sums are taken, and are
recomputed in the backward pass. Every term is a sum over positions divided by a sum of detached
weights, and a block's D-PACE weights need only that block, so chunks of whole blocks give the same
loss (and gradients) as one pass. What evaluation needs comes back per position, never
vocabulary-sized: the drafter's and the target's argmax and ``alpha``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_TERMS = ("ce", "kl", "tv", "lk")
POSITION_WEIGHTINGS = ("exp", "dpace")


def acceptance_probability(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """``alpha = sum_v min(p, q) = 1 - TV(p, q)`` over the last dimension."""
    return torch.minimum(p_logits.float().softmax(-1), q_logits.float().softmax(-1)).sum(-1)


def position_loss(
    term: str, draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
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
    if term == "soft_ce":  # CE against the target's whole distribution (EAGLE-3's loss; KL plus p's entropy)
        return -(target_logits.float().softmax(-1) * q.log_softmax(-1)).sum(-1)
    raise ValueError(f"unknown loss term {term!r}; expected one of {LOSS_TERMS}")


def position_weights(num: int, gamma: float, device=None) -> torch.Tensor:
    """Loss weights ``exp(-(k-1)/gamma)`` for block positions ``k = 1..num``."""
    return torch.exp(-torch.arange(num, device=device, dtype=torch.float32) / gamma)


def block_weights(
    weighting: str, gamma: float, draft_logits: torch.Tensor, target_logits: torch.Tensor
) -> torch.Tensor:
    """Per-position weights, broadcastable to [..., K-1] (see the module doc); never carry gradients."""
    alpha = None
    if weighting == "dpace":
        with torch.no_grad():
            alpha = acceptance_probability(target_logits, draft_logits)
    return _weights(weighting, gamma, draft_logits.shape[-2], alpha, draft_logits.device)


def _weights(weighting: str, gamma: float, num: int, alpha: torch.Tensor | None, device) -> torch.Tensor:
    """:func:`block_weights` from the (detached) acceptance probabilities ``alpha`` [..., K-1]."""
    if weighting == "exp":
        return position_weights(num, gamma, device)
    if weighting == "dpace":
        return torch.cat([torch.ones_like(alpha[..., :1]), alpha[..., :-1]], dim=-1).cumprod(-1)
    raise ValueError(f"unknown position weighting {weighting!r}; expected one of {POSITION_WEIGHTINGS}")


def weighted_mean(values: torch.Tensor, weights: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``values`` [..., K] with ``weights`` (broadcastable), over the ``scored`` entries only."""
    w = weights.expand_as(values)
    if scored is not None:
        w = w * scored
    return (values * w).sum() / w.sum().clamp_min(1e-12)


def block_loss(
    terms: dict[str, float],
    weighting: str,
    gamma: float,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    scored: torch.Tensor | None,
):
    """``(loss, parts, weights)``: the weighted sum of ``terms`` (name -> weight) and each term's weighted
    mean, on logits: the definition. Drafters compute it with :func:`block_scores` (from hidden states,
    in chunks where asked), which the tests hold equal to this."""
    w = block_weights(weighting, gamma, draft_logits, target_logits)
    parts = {
        t: weighted_mean(position_loss(t, draft_logits, target_logits, labels), w, scored)
        for t, c in terms.items()
        if c
    }
    loss = sum(terms[t] * v for t, v in parts.items())
    return loss, parts, w


@dataclass
class BlockScores:
    """:func:`block_scores`: the loss, each term's weighted mean, and per position [..., S]: the
    weights, ``accept`` (alpha, detached) and both argmaxes; the logits only when not chunked."""

    loss: torch.Tensor
    parts: dict[str, torch.Tensor]
    weights: torch.Tensor
    accept: torch.Tensor
    draft_tokens: torch.Tensor
    target_tokens: torch.Tensor
    draft_logits: torch.Tensor | None = None
    target_logits: torch.Tensor | None = None


def _block_sums(
    terms: tuple[str, ...],
    weighting: str,
    gamma: float,
    q: torch.Tensor,
    p: torch.Tensor,
    labels: torch.Tensor,
    scored: torch.Tensor,
    vocab: torch.Tensor | None = None,
):
    """Per block (rows [M, S]): each term's weighted sum [M, T], the weight sum [M], then the weights,
    alpha, and both argmaxes [M, S]. ``vocab``: the draft vocabulary (module doc)."""
    with torch.no_grad():
        alpha = acceptance_probability(p, q)
    w = _weights(weighting, gamma, labels.shape[-1], alpha, q.device).expand_as(labels)
    ws = w * scored
    if vocab is None:
        sums = torch.stack([(position_loss(t, q, p, labels) * ws).sum(-1) for t in terms], dim=-1)
    else:
        draft_id = torch.full((q.shape[-1],), -1, dtype=torch.long, device=q.device)
        draft_id[vocab] = torch.arange(len(vocab), device=q.device)
        inside, small = draft_id[labels] >= 0, draft_id[labels].clamp_min(0)
        q_d, p_d = q.index_select(-1, vocab), p.index_select(-1, vocab)
        sums = torch.stack(
            [
                (
                    position_loss(t, q, p, labels) * ws
                    if t in ("tv", "lk")
                    else position_loss(t, q_d, p_d, small) * ws * (inside if t == "ce" else 1)
                ).sum(-1)
                for t in terms
            ],
            dim=-1,
        )
    return sums, ws.sum(-1), w, alpha, q.argmax(-1), p.argmax(-1)


def block_scores(
    terms: dict[str, float],
    weighting: str,
    gamma: float,
    draft_fn: Callable[..., torch.Tensor],
    target_fn: Callable[[torch.Tensor], torch.Tensor],
    draft_in: tuple[torch.Tensor, ...],
    target_in: torch.Tensor,
    labels: torch.Tensor,
    scored: torch.Tensor,
    chunk: int | None = None,
    vocab: torch.Tensor | None = None,
) -> BlockScores:
    """The block loss of :func:`block_loss` from hidden states (see the module doc).

    ``labels`` and ``scored`` are [*lead, S] (blocks x positions); every tensor of ``draft_in`` and
    ``target_in`` starts with the same ``lead`` dimensions, which are flattened to one block dimension M
    before ``draft_fn(*rows) -> [m, S, V]`` and ``target_fn(rows) -> [m, S, V]`` (run without gradients)
    see them. ``chunk``: at most this many positions' logits at once (whole blocks, at least one);
    None: all at once, and the logits are returned too. ``vocab``: a draft vocabulary (``draft_fn``
    gives -inf outside it; ``target_fn`` the target's logits over the whole vocabulary)."""
    lead, S = labels.shape[:-1], labels.shape[-1]
    flat = [t.reshape(-1, *t.shape[len(lead) :]) for t in (*draft_in, target_in, labels, scored.to(torch.float32))]
    active = tuple(t for t, c in terms.items() if c)

    def part(*rows):
        *d, t, y, sc = rows
        q = draft_fn(*d)
        with torch.no_grad():
            p = target_fn(t)
        return _block_sums(active, weighting, gamma, q, p, y, sc, vocab), q, p

    M = flat[0].shape[0]
    if chunk is None or chunk >= M * S:
        sums, q, p = part(*flat)
        logits = (q.view(*lead, S, -1), p.view(*lead, S, -1))
    else:
        step = max(1, chunk // S)
        pieces = []

        def run(*r):
            return part(*r)[0]

        for i in range(0, M, step):
            rows = [x[i : i + step] for x in flat]
            pieces.append(checkpoint(run, *rows, use_reentrant=False) if torch.is_grad_enabled() else run(*rows))
        sums = tuple(torch.cat(z) for z in zip(*pieces))
        logits = (None, None)
    nums, den, w, accept, dt, tt = sums
    total = den.sum().clamp_min(1e-12)
    parts = {t: nums[:, i].sum() / total for i, t in enumerate(active)}
    loss = sum(terms[t] * v for t, v in parts.items())
    shape = (*lead, S)
    return BlockScores(
        loss, parts, w.reshape(shape), accept.reshape(shape), dt.reshape(shape), tt.reshape(shape), *logits
    )
