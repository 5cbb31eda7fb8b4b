"""Verification of R rows: each row's chain (:func:`~serve_eval.sampling.verify_chain`) or tree
(:func:`~serve_eval.tree.walk_tree`) against the target's logits, greedy or by speculative sampling with
the row's own sampler; and the outcomes the calibration learns from beyond what was verified.

Lossless per row: at temperature 0 every emitted token is the target's argmax given the row's emitted
prefix; at T > 0 it is distributed as the target's sampler-processed distribution given that prefix,
whatever was proposed (copied tokens are point masses; :mod:`serve_eval.tree`).
"""

from __future__ import annotations

import torch

from .sampling import Sampler, top_tokens, verify_chain
from .tree import DraftTree, walk_tree


def choose_rows(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [R, ..., V], each with its row's sampler."""
    if samplers[0].greedy:
        return top_tokens(logits)[0]
    return torch.stack([s.choose(row) for s, row in zip(samplers, logits)])


def verify_chains(samplers: list[Sampler], ids: torch.Tensor, reads: list[int], draft_logits: list, logits: torch.Tensor):
    """Each row ``r`` verifies the drafts ``ids[r, 1:reads[r]]`` (read after its bonus ``ids[r, 0]``) against
    the target's ``logits[r, :reads[r]]``; ``draft_logits[r]``: the logits they were drawn from (None:
    copies, point masses). Returns each row's drafts kept and the token that follows them [R]."""
    if len(reads) == 1:
        m = reads[0]
        n, bonus = verify_chain(samplers[0], ids[0, 1:m], draft_logits[0], logits[0, :m])
        return [n], bonus.view(1)
    if samplers[0].greedy:  # every row at once: the target's choices, the longest agreeing prefix
        counts = torch.tensor(reads)
        choice = top_tokens(logits)[0].cpu()  # [R, n]
        if ids.shape[1] == 1:
            kept = torch.zeros(len(reads), dtype=torch.long)
        else:
            kept = (ids[:, 1:].cpu() == choice[:, :-1]).int().cumprod(1).sum(1).minimum(counts - 1)
        return kept.tolist(), choice[torch.arange(len(reads)), kept].to(ids.device)
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
        path, token = walk_tree(tree, logits[r, :len(tree) + 1], samplers[r], probs[r])
        paths.append(path)
        bonus.append(torch.as_tensor(token).view(()))
    return paths, torch.stack(bonus)


def next_outcome(sampler: Sampler, drafts, draft_probs, target_logits, verified: int, accepted: int,
                 bonus: int) -> float | None:
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


def unverified_outcomes(sampler: Sampler, full: DraftTree, verified: int, path: list[int], logits, q) -> dict[int, float]:
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
