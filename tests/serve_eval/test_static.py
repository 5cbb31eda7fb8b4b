"""The static-shape step (serve_eval.static): one host read a step, lossless greedy and sampled, eager and
compiled, verify lengths in buckets; and the counter of host reads (serve_eval.syncs) it is held to."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from distill.config import DrafterSection
from distill.drafter_eval import build_drafter
from serve_eval import static
from serve_eval.backend import TORCH
from serve_eval.loop import generate, plain_generate
from serve_eval.proposers import make_proposer
from serve_eval.sampling import Sampler
from serve_eval.static import StaticBackend, bucket
from serve_eval.syncs import HostSyncs, syncs_per_step

from ..conftest import MAX_NEW
from .test_sampling import ALPHA, PROMPT, SAMPLES, VOCAB, chi_square_pvalue, exact_joint, toy_target  # noqa: F401

EAGER = StaticBackend(compile="off")


def test_the_counter_sees_every_kind_of_host_read():
    x = torch.arange(6.0)
    reads = [
        x[0].item,
        x.tolist,
        lambda: bool(x[1]),
        lambda: int(x[2]),
        lambda: float(x[3]),
        lambda: x[x > 2],  # a boolean mask: a shape from the data
        x.nonzero,
        lambda: torch.unique(x),
        lambda: range(10)[torch.tensor(2)],
    ]
    for read in reads:
        with HostSyncs() as syncs:
            read()
        assert syncs.count == 1, read
    with HostSyncs() as syncs:  # arithmetic, indexing by tensors and data-free shapes wait for nothing
        y = (x * 2).softmax(0)[torch.tensor([1, 2])]
        torch.where(y > 0, y, 0).cumsum(0).view(2, 1)
    assert syncs.count == 0


def _run(target, prompts, drafter, backend, samplers=None, mode="chain", new_proposer=None):
    """``run(n)``: decode ``prompts`` for ``n`` tokens with a fresh proposer (``new_proposer()``, or the
    drafter's), copies of ``samplers``; returns the target steps it took."""

    def run(n: int) -> int:
        proposer = new_proposer() if new_proposer else drafter and make_proposer(drafter, backend=backend)
        rows = [Sampler(**s.__dict__) if s else Sampler() for s in samplers or [None] * len(prompts)]
        return generate(target, prompts, n, None, rows, proposer, mode=mode, tree_budget=6, backend=backend)[1].steps

    return run


@pytest.mark.parametrize("kind", [None, "dflash", "dspark", "eagle3"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_static_step_reads_the_host_once(target_and_prompts, trained_drafters, kind, mode, rows, temperature):
    """Plain and speculative, chains and trees, one row and a ragged batch, greedy and sampled: at most one
    host read a step (the eager torch loop reads more, so the count has power)."""
    if kind is None and mode == "tree":
        pytest.skip("plain decoding has no trees")
    target, _, prompts = target_and_prompts
    drafter = None if kind is None else trained_drafters[kind]
    samplers = [Sampler(temperature=temperature, generator=torch.Generator().manual_seed(r)) for r in range(rows)]
    batch = [p[: 16 + 4 * r] for r, p in enumerate(prompts[:rows])]
    assert syncs_per_step(_run(target, batch, drafter, EAGER, samplers, mode), 8) <= 1.0
    if kind is not None:
        assert syncs_per_step(_run(target, batch, drafter, TORCH, samplers, mode), 8) > 1.0


@pytest.mark.parametrize("kind", ["dflash", "dspark", "eagle3"])
def test_static_decoding_equals_plain_greedy(target_and_prompts, trained_drafters, kind):
    """One row and ragged batches over two slots, every draft and a fixed number padded to a bucket, a
    confidence cut (DSpark), stop tokens: the tokens of plain greedy decoding."""
    target, _, prompts = target_and_prompts
    drafter = trained_drafters[kind]
    references = [plain_generate(target, p, MAX_NEW)[0] for p in prompts]
    assert [plain_generate(target, p, MAX_NEW, backend=EAGER)[0] for p in prompts] == references
    outs, stats = generate(target, prompts, MAX_NEW, proposer=make_proposer(drafter, backend=EAGER), backend=EAGER)
    assert outs == references
    assert max(s.tau for s in stats.prompts) > 1.0  # drafts were kept
    outs, _ = generate(target, prompts, MAX_NEW, proposer=make_proposer(drafter), slots=2, backend=EAGER)
    assert outs == references
    outs, stats = generate(target, prompts, MAX_NEW, proposer=make_proposer(drafter), verify_drafts=2, backend=EAGER)
    assert outs == references and all(len(s.drafted_by_position) == 2 for s in stats.prompts)  # 3 read, bucket 4
    if kind == "dspark":
        proposer = make_proposer(drafter, confidence_threshold=0.5)
        assert generate(target, prompts, MAX_NEW, proposer=proposer, backend=EAGER)[0] == references
    for slots in (None, 2):  # trees: one row, and ragged rows over two slots
        outs, stats = generate(
            target,
            prompts,
            MAX_NEW,
            proposer=make_proposer(drafter),
            mode="tree",
            tree_budget=6,
            slots=slots,
            backend=EAGER,
        )
        assert outs == references, slots
    stops = {references[0][10], references[1][5]}
    ours, _ = generate(target, prompts, MAX_NEW, stops, proposer=make_proposer(drafter), backend=EAGER)
    theirs = [plain_generate(target, p, MAX_NEW, stops)[0] for p in prompts]
    assert ours == theirs and len(theirs[0]) <= 11


def test_buckets_round_verify_lengths_up():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 33]
    backend = StaticBackend(buckets=(4, 12))
    assert bucket(5, backend.buckets) == 12
    assert backend.slots_for(100) == 256 and backend.slots_for(300) == 512


def test_the_static_backend_refuses_what_it_does_not_serve(target_and_prompts, trained_drafters):
    from serve_eval.budget import Budget

    target, _, prompts = target_and_prompts
    with pytest.raises(ValueError, match="decoding.backend = 'static': prompt-lookup copies"):
        generate(target, prompts[:1], 4, proposer=make_proposer(trained_drafters["dflash"]), lookup=5, backend=EAGER)
    with pytest.raises(ValueError, match="budget.adaptive"):
        proposer = make_proposer(trained_drafters["dflash"])
        generate(target, prompts[:1], 4, proposer=proposer, budget=Budget({1: 1.0, 2: 1.1}), backend=EAGER)
    with pytest.raises(ValueError, match="compile"):
        StaticBackend(compile="sometimes")


def accept_everything(samplers, ids, logits, draft_logits=None, lengths=None):
    kept = torch.full((ids.shape[0],), ids.shape[1] - 1)
    return kept, torch.stack([s.sample(s.probs(row[-1])) for s, row in zip(samplers, logits)])


def walk_the_first_child(trees, logits, samplers, probs=None):
    """A broken walk: follows each node's first child whatever the target says."""
    from serve_eval.static_tree import _path

    node = torch.zeros(trees.tokens.shape[0], dtype=torch.long)
    for _ in range(trees.max_depth):
        first = torch.where(trees.valid & (trees.parents == node[:, None]), 1, 0).argmax(1) + 1
        has = (trees.valid & (trees.parents == node[:, None])).any(1)
        node = torch.where(has, first, node)
    depth = torch.cat([torch.zeros_like(trees.depths[:, :1]), trees.depths], 1).gather(1, node[:, None])[:, 0]
    following = torch.stack([s.sample(s.probs(row[n])) for s, row, n in zip(samplers, logits, node)])
    return _path(trees, node), depth + 1, following


@pytest.mark.parametrize(
    "kind,args,mode",
    [
        ("dflash", {"temperature": 1.0}, "chain"),
        ("dspark", {"temperature": 0.8, "top_k": 4}, "chain"),
        ("eagle3", {"temperature": 1.0, "top_p": 0.9}, "chain"),
        ("dflash", {"temperature": 1.0}, "tree"),
        ("dspark", {"temperature": 1.0, "top_p": 0.9}, "tree"),
        ("eagle3", {"temperature": 1.0}, "tree"),
    ],
)
def test_static_sampling_follows_the_target_distribution(toy_target, kind, args, mode):  # noqa: F811
    """Batches of two rows, each with its own draws, drafted and verified on the device (a DSpark chain
    drawn position by position; trees whose children are drawn without replacement and walked by
    recursive rejection sampling): the (2nd, 3rd) tokens follow the target's exact joint distribution,
    and a verifier that keeps every draft (a walk that takes the first child) fails the test."""
    torch.manual_seed(5)
    section = DrafterSection(kind=kind, block_size=3, num_target_layers=3, target_layer_ids=[0, 1, 2])
    drafter = build_drafter(section, toy_target, "toy", mask_token_id=VOCAB - 1).eval()
    exact = exact_joint(toy_target, Sampler(**args))

    def joint() -> torch.Tensor:
        counts, gens = torch.zeros(VOCAB, VOCAB), [torch.Generator().manual_seed(s) for s in (1, 2)]
        for _ in range(SAMPLES // 2):
            samplers = [Sampler(**args, generator=g) for g in gens]
            outs, _ = generate(
                toy_target,
                [PROMPT, PROMPT],
                3,
                samplers=samplers,
                proposer=make_proposer(drafter),
                mode=mode,
                tree_budget=4,
                backend=EAGER,
            )
            for out in outs:
                counts[out[1], out[2]] += 1
        return counts

    assert chi_square_pvalue(joint(), exact) > ALPHA
    if kind == "dflash":
        broken = ("accept_chains", accept_everything) if mode == "chain" else ("walk", walk_the_first_child)
        with mock.patch.object(static, *broken):
            assert chi_square_pvalue(joint(), exact) < 1e-6, "the test cannot tell a broken verifier apart"


def test_compiled_static_decoding_is_lossless_with_one_graph_per_shape(target_and_prompts, trained_drafters):
    """``torch.compile`` of the verify and the draft (inductor's CPU kernels): plain decoding and every drafter
    kind (DFlash, DSpark, EAGLE-3, a causal LM, a PARD LM), chains and trees, equal eager plain decoding; one
    graph per function and (rows, length) shape, none compiled again by a second run or by counting host reads."""
    from serve_eval.proposers import LMProposer, PardProposer

    target, tok, prompts = target_and_prompts
    target = copy.deepcopy(target)
    compiled = StaticBackend(compile="on")
    references = [plain_generate(target, p, MAX_NEW)[0] for p in prompts[:2]]
    compiled.prepare(target, None, prompts, MAX_NEW)
    for kind in ("dflash", "dspark", "eagle3"):
        drafter = copy.deepcopy(trained_drafters[kind])
        for _ in range(2):
            outs, _ = generate(target, prompts[:2], MAX_NEW, proposer=make_proposer(drafter), backend=compiled)
            assert outs == references
        proposer = make_proposer(drafter)
        outs, _ = generate(
            target, prompts[:2], MAX_NEW, proposer=proposer, mode="tree", tree_budget=6, backend=compiled
        )
        assert outs == references
        assert syncs_per_step(_run(target, prompts[:2], drafter, compiled), 8) <= 1.0
    assert [plain_generate(target, p, MAX_NEW, backend=compiled)[0] for p in prompts[:2]] == references
    lm = copy.deepcopy(target)
    for proposer in (LMProposer(lm, 3), PardProposer(lm, 3, tok.mask_token_id)):
        assert generate(target, prompts[:2], MAX_NEW, proposer=proposer, backend=compiled)[0] == references
    # verify: (2 rows, a block of 4), (2 rows, a tree of 6 and its root), (1 row, 1 token), and (2 rows, a block
    # of 4) without features for the LMs; a block drafter's draft: 2 rows; EAGLE-3's: 2 rows; the LMs' forwards:
    # 2 rows of 4 tokens read, of 1 drafted, of 4 + 2 masks
    assert compiled.graphs == {"verify": 4, "draft": 2, "draft_eagle3": 1, "draft_lm": 3}


def test_a_divergence_is_reported_with_the_targets_top2_margin(toy_target):  # noqa: F811
    """An injected tie: two tokens whose output rows are equal have equal logits everywhere, so greedy
    decoding may take either; a run that took the other is reported at its first differing token with a
    margin of zero (at most the dtype's resolution), and the comparison says how it compared."""
    from serve_eval.measure import comparison, first_divergence

    target = copy.deepcopy(toy_target)
    with torch.no_grad():
        target.lm_head.weight[4] = target.lm_head.weight[3]
        target.lm_head.weight[3:5] *= 10  # the tie on top wherever it can be
    base, _ = plain_generate(target, PROMPT, 6)
    at = next(i for i, t in enumerate(base) if t == 3)
    ours = base[:at] + [4] + base[at + 1 :]
    found = first_divergence(target, PROMPT, base, ours)
    assert found["token"] == at and found["top2_margin"] <= found["resolution"]
    plain, _ = plain_generate(toy_target, PROMPT, 6)  # the target without the tie: a divergence is a bug's
    far = first_divergence(toy_target, PROMPT, plain, plain[:1] + [(plain[1] + 1) % VOCAB])
    assert far["token"] == 1 and far["top2_margin"] > 100 * far["resolution"]
    rows = [{"lossless": True}, {"lossless": False}]
    exact = comparison(rows, [{"prompt": 1, **found}], "cpu", torch.float32)
    assert exact["method"] == "exact" and exact["equal_fraction"] == 0.5 and exact["divergences"][0]["token"] == at
    assert comparison(rows, [], "cuda", torch.bfloat16)["method"] == "same dtype"
    assert comparison([{"lossless": None}], [], "cpu", torch.float32) is None  # sampled: nothing to compare


def test_device_trees_are_the_host_trees():
    """The best-first tree built on the device holds the same paths as serve_eval.tree's heap, row by row,
    and its ancestor mask and walk agree with the host tree's."""
    from serve_eval.static_tree import best_first_tree, walk
    from serve_eval.tree import build_best_first_tree, walk_tree

    gen = torch.Generator().manual_seed(0)

    def paths(tokens, parents, n):  # each node as the tokens from the root to it
        out = []
        for i in range(n):
            path, j = [], i + 1
            while j > 0:
                path.append(tokens[j - 1])
                j = parents[j - 1]
            out.append(tuple(reversed(path)))
        return sorted(out)

    for budget in (1, 5, 12):
        scores = torch.randn(3, 4, 9, generator=gen).log_softmax(-1)
        trees = best_first_tree(scores, budget)
        logits = torch.randn(3, budget + 1, 9, generator=gen)
        logits[:, :, 0] += 3.0  # the target often agrees with a node
        path, length, following = walk(trees, logits, [Sampler()] * 3)
        for r in range(3):
            host = build_best_first_tree(scores[r], budget)
            n = int(trees.valid[r].sum())
            assert n == len(host)
            ours = paths(trees.tokens[r].tolist(), trees.parents[r].tolist(), n)
            assert ours == paths(host.tokens.tolist(), [p + 1 for p in host.parents.tolist()], n)
            from serve_eval.tree import DraftTree

            mine = DraftTree(trees.tokens[r, :n], trees.parents[r, :n] - 1, trees.depths[r, :n])
            assert torch.equal(trees.ancestors()[r, : n + 1, : n + 1], mine.ancestor_mask())
            host_path, host_next = walk_tree(mine, logits[r, : n + 1], Sampler())
            assert path[r, : int(length[r])].tolist() == host_path and int(following[r]) == int(host_next)


@pytest.mark.parametrize("kind", ["lm", "pard"])
def test_causal_lm_drafters_in_the_static_step(target_and_prompts, kind):
    """A causal LM drafting one token a forward (here the target for itself) and a PARD LM drafting its
    block from one forward over mask tokens, each over a static cache of its own: chains and trees, one row
    and ragged batches equal plain greedy decoding, and a sampled step reads the host once."""
    from serve_eval.proposers import LMProposer, PardProposer

    target, tok, prompts = target_and_prompts
    lm = copy.deepcopy(target)

    def proposer():
        return LMProposer(lm, 3) if kind == "lm" else PardProposer(lm, 3, tok.mask_token_id)

    references = [plain_generate(target, p, MAX_NEW)[0] for p in prompts]
    for mode in ("chain", "tree"):
        outs, stats = generate(target, prompts, MAX_NEW, proposer=proposer(), mode=mode, tree_budget=5, backend=EAGER)
        assert outs == references, mode
        assert (
            generate(target, prompts[:1], MAX_NEW, proposer=proposer(), mode=mode, backend=EAGER)[0] == references[:1]
        )
        if kind == "lm" and mode == "chain":  # the target drafting for itself: every draft kept
            assert all(s.tau > 3.0 for s in stats.prompts), mode
        samplers = [Sampler(temperature=1.0, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        assert syncs_per_step(_run(target, prompts[:2], None, EAGER, samplers, mode, proposer), 8) <= 1.0


@pytest.mark.parametrize("kind", ["student", "pard", "parcae_self"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_static_causal_lm_drafts_sample_the_target_distribution(toy_target, kind, mode):  # noqa: F811
    """A student, a PARD LM and a Parcae model drafting for itself (fewer recurrences) at T = 1 through the
    static step: the (2nd, 3rd) tokens follow the target's exact distribution."""
    from serve_eval.proposers import LMProposer, PardProposer

    from .test_sampling import toy_lm, toy_parcae

    torch.manual_seed(3)
    target = toy_target
    if kind == "parcae_self":
        target = drafter = toy_parcae()
    else:
        drafter = toy_lm(8, 1, 16)
    exact = exact_joint(target, Sampler(temperature=1.0))
    counts, gens = torch.zeros(VOCAB, VOCAB), [torch.Generator().manual_seed(s) for s in (1, 2)]
    for _ in range(SAMPLES // 2):
        proposer = (
            PardProposer(drafter, 2, VOCAB - 1)
            if kind == "pard"
            else LMProposer(drafter, 2, **({"num_steps": 1} if kind == "parcae_self" else {}))
        )
        samplers = [Sampler(temperature=1.0, generator=g) for g in gens]
        outs, _ = generate(
            target, [PROMPT, PROMPT], 3, samplers=samplers, proposer=proposer, mode=mode, tree_budget=4, backend=EAGER
        )
        for out in outs:
            counts[out[1], out[2]] += 1
    assert chi_square_pvalue(counts, exact) > ALPHA
