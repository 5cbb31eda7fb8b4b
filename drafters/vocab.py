"""Draft vocabularies: a drafter that proposes only from the N target tokens the target emits most.

EAGLE-3's reduced draft vocabulary, in the form vLLM speculators and SGLang load: draft id ``i``
stands for target id ``t_i`` (``ids``, ascending), stored as the offset table ``d2t[i] = t_i - i``;
``t2d`` marks the target ids that have a draft id. The drafter's output head (and DSpark's Markov
head) is computed on those N rows only, so its cost falls by V / N: on a real target (150k tokens) the
LM head is most of a 1-layer drafter's arithmetic.

Lossless for any N. The restricted drafter's distribution ``q`` is zero outside the draft vocabulary
(its logits are -inf there, over the full vocabulary, so the loop sees the same shapes as before).
At temperature 0 a target argmax outside it is never drafted: that draft is rejected and the bonus
token is the target's own. At temperature > 0 speculative sampling is exact for any proposal ``q``:
tokens outside are reached through the residual ``max(0, p - q)``. Only acceptance (tau) changes:
by at most the target's probability mass outside the draft vocabulary, position by position.

**Per-step vocabularies** (:class:`CandidateHead`, SpecVocab's idea: Williams et al. 2026): a fixed
list misses the rare tokens of the text at hand, which at T > 0 the target samples often. Every call
picks its own subset of a fixed size: the static ids, plus the ``k`` tokens whose probability is
highest in any of the call's rows under a rank-``r`` approximation of the head (``W ~ U S V^T``, a
truncated SVD of the head's own weights: ``x V`` then ``(U S)``, ``r (H + V)`` multiply-adds a row
instead of ``V H``), and computes exact logits on that subset only. The subset depends only on the
drafter's hidden states (and on what the caller adds to the logits, DSpark's Markov term after the
token drawn before), known before the call's drafts are drawn, so the argument above holds for every
call: ``q`` is exactly the softmax over the subset that drafting drew from, and verification reads
those same logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# a drafter's heads onto the vocabulary -> their logits outside a draft vocabulary: -inf for the head
# whose softmax is the drafter's distribution, 0 for a term added to it (DSpark's Markov head)
VOCAB_HEADS = {"lm_head": float("-inf"), "markov_out": 0.0}


def over_vocab(small: torch.Tensor, ids: torch.Tensor, vocab_size: int, fill: float) -> torch.Tensor:
    """Logits ``small`` [..., len(ids)] of the ids ``ids`` placed over the whole vocabulary, ``fill`` elsewhere."""
    return small.new_full((*small.shape[:-1], vocab_size), fill).index_copy_(-1, ids, small)


def frequent_tokens(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` ids with the largest ``counts`` [V] (ties to the lower id), ascending."""
    if not 0 < n <= counts.numel():
        raise ValueError(f"a draft vocabulary of {n} tokens does not fit a vocabulary of {counts.numel()}")
    order = torch.argsort(
        counts.double() - torch.arange(counts.numel(), dtype=torch.float64) * 1e-9, descending=True, stable=True
    )
    return order[:n].sort().values


def coverage(ids: torch.Tensor, counts: torch.Tensor) -> float:
    """The share of the counted tokens that the draft vocabulary ``ids`` holds."""
    return float(counts[ids].sum() / counts.sum().clamp_min(1))


def d2t(ids: torch.Tensor) -> torch.Tensor:
    """Offsets from draft ids to target ids (``target = draft + d2t[draft]``), as speculators stores them."""
    return ids - torch.arange(len(ids), device=ids.device)


