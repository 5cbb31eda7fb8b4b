"""Draft trees on the device, in shapes fixed by the tree's size: the static step's trees
(:mod:`serve_eval.static`), what :mod:`serve_eval.tree` does on the host, for R rows at once.

A tree of ``N`` nodes is four tensors [R, N]: ``tokens``, ``parents`` (0 = the root, ``i + 1`` = node
``i``), ``depths`` (1-based) and ``valid`` (a row may hold fewer than ``N`` nodes; the rest are padding,
never kept, attending to themselves only). Nodes come in depth order, so a parent precedes its children.

* :func:`best_first_tree`: the ``N`` best-scoring paths' nodes under per-depth scores (``log q``): a beam
  of ``N`` a depth holds every node of the best ``N`` (a path's score falls along it, so a node of the best
  ``N`` has its parent among them and among the best ``N`` of its depth), then the best ``N`` of all depths.
* :func:`draw_tokens`: at T > 0 the shape stays ``q``'s and each parent's children are drawn from ``q``
  without replacement in sibling order (Gumbel top-k: the same law as drawing one after another).
* :func:`walk`: the target's walk down each row's tree: greedily, the child carrying the target's argmax;
  sampled, recursive rejection sampling over each node's children in their order (:mod:`serve_eval.tree`'s
  rule), depth by depth for every row at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import Sampler
from .verify import _draw, _row_probs, uniforms


@dataclass
class Trees:
    tokens: torch.Tensor  # [R, N]
    parents: torch.Tensor  # [R, N]: 0 the root, i + 1 node i
    depths: torch.Tensor  # [R, N], 1-based
    valid: torch.Tensor  # [R, N] bool
    max_depth: int  # the deepest a node can be (the drafter's positions): fixes the path's width

    def ancestors(self) -> torch.Tensor:
        """[R, N + 1, N + 1] bool over [root, nodes]: a node sees itself, its ancestors and the root."""
        R, N = self.tokens.shape
        eye = torch.eye(N + 1, dtype=torch.bool, device=self.tokens.device)
        mask = eye.expand(R, -1, -1).clone()
        mask[:, :, 0] = True
        parent_rows = torch.cat([torch.zeros_like(self.parents[:, :1]), self.parents], dim=1)  # the root's: itself
        for _ in range(self.max_depth):  # each pass adds one generation
            mask = mask | mask.gather(1, parent_rows[:, :, None].expand(-1, -1, N + 1))
        valid = torch.cat([torch.ones_like(self.valid[:, :1]), self.valid], dim=1)
        return torch.where(valid[:, :, None], mask, eye)  # padding: itself only


def best_first_tree(scores: torch.Tensor, budget: int) -> Trees:
    """The ``budget`` best nodes under per-depth scores ``scores`` [R, D, V] (``log q``; ``-inf``: never a
    node), every row at once (see the module docstring)."""
    R, D, V = scores.shape
    N, k = budget, min(budget, V)
    vals, idx = scores.topk(k, dim=-1)  # [R, D, k]
    neg = torch.full((R, N), float("-inf"), dtype=vals.dtype, device=vals.device)
    score = neg.clone()
    score[:, :k] = vals[:, 0]
    token = torch.zeros(R, N, dtype=torch.long, device=vals.device)
    token[:, :k] = idx[:, 0]
    levels = [(score, token, torch.full_like(token, -1))]
    for d in range(1, D):
        cand = (levels[-1][0][:, :, None] + vals[:, d][:, None, :]).view(R, N * k)
        best, flat = cand.topk(N, dim=-1)
        levels.append((best, idx[:, d].gather(1, flat % k), flat // k))
    all_scores = torch.cat([lv[0] for lv in levels], dim=1)  # [R, D * N], depth-major
    top = all_scores.topk(N, dim=-1).indices
    chosen = torch.zeros_like(all_scores, dtype=torch.bool).scatter(1, top, True) & (all_scores > float("-inf"))
    chosen = chosen.view(R, D, N)
    for d in range(1, D):  # a node whose parent fell out at a tie falls out too
        chosen[:, d] &= chosen[:, d - 1].gather(1, levels[d][2].clamp_min(0))
    flat_chosen = chosen.view(R, D * N)
    slot = torch.where(flat_chosen, flat_chosen.long().cumsum(1) - 1, N)  # each chosen entry's node index
    slot_by_level = slot.view(R, D, N)
    parents = torch.cat(
        [torch.zeros(R, N, dtype=torch.long, device=vals.device)]
        + [slot_by_level[:, d - 1].gather(1, levels[d][2].clamp_min(0)) + 1 for d in range(1, D)],
        dim=1,
    )
    depth = torch.arange(1, D + 1, device=vals.device).repeat_interleave(N)[None].expand(R, -1)
    tokens = torch.cat([lv[1] for lv in levels], dim=1)

    def place(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(R, N + 1, dtype=values.dtype, device=values.device)
        return out.scatter(1, slot, values)[:, :N]

    valid = torch.arange(N, device=vals.device) < flat_chosen.sum(1, keepdim=True)
    return Trees(place(tokens), torch.where(valid, place(parents), 0), torch.where(valid, place(depth), 1), valid, D)


def sibling_ranks(trees: Trees) -> torch.Tensor:
    """Each node's rank among its parent's children (their order in the tree) [R, N]."""
    p = trees.parents
    N = p.shape[1]
    before = torch.ones(N, N, dtype=torch.bool, device=p.device).tril(-1)  # j < i
    return ((p[:, :, None] == p[:, None, :]) & before & trees.valid[:, None, :]).sum(-1)


def draw_tokens(trees: Trees, probs: torch.Tensor, samplers: list[Sampler]) -> Trees:
    """The tree's shape with each parent's children drawn from ``probs`` [R, D, V] (the drafter's sampling
    distributions per depth) without replacement, in sibling order: the largest ``log q + Gumbel`` of each
    parent's draws, one draw of ``V`` uniforms per parent (each row's from its own generator)."""
    R, N = trees.tokens.shape
    D, V = probs.shape[1:]
    ranks = sibling_ranks(trees)
    parent_depth = torch.cat([torch.zeros_like(trees.depths[:, :1]), trees.depths], dim=1)  # [R, N + 1]
    child_q = probs.gather(1, parent_depth.clamp_max(D - 1)[:, :, None].expand(-1, -1, V))  # [R, N + 1, V]
    u = uniforms(samplers, (N + 1) * V, probs.device).view(R, N + 1, V).clamp(1e-12, 1 - 1e-7)
    keys = child_q.log() - (-u.log()).log()  # log q + Gumbel
    k = min(N, V)
    drawn = keys.topk(k, dim=-1).indices  # [R, N + 1, k]: each parent's children, in draw order
    tokens = drawn[torch.arange(R, device=probs.device)[:, None], trees.parents, ranks.clamp_max(k - 1)]
    return Trees(torch.where(trees.valid, tokens, 0), trees.parents, trees.depths, trees.valid, trees.max_depth)


def walk(
    trees: Trees, logits: torch.Tensor, samplers: list[Sampler], probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's walk down its tree against the target's ``logits`` [R, N + 1, V] at [root, nodes]
    (``probs`` [R, D, V]: the drafter's distributions its nodes were drawn from, sampled rows). Returns
    the path [R, D + 1] (indices into [root, nodes], the root first; past its length, the last node
    again), each path's length [R] (the root counted) and the token after it [R]."""
    R, N = trees.tokens.shape
    device = logits.device
    rows = torch.arange(R, device=device)
    parents = trees.parents
    if samplers[0].greedy:
        choice = samplers[0].top(logits)[0]  # [R, N + 1]
        hit = trees.valid & (trees.tokens == choice.gather(1, parents))
        depth = trees.depths
        accepted = hit.clone()
        for _ in range(trees.max_depth):  # on the path: it and every ancestor carry the target's choice
            up = torch.cat([torch.ones_like(accepted[:, :1]), accepted], dim=1).gather(1, parents)
            accepted = hit & up
        last = torch.where(accepted, depth, 0).argmax(1) + 1  # the deepest (one per depth: siblings differ)
        last = torch.where(accepted.any(1), last, 0)
        return _path(trees, last), _depth_of(trees, last) + 1, choice.gather(1, last[:, None])[:, 0]
    D = trees.max_depth
    children = _children(trees)  # [R, N + 1, C]: each node's children (1-based), 0 past them
    C = children.shape[2]
    current = torch.zeros(R, dtype=torch.long, device=device)
    going = torch.ones(R, dtype=torch.bool, device=device)
    p_all = _row_probs(samplers, logits)  # [R, N + 1, V]
    following = torch.zeros(R, dtype=torch.long, device=device)
    for depth in range(D + 1):
        p = p_all[rows, current]  # [R, V]
        q = probs[:, min(depth, D - 1)].clone()  # the children's distribution (depth + 1, 1-based)
        moved = torch.zeros(R, dtype=torch.bool, device=device)
        u = uniforms(samplers, C, device)
        for j in range(C):
            child = children[rows, current, j]  # 0: none
            trying = going & ~moved & (child > 0)
            x = trees.tokens[rows, (child - 1).clamp_min(0)]
            q_i = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
            q_x, p_x = q_i.gather(1, x[:, None])[:, 0], p.gather(1, x[:, None])[:, 0]
            keep = trying & (u[:, j] * q_x < p_x)
            reject = trying & ~keep
            residual = (p - q_i).clamp_min(0)
            total = residual.sum(-1, keepdim=True)
            update = reject[:, None] & (total > 0)  # zero only when p == q_i, which never rejects
            p = torch.where(update, residual / total.clamp_min(1e-30), p)
            q = torch.where(reject[:, None], q.scatter(1, x[:, None], 0.0), q)
            moved |= keep
            current = torch.where(keep, child, current)
        ended = going & ~moved
        following = torch.where(ended, _draw(samplers, p), following)
        going &= moved
    return _path(trees, current), _depth_of(trees, current) + 1, following


