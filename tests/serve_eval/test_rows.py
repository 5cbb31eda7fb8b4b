"""The one loop over R rows (serve_eval.loop.generate): every drafter kind, chains and trees, budgets,
prompt-lookup copies and slots decode batches exactly as plain decoding does each row (T = 0), and
sample each row's target distribution (T = 1); a tree step per row computes what each row computes alone."""

from __future__ import annotations

import pytest
import torch

from distill.config import DrafterSection, ModelConfig
from distill.drafter_eval import build_drafter
from distill.models import build_causal_lm
from serve_eval import verify
from serve_eval.budget import Budget
from serve_eval.loop import generate, plain_generate
from serve_eval.proposers import LMProposer, PardProposer, make_proposer
from serve_eval.sampling import Sampler
from serve_eval.session import TargetSession
from serve_eval.tree import DraftTree

from .test_sampling import ALPHA, PROMPT, SAMPLES, VOCAB, chi_square_pvalue, exact_joint, toy_lm, toy_target  # noqa: F401

V = 64


def lm(seed: int, layers: int = 2, vocab: int = V, scale: float = 0.2):
    torch.manual_seed(seed)
    return build_causal_lm(
        ModelConfig(
            hidden_size=32,
            num_layers=layers,
            num_heads=4,
            intermediate_size=64,
            max_position_embeddings=256,
            initializer_range=scale,
        ),
        vocab,
    ).eval()


