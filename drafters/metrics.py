"""Acceptance of drafted blocks: per-position sums that add across batches and processes, their
summary (tau, conditional acceptance) and the replay of greedy serving (notation: :mod:`drafters.block`).

Acceptance (:func:`acceptance_stats`)
    For greedy verification a drafted token at block position ``k`` is kept iff it and every earlier
    one equal the target's argmax. With ``m_k`` that indicator, the per-position acceptance is the
    conditional rate ``acc_k = E[m_1..m_k] / E[m_1..m_{k-1}]`` and the mean accepted length of a block
    drawn uniformly is ``block_tau = 1 + sum_k prod_{j<=k} acc_j = 1 + sum_k E[m_1 ... m_k]`` (the
    bonus token counts one). The probabilistic variant (sampling at temperature 1) uses ``1 - TV(p, q)``
    in place of ``m_k``. Serving does not draw blocks uniformly: it visits the anchors where the last
    step ended, so it spends many steps where acceptance is low and few where it is high, and its
    tokens per step are lower than ``block_tau`` whenever acceptance varies along the text.
    :func:`decode_walk` replays serving over the target's greedy answers: the *simulated tau*.
"""

from __future__ import annotations

import torch


def acceptance_stats(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, accept: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums for greedy and probabilistic acceptance over chains [M, K] (positions 1..K of each draft:
    both argmaxes and alpha, as :class:`DrafterOutput` holds them).

    Returns sums (not means) so callers can add them across batches and processes:
    ``chains``, ``greedy_prefix[k]`` = number of chains whose first k+1 drafts all match the target's
    argmax, ``prob_prefix[k]`` = sum of prod_{j<=k} (1 - TV_j), ``match[k]`` = per-position matches.
    """
    match = (draft_tokens == target_tokens).float()
    return {
        "chains": torch.tensor(float(match.shape[0]), device=match.device),
        "greedy_prefix": match.cumprod(-1).sum(0),
        "prob_prefix": accept.float().cumprod(-1).sum(0),
        "match": match.sum(0),
    }


def accepted_lengths(draft_tokens: torch.Tensor, target_tokens: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Greedy drafts kept per chain: the number of leading positions whose draft equals the target's
    argmax (an unscored label ends the chain). [..., S] -> [...] (long)."""
    match = (draft_tokens == target_tokens) & scored.bool()
    return match.long().cumprod(-1).sum(-1)


def decode_walk(accepted: dict[int, int], first: int, last: int) -> tuple[int, int]:
    """``(tokens, target forwards)`` of greedy speculative decoding replayed over a known sequence.

    The sequence is the target's own greedy answer at positions ``first..last``; ``accepted[a]`` is how
    many drafts the block anchored at ``a`` (the bonus token at ``a``) keeps. The prefill emits
    ``x[first]``; each step at anchor ``a`` emits its kept drafts and the target's next token and moves
    to ``a + n + 1``. This is exactly what the decoding loop does at T=0 on this answer (its tau is
    tokens / forwards), so anchors are weighted as serving visits them: hard stretches take many steps,
    easy ones few, which a mean over uniformly drawn blocks does not see."""
    tokens, forwards, a = last - first + 1, 1, first
    while a < last:
        a += min(accepted.get(a, 0), last - a - 1) + 1
        forwards += 1
    return tokens, forwards


def summarize_acceptance(sums: dict[str, torch.Tensor], prefix: str = "val") -> dict[str, float]:
    """tau and per-position conditional acceptance from accumulated :func:`acceptance_stats` sums."""
    n = max(sums["chains"].item(), 1.0)  # no fully scored chain: report tau = 1
    greedy = sums["greedy_prefix"] / n
    prob = sums["prob_prefix"] / n
    prev = torch.cat([torch.ones(1, device=greedy.device), greedy[:-1]])
    cond = torch.where(prev > 0, greedy / prev.clamp_min(1e-12), torch.zeros_like(greedy))
    out = {f"{prefix}_block_tau": 1.0 + greedy.sum().item(), f"{prefix}_tau_probabilistic": 1.0 + prob.sum().item()}
    for k, a in enumerate(cond.tolist(), start=1):
        out[f"{prefix}_acc_{k}"] = a
    return out
