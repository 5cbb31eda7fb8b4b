"""Best-first draft trees hold the best-scoring paths, the ancestor mask matches the tree, and greedy tree
decoding emits exactly the target's greedy tokens."""

from __future__ import annotations

import itertools

import pytest
import torch

from serve_eval.loop import plain_generate, speculative_generate
from serve_eval.sampling import Sampler
from serve_eval.tree import build_best_first_tree, walk_tree

from ..conftest import KINDS, MAX_NEW


def test_best_first_tree_holds_the_top_scoring_paths():
    torch.manual_seed(0)
    log_probs = torch.randn(3, 5).log_softmax(-1)
    budget = 9
    tree = build_best_first_tree(log_probs, budget)
    paths = {}
    for i in range(len(tree)):  # each node's token path from the root
        path, node = [], i
        while node >= 0:
            path.append(int(tree.tokens[node]))
            node = int(tree.parents[node])
        paths[i] = tuple(reversed(path))
    assert [len(p) for p in paths.values()] == tree.depths.tolist()
    score = lambda p: sum(float(log_probs[d, t]) for d, t in enumerate(p))  # noqa: E731
    every = [p for depth in range(1, 4) for p in itertools.product(range(5), repeat=depth)]
    best = sorted(every, key=score, reverse=True)[:budget]
    assert sorted(paths.values()) == sorted(best)


def test_ancestor_mask_and_walk():
    # root -> a(5) -> b(6); root -> c(7)
    from serve_eval.tree import DraftTree

    tree = DraftTree(torch.tensor([5, 7, 6]), torch.tensor([-1, -1, 0]), torch.tensor([1, 1, 2]))
    mask = tree.ancestor_mask()
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    logits = torch.full((4, 10), -1.0)
    logits[0, 5] = logits[1, 6] = logits[3, 2] = 1.0  # the target picks 5, then 6, then 2
    path, nxt = walk_tree(tree, logits, Sampler())
    assert path == [0, 1, 3] and int(nxt) == 2


def test_lookup_continuation_copies_what_followed_the_last_match():
    from serve_eval.lookup import NgramIndex

    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert NgramIndex(seq).continuation(3) == [7, 8, 5]  # "2 3" last occurred before 7 (the longest n-gram that recurs)
    assert NgramIndex(seq).continuation(10) == [7, 8, 5, 2, 3]
    assert NgramIndex([4, 5, 6]).continuation(3) == []  # nothing recurs
    assert NgramIndex([5, 1, 5], max_ngram=3).continuation(2) == [1, 5]


def test_ngram_index_grown_piecewise_answers_as_a_scan_back():
    """The index, extended a few tokens at a time as a decoding loop grows it, against the definition
    read off the text directly: the latest earlier occurrence of the longest recurring final n-gram."""
    import random

    from serve_eval.lookup import NgramIndex

    def scan(seq, length, max_ngram):
        for n in range(min(max_ngram, len(seq) - 1), 0, -1):
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == seq[len(seq) - n :]:
                    return seq[start + n : start + n + length]
        return []

    rng = random.Random(0)
    for max_ngram in (1, 2, 3):
        seq = [rng.randrange(4) for _ in range(5)]
        index = NgramIndex(seq, max_ngram)
        for _ in range(60):
            assert index.continuation(4) == scan(seq, 4, max_ngram)
            new = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            seq += new
            index.extend(new)
    assert NgramIndex().continuation(3) == [] and NgramIndex([7]).continuation(3) == []


def test_graft_shares_the_agreeing_prefix_and_appends_the_rest():
    from serve_eval.lookup import graft
    from serve_eval.tree import DraftTree

    tree = DraftTree(torch.tensor([5, 7, 6]), torch.tensor([-1, -1, 0]), torch.tensor([1, 1, 2]))  # 5 -> 6; 7
    grafted, nodes = graft(tree, [5, 6, 4, 3])
    assert nodes == [0, 2, 3, 4]  # 5 and 6 were already there
    assert grafted.tokens.tolist() == [5, 7, 6, 4, 3] and grafted.parents.tolist() == [-1, -1, 0, 2, 3]
    assert grafted.depths.tolist() == [1, 1, 2, 3, 4]
    _, nodes = graft(tree, [8])
    assert nodes == [3]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("budget", [1, 6, 24])
def test_greedy_tree_decoding_equals_greedy(target_and_prompts, trained_drafters, kind, budget):
    target, _, prompts = target_and_prompts
    forwards = 0
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        ours, stats = speculative_generate(
            target, trained_drafters[kind], prompt, MAX_NEW, mode="tree", tree_budget=budget
        )
        assert ours == reference
        forwards += stats.target_forwards
    # trees of a trained drafter keep drafts (over all prompts: the tiny target's answers can be runs of
    # whitespace on which a 250-step drafter never ranks the right token near the top)
    assert forwards < MAX_NEW * len(prompts) or budget == 1


def test_tree_beats_chain_on_acceptance(target_and_prompts, trained_drafters):
    """A 32-node tree holds the alternatives a chain lacks: over the prompts it needs fewer target forwards
    than the chain of the same drafter (not every prompt: the steps fall at other positions)."""
    target, _, prompts = target_and_prompts
    chain = sum(
        speculative_generate(target, trained_drafters["dflash"], p, MAX_NEW)[1].target_forwards for p in prompts
    )
    tree = sum(
        speculative_generate(target, trained_drafters["dflash"], p, MAX_NEW, mode="tree", tree_budget=32)[
            1
        ].target_forwards
        for p in prompts
    )
    assert tree < chain, (tree, chain)
