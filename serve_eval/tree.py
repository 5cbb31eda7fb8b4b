"""Draft trees (DDTree): best-first construction from per-depth drafter distributions, verification in one
forward with an ancestor-only mask, and the walk that follows the target's choices.

Construction. The drafter gives a distribution ``q_d`` for each depth ``d = 1..D`` (a block drafter all
at once; an autoregressive one along its own chain, which then stands for every node at that depth). A
node is a path of tokens scored ``sum_d log q_d(token_d)``; a heap pops the best node and pushes its
next sibling and its first child, so the first ``budget`` pops are the best-scoring paths' nodes and
form a tree (a node after its parent).

Verification. The root (the bonus, position ``a``) and every node are read in one forward; node ``i``
sits at position ``a + depth_i`` and sees the cached prefix and its own ancestors. The cache then
keeps the accepted path only.

Greedy walk (T = 0): from the root, move to the child carrying the target's argmax; where none does,
the argmax is the new bonus. Every emitted token is the target's greedy choice, for any tree.

Sampled trees (T > 0): the best-first *shape* (a function of ``q`` alone) filled by sampling each node's
children from ``q_d`` without replacement; the walk is recursive rejection sampling (SpecTr; RSD): child
``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``, ``q_i`` the drafter's distribution
over tokens not drawn before it, and a rejection leaves ``p_{i+1} = norm(max(0, p_i - q_i))``; when every
child is rejected the token is drawn from the last residual. Each stage outputs exactly ``p_i``, so the
emitted token follows ``p``. Nodes from ``DraftTree.drafted`` on are copied tokens
(:mod:`serve_eval.lookup`): point masses, kept with probability ``p_i(x)``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from .sampling import without


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] node tokens (the root, the bonus token, is not stored)
    parents: torch.Tensor  # [N] index of the parent node, -1 for the root
    depths: torch.Tensor  # [N] 1-based depth
    drafted: int | None = None  # nodes from this index on are copied tokens (point masses); None = none are

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def drawn(self) -> int:
        """How many nodes (the first ones) were drawn from the drafter; the rest are copies."""
        return len(self) if self.drafted is None else self.drafted

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes: a tree whenever every parent comes before its children (pop order)."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.drafted)

    @staticmethod
    def chain(tokens: torch.Tensor) -> DraftTree:
        """A chain: node ``i`` is the child of node ``i - 1`` (the root's for ``i = 0``)."""
        n = len(tokens)
        return DraftTree(tokens.cpu(), torch.arange(-1, n - 1), torch.arange(1, n + 1))

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over [root, nodes]: True where the row's node may attend (itself, ancestors)."""
        n = len(self)
        mask = torch.eye(n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, parent in enumerate(self.parents.tolist()):
            row = i + 1
            if parent >= 0:
                mask[row] |= mask[parent + 1]
        return mask

    def children(self) -> list[dict[int, int]]:
        """For the root (index 0) and every node (index i+1): token -> child's index (i+1 numbering)."""
        kids: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
        for i, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            kids[parent + 1].setdefault(token, i + 1)
        return kids


def build_best_first_tree(log_probs: torch.Tensor, budget: int) -> DraftTree:
    """The ``budget`` best nodes under per-depth log-scores ``log_probs`` [D, V]: ``log q``, or any
    scores ``<= 0`` (the loop's budget passes the log of its calibrated acceptance ``a(q)``); tokens
    scored ``-inf`` (probability 0) are never nodes."""
    depth_max, vocab = log_probs.shape
    best = log_probs.topk(min(budget, vocab), dim=-1)  # sorted; a full argsort costs 50x more
    ranked: list[list[float]] = best.values.tolist()
    order: list[list[int]] = best.indices.tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    heap = [(-ranked[0][0], 0, 1, 0, -1)]  # (-score, tie-break, depth, rank, parent)
    tie = 1
    while heap and len(tokens) < budget:
        neg, _, depth, rank, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(order[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        if rank + 1 < len(order[depth - 1]) and ranked[depth - 1][rank + 1] > float("-inf"):  # q > 0 only
            sibling = -neg - ranked[depth - 1][rank] + ranked[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, tie, depth, rank + 1, parent))
            tie += 1
        if depth < depth_max:
            heapq.heappush(heap, (neg - ranked[depth][0], tie, depth + 1, 0, node))
            tie += 1
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


def sample_tree(tree: DraftTree, probs: torch.Tensor, sampler) -> DraftTree:
    """``tree``'s shape with tokens drawn from ``probs`` [D, V] (the drafter's sampling distributions
    per depth): each node's children without replacement, in sibling order. Siblings of one rank are
    drawn together; a shape built from the same ``probs`` never asks for more children than tokens
    of positive probability."""
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    tokens = [0] * len(tree)
    drawn: dict[int, list[int]] = {parent: [] for parent in parents}  # tokens a parent's children hold so far
    ranks: dict[int, list[int]] = {}  # sibling rank -> nodes of that rank
    seen: dict[int, int] = {}
    for i, parent in enumerate(parents):
        seen[parent] = seen.get(parent, -1) + 1
        ranks.setdefault(seen[parent], []).append(i)
    for nodes in ranks.values():
        weights = probs[[depths[i] - 1 for i in nodes]].clone()
        for row, i in enumerate(nodes):
            weights[row, drawn[parents[i]]] = 0.0
        for i, token in zip(nodes, sampler.sample(weights).tolist()):
            tokens[i] = token
            drawn[parents[i]].append(token)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), tree.parents, tree.depths, tree.drafted)


def walk_tree(tree: DraftTree, logits: torch.Tensor, sampler, probs: torch.Tensor | None = None):
    """Follow the target down the tree. ``logits`` [N+1, V] are the target's at [root, nodes]. At
    temperature 0 the walk follows the target's argmax; otherwise ``probs`` [D, V] are the drafter's
    distributions the tree was sampled from (:func:`sample_tree`) and each node's children are tried by
    recursive rejection sampling. Returns the accepted path (indices into [root, nodes], starting with
    the root) and the token that follows it."""
    if sampler.greedy:
        children = tree.children()
        path, current = [0], 0
        while True:
            token = sampler.choose(logits[current])
            child = children[current].get(int(token))
            if child is None:
                return path, token
            path.append(child)
            current = child
    kids: list[list[int]] = [[] for _ in range(len(tree) + 1)]  # children in sibling (draw) order
    for i, parent in enumerate(tree.parents.tolist()):
        kids[parent + 1].append(i + 1)
    tokens, depths = tree.tokens.tolist(), tree.depths.tolist()
    drafted = tree.drawn  # children past it are copied tokens
    path, current = [0], 0
    while True:
        p = sampler.probs(logits[current])
        accepted = None
        sampled = [child for child in kids[current] if child <= drafted]
        q = probs[depths[sampled[0] - 1] - 1].clone() if sampled and probs is not None else None
        for child in kids[current]:  # drawn children first, then a copied one (graft appends)
            x = tokens[child - 1]
            if child > drafted:  # a point mass on x: kept with probability p(x), else p without x
                if sampler.uniform() < float(p[x]):
                    accepted = child
                    break
                p = without(p, x)
                continue
            assert q is not None  # a drawn child: the walk was given the distributions it was drawn from
            q_i = q / q.sum()
            if sampler.uniform() * float(q_i[x]) < float(p[x]):
                accepted = child
                break
            residual = (p - q_i).clamp_min(0)
            if float(residual.sum()) > 0:  # zero only when p == q_i, which never rejects
                p = residual / residual.sum()
            q[x] = 0.0
        if accepted is None:
            return path, sampler.sample(p)
        path.append(accepted)
        current = accepted