def t2d(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Which target ids have a draft id."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=ids.device)
    mask[ids] = True
    return mask


class RestrictedHead(nn.Linear):
    """A head onto the vocabulary (a bias-free Linear) computed on the draft vocabulary's rows only; its
    logits come back over the full vocabulary, ``fill`` elsewhere (-inf for a head whose softmax is the
    drafter's distribution, 0 for a term added to one, such as DSpark's Markov head). It keeps the
    full ``weight`` (the same Parameter: saved and loaded under the same name as before) and multiplies
    a copy of its ``ids`` rows, taken when it is made."""

    def __init__(self, head: nn.Linear, ids: torch.Tensor, fill: float = float("-inf")):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.fill = head.in_features, head.out_features, fill
        self.weight = head.weight
        self.register_parameter("bias", None)
        self.register_buffer("ids", ids.to(head.weight.device), persistent=False)
        self.register_buffer("rows", head.weight.detach()[self.ids].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return over_vocab(F.linear(x, self.rows), self.ids, self.out_features, self.fill)


class CandidateHead(nn.Linear):
    """A head onto the vocabulary computed, at each call, on its own subset (module doc, per-step
    vocabularies): ``static`` ids plus the ``candidates`` ids likeliest in any row under a rank-``rank``
    approximation of the head; logits come back over the full vocabulary, ``fill`` elsewhere. The
    truncated SVD is ``torch.svd_lowrank`` with a fixed seed (the same factors every time, at any
    vocabulary size). It keeps the full ``weight`` (the same Parameter) and a copy of the static rows."""

    def __init__(
        self, head: nn.Linear, static: torch.Tensor | None, candidates: int, rank: int, fill: float = float("-inf")
    ):
        nn.Module.__init__(self)
        static = (torch.empty(0, dtype=torch.long) if static is None else static.to(torch.long).unique()).to(
            head.weight.device
        )
        if not 0 < candidates <= head.out_features - len(static) or not 0 < rank <= min(
            head.in_features, head.out_features
        ):
            raise ValueError(
                f"{len(static)} static ids and {candidates} candidates at rank {rank} do not fit a "
                f"{head.out_features} x {head.in_features} head"
            )
        self.in_features, self.out_features, self.fill = head.in_features, head.out_features, fill
        self.candidates, self.rank = candidates, rank
        self.weight = head.weight
        self.register_parameter("bias", None)
        weight = head.weight.detach()
        with torch.random.fork_rng(devices=[weight.device] if weight.device.type == "cuda" else []):
            torch.manual_seed(0)
            u, s, v = torch.svd_lowrank(weight.float(), q=rank, niter=4)
        self.register_buffer("down", v.to(weight.dtype).contiguous(), persistent=False)  # [H, r]
        self.register_buffer("up", (u * s).T.to(weight.dtype).contiguous(), persistent=False)  # [r, V]
        self.register_buffer("static", static, persistent=False)
        self.register_buffer("rows", weight[static].contiguous(), persistent=False)  # copied once, as RestrictedHead's
        self.register_buffer("is_static", t2d(static, head.out_features), persistent=False)

    def select(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        """The subset for hidden states ``x`` [..., H] (and a ``shift`` the caller adds to the logits): the
        static ids, then, ascending, the ``candidates`` other ids whose approximate probability is highest
        in any of the rows (a fixed size: ``len(static) + candidates``)."""
        approx = x.reshape(-1, self.in_features) @ self.down @ self.up
        if shift is not None:
            approx = approx + shift.reshape(approx.shape)
        best = (
            approx.log_softmax(-1).amax(0).masked_fill_(self.is_static, float("-inf"))
        )  # [V]: the likeliest in any row
        return torch.cat([self.static, best.topk(self.candidates).indices.sort().values])

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [..., V] of ``x`` [..., H]; with ``shift`` [..., V], a term added to them (DSpark's Markov
        term), the candidates are the best of approximation + shift and the result includes it."""
        ids = self.select(x, shift)
        extra = torch.index_select(self.weight, 0, ids[len(self.static) :])  # ~8x faster than weight[ids] here
        small = torch.cat([F.linear(x, self.rows), F.linear(x, extra)], dim=-1)
        if shift is not None:
            small = small + shift[..., ids]
        return over_vocab(small, ids, self.out_features, self.fill)

    def summary(self) -> dict:
        """What a report records: the setting, and the rows each call computes."""
        return {
            "static": len(self.static),
            "candidates": self.candidates,
            "rank": self.rank,
            "size": len(self.static) + self.candidates,
        }


def speculate_vocab(drafter, static: torch.Tensor | None, candidates: int, rank: int) -> CandidateHead:
    """Give a loaded drafter a per-step vocabulary (:class:`CandidateHead`) on its output head, in place:
    a decoding setting, not saved with it. DSpark's Markov term keeps its whole vocabulary: DSpark
    passes it as the head's ``shift``, position by position, so that the tokens it favours are
    candidates too. Returns the head."""
    head = CandidateHead(_full(drafter.lm_head), static, candidates, rank)
    drafter.lm_head = head
    return head


def restrict_vocab(drafter, ids: torch.Tensor):
    """Restrict a loaded drafter's decoding heads to the draft vocabulary ``ids`` (in place; returns it)
    and record it: ``config.draft_vocab_size`` and the buffer ``draft_vocab`` go with the drafter
    when it is saved, and loading restricts it again (:class:`drafters.base.DrafterBase`). Only its
    proposals change; its weights do not. Call it again after the heads' weights change."""
    ids = ids.to(torch.long).sort().values
    for name, fill in VOCAB_HEADS.items():
        head = getattr(drafter, name, None)
        if isinstance(head, nn.Linear):
            setattr(drafter, name, RestrictedHead(_full(head), ids, fill=fill))
    drafter.register_buffer("draft_vocab", ids.to(drafter.lm_head.weight.device), persistent=True)
    drafter.config.draft_vocab_size = len(ids)
    return drafter


def _full(head: nn.Linear) -> nn.Linear:
    """A restricted head's plain Linear over the whole vocabulary (the same weight), or ``head``."""
    if not isinstance(head, (RestrictedHead, CandidateHead)):
        return head
    plain = nn.Linear(head.in_features, head.out_features, bias=False, device="meta")
    plain.weight = head.weight
    return plain
