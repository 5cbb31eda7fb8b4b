"""Prompt lookup (n-gram) drafts grafted onto a draft: a drafter-free branch that copies.

Text often repeats what came before it (code above all: names, calls, whole lines). Prompt-lookup
decoding (Saxena 2023; ``generate(prompt_lookup_num_tokens=...)`` in transformers) finds the last
earlier occurrence of the sequence's final ``n`` tokens (longest ``n`` first) and proposes the tokens
that followed it. Here that continuation is *grafted* onto the drafter's chain or best-first tree as
one more path from the root: where it agrees with the drafter it shares nodes, where it departs it
adds a branch, so one verify forward checks both.

Every row of a batch grafts its own copy onto its own draft (:mod:`serve_eval.loop`).

Lossless at any temperature. Greedy: the walk follows the target's argmax, so the tree stays lossless
and only the candidates grow. Sampled: a copied token is not a draw from the drafter's ``q`` but a
deterministic function of the text so far, i.e. a draw from a point mass, and recursive rejection
sampling (:mod:`serve_eval.tree`) takes any proposal whose probabilities it knows: a copied child
``c``, tried after the node's drawn children, is kept with probability ``p_i(c)`` (``min(1, p_i(c) /
1)``) and otherwise leaves ``p_i`` with ``c`` removed and renormalised (``norm(max(0, p_i - delta_c))``).
Whether a node gets a copied child depends on its drawn children (a copy equal to one is merged into
it), which is allowed: a stage may depend on the draws before it, as long as each stage samples its
own residual exactly. The graft appends its new nodes, so they follow every drawn node
(``DraftTree.drafted``).
"""

from __future__ import annotations

import torch

from .tree import DraftTree


class NgramIndex:
    """A growing sequence and, for each n-gram (``n <= max_ngram``) followed by a token, its latest
    start, so that :meth:`continuation` costs ``max_ngram`` dictionary reads however long the text,
    where a scan back over it costs a slice compare per position (~100 us at 200 tokens, a row a step).
    An n-gram starting at ``s`` is indexed once the token after it is known (``s + n < len``): the
    sequence's final n-gram is never its own match."""

    def __init__(self, tokens: list[int] = (), max_ngram: int = 3):
        self.tokens: list[int] = []
        self.max_ngram = max_ngram
        self.latest: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        seq, old = self.tokens, len(self.tokens)
        seq.extend(tokens)
        for follower in range(max(old, 1), len(seq)):  # n-grams that end just before a new token
            for n in range(1, min(self.max_ngram, follower) + 1):
                self.latest[tuple(seq[follower - n : follower])] = follower - n  # later starts overwrite

    def continuation(self, length: int) -> list[int]:
        """Up to ``length`` tokens that followed the last earlier occurrence of the sequence's final
        ``n``-gram, for the longest ``n <= max_ngram`` that occurs earlier; [] when none does."""
        seq = self.tokens
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            start = self.latest.get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return seq[start + n : start + n + length]
        return []


def graft(tree: DraftTree, tokens: list[int]) -> tuple[DraftTree, list[int]]:
    """``tree`` with the path ``tokens`` from the root merged in: returns the new tree (new nodes
    appended, so parents still come first and every copied node follows the drawn ones: its
    ``drafted``) and, per path token, its node index."""
    parents, depths, node_tokens = tree.parents.tolist(), tree.depths.tolist(), tree.tokens.tolist()
    children: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(parents, node_tokens)):
        children.setdefault((p, t), i)
    path, current = [], -1
    for depth, token in enumerate(tokens, start=1):
        node = children.get((current, token))
        if node is None:
            node = len(node_tokens)
            parents.append(current)
            depths.append(depth)
            node_tokens.append(token)
            children[(current, token)] = node
        path.append(node)
        current = node
    return DraftTree(
        torch.tensor(node_tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        torch.tensor(depths, dtype=torch.long),
        tree.drawn,
    ), path
