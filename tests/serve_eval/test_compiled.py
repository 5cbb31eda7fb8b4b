"""The compiled draft (serve_eval.compiled): each graph draft equals the eager one to rounding (one row or
a batch, after steps that did not draft), each drafter has a graph of its own, and decoding through the
graphs stays lossless."""

from __future__ import annotations

import pytest
import torch

from serve_eval.budget import Budget
from serve_eval.cpu import CpuBackend
from serve_eval.loop import generate, plain_generate, speculative_generate
from serve_eval.proposers import BlockProposer, make_proposer
from serve_eval.sampling import Sampler

from ..conftest import MAX_NEW


def close_to_rounding_or_an_int8_step(actual, expected, tight: list) -> None:
    """A compiled draft against the eager one: equal to rounding, except where a rounding moved an
    activation across an int8 code boundary, which moves that product by about one quantization step
    (~1e-3 here; a wrong slot or position would move values by ~1). Every element within 1% of the
    largest magnitude; ``tight`` records whether all were within 1e-4 (the tests want that of 95% of
    the drafts)."""
    if expected is None:
        assert actual is None
        return
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-2 * max(1.0, float(expected.abs().max())))
    tight.append(torch.allclose(actual, expected, rtol=1e-4, atol=1e-4))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_compiled_drafts_equal_eager_ones_and_stay_lossless(target_and_prompts, trained_drafters, kind, monkeypatch):
    """A block drafter's draft compiled as one graph (serve_eval.cpu.compiled, over the fused int8 drafter
    the eval serves) gives each step the eager draft's block and greedy proposal (DSpark's chain after
    the graph's own drafts), to rounding; greedy chains and trees still equal plain decoding, and a
    sequence longer than the graph's caches drafts eagerly past them."""
    import copy

    from serve_eval.cpu import compiled
    from serve_eval.cpu.int8 import int8_drafter

    target, tok, prompts = target_and_prompts
    drafter = copy.deepcopy(trained_drafters[kind]).fuse_projections()
    int8_drafter(drafter, "all")
    backend = CpuBackend(prepack="off", int8="off", compile="off")
    record = backend.compile_draft(drafter, max(len(p) for p in prompts) + MAX_NEW)
    assert record["graph"] == "decode + propose" and record["sampled_proposal"] == (kind == "dflash")
    graph_run, counts, tight = compiled.CompiledDraft.run, [], []

    # the eager forward on a copy of the same cache, beside the graph's
    def checked(self, anchors, starts, features, cache, propose):
        eager_cache = copy.deepcopy(cache)
        reference = drafter.decode(anchors, starts, features, eager_cache)
        hidden, proposal = graph_run(self, anchors, starts, features, cache, propose)
        close_to_rounding_or_an_int8_step(hidden, reference, tight)
        for graphs, eager in zip(cache.keys + cache.values, eager_cache.keys + eager_cache.values):
            close_to_rounding_or_an_int8_step(graphs, eager, tight)  # the same entries written
        assert len(anchors) == 1 and propose
        tokens, logits, confidence = proposal  # greedy: each position's logits after the graph's own drafts
        drafts = iter(tokens.unbind(-1))  # the eager proposal over the graph's block, fed the graph's drafts
        _, expected, expected_confidence = drafter.propose(hidden, anchors[:, None], lambda _: next(drafts))
        close_to_rounding_or_an_int8_step(logits, expected, tight)
        close_to_rounding_or_an_int8_step(confidence, expected_confidence, tight)  # DFlash: None, None
        assert torch.equal(tokens, logits.argmax(-1))
        counts.append(int(starts[0, 1]))
        return hidden, proposal

    monkeypatch.setattr(compiled.CompiledDraft, "run", checked)
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        assert speculative_generate(target, drafter, prompt, MAX_NEW, backend=backend)[0] == reference
        assert (
            speculative_generate(target, drafter, prompt, MAX_NEW, budget=Budget({1: 1.0, 8: 1.2}), backend=backend)[0]
            == reference
        )
        assert (
            speculative_generate(
                target, drafter, prompt, MAX_NEW, mode="tree", budget=Budget({1: 1.0, 16: 1.3}), backend=backend
            )[0]
            == reference
        )
    assert len(counts) > 20 and len(set(counts)) > 2  # the graph drafted, after steps that kept various counts
    assert sum(tight) >= 0.95 * len(tight)
    longer, before = torch.cat([prompts[0]] * 3), len(counts)  # past the graph's caches: eager, still lossless
    assert (
        speculative_generate(target, drafter, longer, MAX_NEW, backend=backend)[0]
        == plain_generate(target, longer, MAX_NEW)[0]
    )
    assert len(counts) == before


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_batches_draft_from_the_compiled_graph_and_stay_lossless(
    target_and_prompts, trained_drafters, kind, monkeypatch
):
    """A drafter compiled for batches of two and three rows: batched greedy decoding (every draft
    verified or a scheduler's choice, rows of different lengths, fewer slots than prompts, rows leaving
    and joining) drafts from the graph whenever the batch has a compiled size, each graph draft equal
    to the eager forward on the same buffers, and every row equals plain decoding."""
    import copy

    from serve_eval.cpu import compiled
    from serve_eval.cpu.int8 import int8_drafter

    target, _, prompts = target_and_prompts
    prompts = [prompts[0], prompts[1][:17], prompts[2][:9], prompts[0][:20]]
    drafter = copy.deepcopy(trained_drafters[kind]).fuse_projections()
    int8_drafter(drafter, "all")
    # 3 rows, and 2 as the tail of 3 (rows finish apart): every count below the smallest batch gets a graph
    backend = CpuBackend(prepack="off", int8="off", compile="off")
    assert backend.compile_draft(drafter, max(map(len, prompts)) + MAX_NEW, rows=(3,))["rows"] == [1, 2, 3]
    graph_run, rows_seen, tight = compiled.CompiledDraft.run, [], []

    def checked(self, anchors, starts, features, cache, propose):
        reference = drafter.decode(anchors, starts, features, copy.deepcopy(cache))
        hidden, proposal = graph_run(self, anchors, starts, features, cache, propose)
        close_to_rounding_or_an_int8_step(hidden, reference, tight)
        rows_seen.append(len(anchors))
        return hidden, proposal

    monkeypatch.setattr(compiled.CompiledDraft, "run", checked)
    reference = [plain_generate(target, p, MAX_NEW)[0] for p in prompts]
    K = drafter.config.block_size
    for slots, budget in ((3, None), (2, None), (3, Budget({1: 1.0, 2: 1.1, 4 * K: 3.0}))):
        assert (
            generate(
                target,
                prompts,
                MAX_NEW,
                proposer=make_proposer(drafter, backend=backend),
                budget=budget,
                slots=slots,
                backend=backend,
            )[0]
            == reference
        )
    assert (
        rows_seen.count(3) > 5 and rows_seen.count(2) > 5 and set(rows_seen) == {1, 2, 3}
    )  # a last row: the one-row graph
    assert sum(tight) >= 0.95 * len(tight)