def rows_of(count: int = 4) -> list[torch.Tensor]:
    """Prompts of different lengths, some repeating themselves (prompt-lookup copies find matches)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, V, (5 + 3 * i,), generator=gen) for i in range(count)]
    prompts[1] = torch.cat([prompts[1], prompts[1]])
    return prompts


def proposer_of(kind: str, target):
    """A proposer of ``kind`` for ``target`` (3 layers): untrained block drafters and EAGLE-3 (mostly
    rejected), the target drafting for itself (always accepted), another LM, a PARD LM."""
    if kind in ("dflash", "dspark", "eagle3"):
        torch.manual_seed(0)
        section = DrafterSection(kind=kind, block_size=4, num_target_layers=3, target_layer_ids=[0, 1, 2])
        return make_proposer(build_drafter(section, target, "toy", mask_token_id=3).eval())
    return {
        "self": lambda: LMProposer(target, 3),
        "lm": lambda: LMProposer(lm(5, layers=1), 3),
        "pard": lambda: PardProposer(lm(6, layers=1), 4, mask_token_id=3),
    }[kind]()


@pytest.mark.parametrize("kind", ["dflash", "dspark", "eagle3", "self", "lm", "pard"])
def test_every_drafter_kind_decodes_batches_losslessly(kind):
    """Rows of different lengths, one stopping at an EOS early, fewer slots than prompts: chains and trees,
    with and without a budget, with prompt-lookup copies grafted on: each row equals its plain decoding."""
    target = lm(0, layers=3)
    prompts = rows_of()
    first = plain_generate(target, prompts[2], 24)[0]
    eos = first[6]
    reference = [plain_generate(target, p, 24, eos)[0] for p in prompts]
    assert len(set(map(len, reference))) > 1
    proposer = proposer_of(kind, target)
    K = proposer.block_size
    steps = {}
    for mode in ("chain", "tree"):
        for budget in (None, Budget({1: 1.0, 2: 1.02, 4 * K: 1.5})):
            for slots, lookup in ((None, 0), (2, 0), (3, 5)):
                outs, stats = generate(
                    target,
                    prompts,
                    24,
                    eos,
                    proposer=proposer,
                    budget=budget,
                    mode=mode,
                    tree_budget=5,
                    slots=slots,
                    lookup=lookup,
                )
                assert outs == reference, (mode, budget is not None, slots, lookup)
                steps[mode, budget is not None, slots, lookup] = stats.row_steps
    if kind == "self":  # the target drafting for itself: every draft kept, fewer steps than tokens
        assert steps["chain", False, None, 0] < sum(map(len, reference)) / 2


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_batches_sample_each_rows_target_distribution(toy_target, mode, monkeypatch):  # noqa: F811
    """T = 1, two rows of the test prompt with a longer one between them, each with its own generator,
    a block drafter and a causal LM drafting, trees and a budget: both counted rows follow the target;
    a tree walk that keeps the drafter's first child whatever the target says does not."""
    torch.manual_seed(2)
    section = DrafterSection(kind="dflash", block_size=3, target_layer_ids=[0, 1, 2])
    dflash = build_drafter(section, toy_target, "toy", mask_token_id=VOCAB - 1).eval()
    student = toy_lm(8, 1, 16)
    exact = exact_joint(toy_target, Sampler(temperature=1.0))
    rows = [PROMPT, torch.tensor([4, 1, 0, 2, 3]), PROMPT]

    def joint(proposer, budget=None) -> torch.Tensor:
        counts = torch.zeros(VOCAB, VOCAB)
        gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
        for _ in range(SAMPLES // 2):
            samplers = [Sampler(temperature=1.0, generator=g) for g in gens]
            outs, _ = generate(
                toy_target,
                rows,
                3,
                samplers=samplers,
                proposer=proposer,
                budget=budget,
                mode=mode,
                tree_budget=4,
                slots=2,
            )
            for out in outs[::2]:
                counts[out[1], out[2]] += 1
        return counts

    for proposer in (make_proposer(dflash), LMProposer(student, 2)):
        assert chi_square_pvalue(joint(proposer), exact) > ALPHA
    assert chi_square_pvalue(joint(make_proposer(dflash), Budget({1: 1.0, 3: 1.3, 6: 2.0, 9: 2.4})), exact) > ALPHA
    if mode == "tree":  # the test's power, once

        def first_child(tree, logits, sampler, probs):
            kids = tree.children()
            path = [0]
            while kids[path[-1]]:
                path.append(min(kids[path[-1]].values()))
            return path, sampler.choose(logits[path[-1]])

        monkeypatch.setattr(verify, "walk_tree", first_child)
        assert chi_square_pvalue(joint(make_proposer(dflash)), exact) < 1e-6


def test_a_tree_step_per_row_reads_what_each_row_reads_alone():
    """Ragged rows, each reading a tree of its own (padded to the step's largest, masked to its
    ancestors): each row's logits equal its own one-row session's; keeping each row's path leaves each
    row's cache as if it had read the path alone (the next step's logits agree)."""
    target = lm(0)
    prompts = rows_of(3)
    trees = [
        DraftTree(torch.tensor([6, 7, 8]), torch.tensor([-1, -1, 0]), torch.tensor([1, 1, 2])),
        DraftTree.chain(torch.tensor([9, 10])),
        DraftTree(torch.tensor([11, 12, 13, 14]), torch.tensor([-1, 0, 0, 1]), torch.tensor([1, 2, 2, 3])),
    ]
    paths = [[0, 1, 3], [0, 1], [0, 1, 3]]
    batch, alone = TargetSession(target), [TargetSession(target) for _ in prompts]
    batch.prefill(prompts)
    for a, p in zip(alone, prompts):
        a.prefill([p])
    n = max(len(t) for t in trees) + 1
    ids, depths = torch.zeros(3, n, dtype=torch.long), torch.zeros(3, n, dtype=torch.long)
    ancestors = torch.zeros(3, n, n, dtype=torch.bool)
    for r, tree in enumerate(trees):
        ids[r, 0], ids[r, 1 : len(tree) + 1] = 5, tree.tokens
        depths[r, 1 : len(tree) + 1] = tree.depths
        ancestors[r, : len(tree) + 1, : len(tree) + 1] = tree.ancestor_mask()
    together, _ = batch.step_tree(ids, depths, ancestors, torch.tensor([len(t) + 1 for t in trees]))
    for r, (a, tree) in enumerate(zip(alone, trees)):
        own, _ = a.step_tree(
            ids[r : r + 1, : len(tree) + 1], depths[r, : len(tree) + 1], ancestors[r, : len(tree) + 1, : len(tree) + 1]
        )
        torch.testing.assert_close(together[r, : len(tree) + 1], own[0], atol=1e-5, rtol=1e-5)
    batch.keep_paths(paths)
    fresh = [TargetSession(target) for _ in prompts]
    for f, p, path, row in zip(fresh, prompts, paths, ids):
        f.prefill([torch.cat([p, row[path]])])
    assert batch.lengths.tolist() == [f.length for f in fresh]
    after = torch.tensor([[20], [21], [22]])
    together, _ = batch.step(after)
    for r, f in enumerate(fresh):
        torch.testing.assert_close(together[r], f.step(after[r : r + 1])[0][0], atol=1e-5, rtol=1e-5)
