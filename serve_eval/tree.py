"""Draft trees (DDTree): best-first construction from per-depth drafter distributions, one-forward
verification with an ancestor-only mask, and the walk that follows the target's choices.

Construction. A block drafter gives a distribution ``q_d`` for every depth ``d = 1..D`` of the block
at once (EAGLE-3 gives the per-step distributions of its greedy chain, which then stand for every
node at that depth: a cheaper tree than re-drafting per node, and exactly as lossless). A node is a path of tokens; its score is ``sum_d log q_d(token_d)``. Starting from the best
child of the root, a heap pops the best node, adds it, and pushes its next sibling (same parent, the
next-ranked token at that depth) and its first child (the best token one depth deeper), until
``budget`` nodes. Because candidates at each depth are visited in rank order, every node's score is
no higher than its parent's and its older sibling's, so the popped nodes are exactly the ``budget``
best-scoring paths' nodes that form a tree.

Verification. The root (the bonus token, position ``a``) and all nodes are read by the target in one
forward: node ``i`` sits at position ``a + depth_i`` and attends to the cached prefix and to its own
ancestors only. Walking down from the root, the target *chooses* the next token from its own
distribution at the current node (argmax, or a sample with the run's sampler); if a child carries that
token the walk moves there, otherwise the chosen token is the new bonus. Every emitted token is thus
the target's own choice given the emitted prefix: lossless at any temperature, for any tree. The KV
cache keeps the prefix and the accepted path's entries only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] node tokens (the root, the bonus token, is not stored)
    parents: torch.Tensor  # [N] index of the parent node, -1 for the root
    depths: torch.Tensor  # [N] 1-based depth
    log_q: torch.Tensor | None = None  # [N] the drafter's log-probability of each node's token at its depth

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> "DraftTree":
        """The first ``n`` nodes: a tree whenever every parent comes before its children (pop order)."""
        log_q = None if self.log_q is None else self.log_q[:n]
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], log_q)

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
    """The ``budget`` best nodes under per-depth log-probabilities ``log_probs`` [D, V]."""
    depth_max, vocab = log_probs.shape
    ranked, order = log_probs.topk(min(budget, vocab), dim=-1)  # sorted; a full argsort costs 50x more
    ranked, order = ranked.tolist(), order.tolist()
    tokens, parents, depths, log_q = [], [], [], []
    heap = [(-ranked[0][0], 0, 1, 0, -1)]  # (-score, tie-break, depth, rank, parent)
    tie = 1
    while heap and len(tokens) < budget:
        neg, _, depth, rank, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(order[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        log_q.append(ranked[depth - 1][rank])
        if rank + 1 < len(order[depth - 1]):
            sibling = -neg - ranked[depth - 1][rank] + ranked[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, tie, depth, rank + 1, parent))
            tie += 1
        if depth < depth_max:
            heapq.heappush(heap, (neg - ranked[depth][0], tie, depth + 1, 0, node))
            tie += 1
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.tensor(log_q))


def walk_tree(tree: DraftTree, logits: torch.Tensor, choose) -> tuple[list[int], torch.Tensor]:
    """Follow the target down the tree. ``logits`` [N+1, V] are the target's at [root, nodes];
    ``choose(logits_row) -> token``. Returns the accepted path (indices into [root, nodes], starting
    with the root) and the token that follows it."""
    kids = tree.children()
    path, current = [0], 0
    while True:
        token = choose(logits[current])
        child = kids[current].get(int(token))
        if child is None:
            return path, token
        path.append(child)
        current = child