def _depth_of(trees: Trees, node: torch.Tensor) -> torch.Tensor:
    """The depth of ``node`` [R] (0 = the root)."""
    depths = torch.cat([torch.zeros_like(trees.depths[:, :1]), trees.depths], dim=1)
    return depths.gather(1, node[:, None])[:, 0]


def _path(trees: Trees, last: torch.Tensor) -> torch.Tensor:
    """The path from the root to ``last`` [R] as [R, max_depth + 1] indices (past its end: ``last`` again)."""
    parents = torch.cat([torch.zeros_like(trees.parents[:, :1]), trees.parents], dim=1)
    up = [last]  # last, its parent, ..., the root, the root, ...
    for _ in range(trees.max_depth):
        up.append(parents.gather(1, up[-1][:, None])[:, 0])
    ancestors = torch.stack(up, dim=1)
    steps = _depth_of(trees, last)[:, None] - torch.arange(trees.max_depth + 1, device=last.device)
    return ancestors.gather(1, steps.clamp_min(0))


def _children(trees: Trees) -> torch.Tensor:
    """[R, N + 1, C]: node ``i``'s (0 = root) children in their order, as 1-based node indices; 0 past them."""
    R, N = trees.tokens.shape
    ranks = sibling_ranks(trees)
    C = N
    out = torch.zeros(R, N + 1, C + 1, dtype=torch.long, device=trees.tokens.device)
    target = torch.where(trees.valid, ranks, C)  # padding to the spare column
    nodes = torch.arange(1, N + 1, device=trees.tokens.device)[None].expand(R, -1)
    out[torch.arange(R, device=out.device)[:, None], trees.parents, target] = nodes
    return out[:, :, :C]