def test_a_batch_drafts_through_its_graph_after_steps_that_did_not_draft(trained_drafters, monkeypatch):
    """Steps that do not draft (a batch decoding plainly between the off switch's probes) queue a feature
    a row each; the next draft appends them in one product and drafts through the compiled graph, giving
    the drafts the eager path gives from the same context (rows of different lengths)."""
    import copy

    from serve_eval.cpu import compiled

    drafter = copy.deepcopy(trained_drafters["dflash"]).fuse_projections()  # as the loops serve it
    eager = copy.deepcopy(drafter)  # never compiled: its context drafts eagerly
    backend = CpuBackend(prepack="off", int8="off", compile="off")
    backend.compile_draft(drafter, 48, rows=(2,))
    calls, run = [], compiled.CompiledDraft.run
    monkeypatch.setattr(
        compiled.CompiledDraft, "run", lambda self, *args: calls.append(len(args[0])) or run(self, *args)
    )
    torch.manual_seed(0)
    width = drafter.fc.in_features
    start, steps, anchors = (
        torch.randn(2, 12, width),
        [torch.randn(2, 1, width) for _ in range(5)],
        torch.tensor([3, 7]),
    )
    drafts = []
    for d in (drafter, eager):
        proposer = BlockProposer(d, backend=backend)
        proposer.start(
            [torch.zeros(12, dtype=torch.long), torch.zeros(9, dtype=torch.long)],
            start,
            torch.zeros(2, dtype=torch.long),
        )
        for i, features in enumerate(steps):  # plain steps: each row verified its bonus alone
            proposer.observe([12 + i, 9 + i], [torch.zeros(1, dtype=torch.long)] * 2, features)
        drafts.append(proposer.propose(anchors, [17, 14], [Sampler(), Sampler()]))
        assert proposer.context.lengths.tolist() == [17, 14] and not proposer.pending
    assert calls == [2]  # the compiled drafter's one draft, through the graph
    torch.testing.assert_close(drafts[0].logits, drafts[1].logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_one_row_drafts_through_its_graph_after_more_than_a_block_of_features(trained_drafters, kind, monkeypatch):
    """One row's draft after more than K verified features (a prompt's, or steps that did not draft)
    reads all but the last K into the context first and drafts through the compiled graph: the drafts
    of the eager path from the same features (its one forward over them all), the same context length."""
    import copy

    from serve_eval.cpu import compiled

    drafter = copy.deepcopy(trained_drafters[kind]).fuse_projections()  # as the loops serve it
    eager = copy.deepcopy(drafter)
    backend = CpuBackend(prepack="off", int8="off", compile="off")
    backend.compile_draft(drafter, 48)
    calls, run = [], compiled.CompiledDraft.run
    monkeypatch.setattr(
        compiled.CompiledDraft, "run", lambda self, *args: calls.append(args[2].shape[1]) or run(self, *args)
    )
    torch.manual_seed(0)
    K = drafter.config.block_size
    features = [torch.randn(1, 3 * K + 2, drafter.fc.in_features), torch.randn(1, K + 1, drafter.fc.in_features)]
    drafts = []
    for d in (drafter, eager):
        proposer, out, position = BlockProposer(d, backend=backend), [], 0
        for chunk, anchor in zip(features, (5, 9)):  # a prompt's features, then a step's too many
            if position == 0:
                proposer.start([torch.zeros(chunk.shape[1], dtype=torch.long)], chunk, torch.zeros(1, dtype=torch.long))
            else:
                proposer.observe([position], [torch.zeros(chunk.shape[1], dtype=torch.long)], chunk)
            position += chunk.shape[1]
            proposal = proposer.propose(torch.tensor([anchor]), [position], [Sampler()])
            out.append((proposal.tokens[0], proposal.logits[0]))
            assert proposer.context.length == position
        drafts.append(out)
    assert calls == [K, K]  # both drafts through the graph, each reading the last K features
    for (tokens, logits), (eager_tokens, eager_logits) in zip(*drafts):
        torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(tokens, eager_tokens)


def test_each_compiled_drafter_has_a_graph_of_its_own():
    """Two drafters alike in every shape, one with causal blocks and one with bidirectional ones, each
    compiled (serve_eval.cpu.compiled drops Dynamo's guards on a drafter's modules, so a graph shared between
    them would give one the other's mask): each draft equals its own drafter's eager one."""
    import copy

    from drafters.cache import ContextCache

    from ..conftest import decode_one, graph_one, tiny_dflash

    torch.manual_seed(0)
    aux = torch.randn(1, 40, 32)
    for attention in ("causal", "bidirectional"):
        drafter = tiny_dflash(attention)
        backend = CpuBackend(prepack="off", int8="off", compile="off")
        backend.compile_draft(drafter, 32)
        graph = backend.draft_graph(drafter)
        cache = ContextCache(spare=4, capacity=graph.positions)
        with torch.inference_mode():
            decode_one(drafter, 3, 10, cache, aux[:, :10])
            eager = copy.deepcopy(cache)
            assert graph.fits(cache, cache.length + 3, 3)
            hidden = graph_one(graph, 7, cache, aux[:, 10:13])
            torch.testing.assert_close(hidden, decode_one(drafter, 7, 13, eager, aux[:, 10:13]), rtol=1e-4, atol=1e-4)
