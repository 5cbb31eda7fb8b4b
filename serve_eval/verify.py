"""Verification of R rows: each row's chain (:func:`verify_chains`) or tree (:func:`walk_trees`) against
the target's logits, greedily or by speculative sampling with the row's own sampler; and the outcomes
the calibration learns from beyond what was verified.

Greedy: a row keeps the longest prefix of its drafts that equals the target's argmax after each, and the
argmax after them is its new bonus. Speculative sampling (Leviathan et al. 2023; Chen et al. 2023),
chain form: drafts ``d_k ~ q_k`` are checked in order; ``d_k`` is accepted with probability
``min(1, p_k(d_k) / q_k(d_k))``; at the first rejection the replacement is drawn from the residual
``norm(max(0, p_k - q_k))`` and the chain stops; if every draft is accepted a bonus is drawn from
``p_K``. The accepted mass is ``min(p, q)`` and the residual supplies the rest, so each emitted token is
distributed exactly as ``p`` given the emitted prefix, for any ``q``; a copied token (prompt lookup) is a
point mass, ``q_k(d_k) = 1``. Trees: :mod:`serve_eval.tree`.
"""

from __future__ import annotations

import torch

from .sampling import Sampler, top_tokens, without
from .tree import DraftTree, walk_tree


def choose_rows(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [R, ..., V], each with its row's sampler."""
    if samplers[0].greedy:
        return samplers[0].top(logits)[0]
    return torch.stack([s.choose(row) for s, row in zip(samplers, logits)])


def greedy_chains(
    drafts: torch.Tensor, reads: list[int], logits: torch.Tensor, top=top_tokens
) -> tuple[list[int], torch.Tensor]:
    """Greedy verification of every row at once: row ``r`` read its bonus and ``drafts[r, :reads[r] - 1]``
    (``drafts`` [R, n - 1]) and keeps the longest prefix equal to the target's argmax after each
    (``logits`` [R, n, V]; ``top``: the greedy rule). Returns each row's drafts kept and its new bonus [R]."""
    choice = top(logits)[0]  # [R, n]
    R = len(reads)
    if drafts.shape[1] == 0:
        kept = torch.zeros(R, dtype=torch.long, device=choice.device)
    else:
        kept = (drafts.to(choice.device) == choice[:, :-1]).int().cumprod(1).sum(1)
        if min(reads) < drafts.shape[1] + 1:  # padded rows: no further than their own drafts
            kept = kept.minimum(torch.tensor(reads, device=kept.device) - 1)
    return kept.tolist(), choice[torch.arange(R, device=choice.device), kept]


def verify_chain(
    sampler: Sampler, drafts: torch.Tensor, draft_logits: torch.Tensor | None, target_logits: torch.Tensor
):
    """One row: accept a prefix of ``drafts`` [K-1] against the target's logits [K, V] (after the bonus and
    each draft). Returns ``(n, next_token)``: the drafts kept and the token that follows them.
    ``draft_logits`` None: the drafts are copies (prompt lookup), point masses: a copy is kept with
    probability ``p_k(d_k)``, else the residual is ``p_k`` without ``d_k``."""
    if sampler.greedy:
        kept, bonus = greedy_chains(drafts[None], [len(drafts) + 1], target_logits[None], sampler.top)
        return kept[0], bonus[0]
    p = sampler.probs(target_logits)
    q = None if draft_logits is None else sampler.probs(draft_logits)
    for k, d in enumerate(drafts.tolist()):
        if sampler.uniform() * (1.0 if q is None else q[k, d]) < p[k, d]:  # u < p/q without dividing by a tiny q
            continue
        if q is None:
            return k, sampler.sample(without(p[k], d))
        residual = (p[k] - q[k]).clamp_min(0)
        return k, sampler.sample(residual / residual.sum())
    return len(drafts), sampler.sample(p[-1])


def verify_chains(
    samplers: list[Sampler], ids: torch.Tensor, reads: list[int], draft_logits: list, logits: torch.Tensor
):
    """Each row ``r`` verifies the drafts ``ids[r, 1:reads[r]]`` (read after its bonus ``ids[r, 0]``) against
    the target's ``logits[r, :reads[r]]``; ``draft_logits[r]``: the logits they were drawn from (None:
    copies). Returns each row's drafts kept and the token that follows them [R]."""
    if samplers[0].greedy:
        return greedy_chains(ids[:, 1:], reads, logits, samplers[0].top)
    kept, bonus = [], []
    for r, m in enumerate(reads):
        k, b = verify_chain(samplers[r], ids[r, 1:m], None if m == 1 else draft_logits[r], logits[r, :m])
        kept.append(k)
        bonus.append(b.view(()))
    return kept, torch.stack(bonus)


def walk_trees(samplers: list[Sampler], trees: list[DraftTree], logits: torch.Tensor, probs: list):
    """Each row ``r`` walks its tree ``trees[r]`` down the target's ``logits[r]`` ([root, nodes] first);
    ``probs[r]``: the drafter's distributions its nodes were sampled from (None when greedy). Returns
    each row's accepted path (indices into [root, nodes], the root first) and the token after it [R]."""
    paths, bonus = [], []
    for r, tree in enumerate(trees):
        path, token = walk_tree(tree, logits[r, : len(tree) + 1], samplers[r], probs[r])
        paths.append(path)
        bonus.append(torch.as_tensor(token).view(()))
    return paths, torch.stack(bonus)


def next_outcome(
    sampler: Sampler, drafts, draft_probs, target_logits, verified: int, accepted: int, bonus: int
) -> float | None:
    """Whether (T = 0), or with what probability (T > 0), the first draft left unverified would have
    been kept, from the target's logits after the kept ones (``draft_probs``: the distributions the drafts
    were drawn from; ``bonus``: the token the target chose there); None when it does not apply."""
    if accepted < verified or verified >= len(drafts):
        return None
    draft = int(drafts[verified])
    if sampler.greedy:
        return float(bonus == draft)
    p, q = float(sampler.probs(target_logits[accepted])[draft]), float(draft_probs[verified, draft])
    return min(1.0, p / q) if q > 0 else 1.0


def unverified_outcomes(
    sampler: Sampler, full: DraftTree, verified: int, path: list[int], logits, q
) -> dict[int, float]:
    """The nodes past the verified ones (indices into ``full``, the whole best-first tree) that would have
    been tried after the walk's last node, and whether (T = 0), or with what probability (T > 0), each
    would have been kept, from the target's logits there. At T = 0 every such child counts (kept iff it
    is the target's argmax); at T > 0 the first only, when the last node had no verified child: a fresh
    draw from ``q`` is kept with probability ``sum_x min(p, q)``."""
    last = path[-1]
    children = [i for i in range(verified, len(full)) if int(full.parents[i]) + 1 == last]
    if not children:
        return {}
    row = logits[last]
    if sampler.greedy:
        choice = int(row.argmax())
        return {i: float(int(full.tokens[i]) == choice) for i in children}
    if any(int(full.parents[i]) + 1 == last for i in range(verified)):
        return {}  # its verified children were rejected: the residual, not p, would meet the next one
    depth = int(full.depths[children[0]])
    return {children[0]: float(torch.minimum(sampler.probs(row), q[depth - 1]).sum())}


def uniforms(samplers: list[Sampler], count: int, device) -> torch.Tensor:
    """``count`` uniform draws per row [R, count], each row's from its sampler's generator (one call for
    rows that share one)."""
    gens = [s.generator for s in samplers]
    if all(g is gens[0] for g in gens):
        return torch.rand(len(samplers), count, generator=gens[0], device=device)
    return torch.stack([torch.rand(count, generator=g, device=device) for g in gens])


def accept_chains(
    samplers: list[Sampler],
    ids: torch.Tensor,
    logits: torch.Tensor,
    draft_logits: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify_chains` without a host read, for rows of one length: row ``r`` read its bonus and drafts
    ``ids[r]`` [R, n] and may keep its first ``lengths[r]`` drafts (None: all ``n - 1``; the rest were
    read to keep the shape, and count as never drafted). ``logits`` [R, n, V]: the target's after each;
    ``draft_logits`` [R, n - 1, V]: the drafter's the drafts were drawn from (sampled rows only). Returns
    each row's drafts kept [R] and the token that follows them [R], both on the device.

    Sampled: draft ``k`` is kept when ``u_k q_k(d_k) < p_k(d_k)`` and every draft before it was; the token
    after the kept ones is drawn from ``norm(max(0, p - q))`` where a draft was rejected there, and from
    ``p`` where the row's drafts ran out (the module docstring's rule, every row at once)."""
    R, n = ids.shape
    drafts = ids[:, 1:]
    limit = None if lengths is None else torch.arange(n - 1, device=ids.device) < lengths[:, None]
    if samplers[0].greedy:
        choice = samplers[0].top(logits)[0]  # [R, n]
        match = drafts == choice[:, :-1]
        kept = (match if limit is None else match & limit).int().cumprod(1).sum(1)
        return kept, choice.gather(1, kept[:, None])[:, 0]
    p = _row_probs(samplers, logits)  # [R, n, V]
    if n == 1:
        return torch.zeros(R, dtype=torch.long, device=ids.device), _draw(samplers, p[:, 0])
    if draft_logits is None:
        raise ValueError("sampled chains are verified against the logits their drafts were drawn from")
    q = _row_probs(samplers, draft_logits)  # [R, n - 1, V]
    p_d = p[:, :-1].gather(-1, drafts[..., None])[..., 0]
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    keep = uniforms(samplers, n - 1, ids.device) * q_d < p_d  # u < p/q without dividing by a tiny q
    kept = (keep if limit is None else keep & limit).int().cumprod(1).sum(1)
    at = kept[:, None, None].expand(R, 1, p.shape[-1])
    p_k = p.gather(1, at)[:, 0]
    rejected = kept < (n - 1 if lengths is None else lengths)  # the draft at ``kept`` was read and refused
    q_k = torch.cat([q, q.new_zeros(R, 1, q.shape[-1])], 1).gather(1, at)[:, 0] * rejected[:, None]
    return kept, _draw(samplers, (p_k - q_k).clamp_min(0))


def _row_probs(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """Each row's sampling distribution of ``logits`` [R, ..., V] (one call where the rows' settings agree)."""
    first = samplers[0]
    if all((s.temperature, s.top_k, s.top_p) == (first.temperature, first.top_k, first.top_p) for s in samplers):
        return first.probs(logits)
    return torch.stack([s.probs(row) for s, row in zip(samplers, logits)])


def _draw(samplers: list[Sampler], weights: torch.Tensor) -> torch.Tensor:
    """One token per row of ``weights`` [R, V], each drawn with its row's generator."""
    gens = [s.generator for s in samplers]
    if all(g is gens[0] for g in gens):
        return samplers[0].sample(weights)
    return torch.stack([s.sample(row) for s, row in zip(samplers, weights)])
