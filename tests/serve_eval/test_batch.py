"""Batched decoding (serve_eval.loop.generate over several rows): every row emits exactly its own greedy
tokens and reads what it reads alone, and a batch drafts only where its predicted and measured steps
say drafting pays."""

from __future__ import annotations

import itertools

import pytest
import torch

from serve_eval.budget import Budget, DraftSwitch
from serve_eval.loop import generate, plain_generate, speculative_generate
from serve_eval.proposers import BlockProposer, make_proposer
from serve_eval.sampling import Sampler
from serve_eval.session import TargetSession

from ..conftest import MAX_NEW


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_batched_decoding_equals_greedy_per_row(target_and_prompts, trained_drafters, kind):
    """Rows of different lengths, a row that stops at EOS early, drafts kept and rejected per row: every
    row emits exactly its own greedy tokens, with every draft verified, with a scheduler that always
    drafts and with one that finds speculation too dear and mostly reads the bonus only, and with
    fewer slots than prompts (waiting prompts join as rows finish)."""
    target, _, prompts = target_and_prompts
    drafter = trained_drafters[kind]
    proposer = make_proposer(drafter)
    prompts = [prompts[0], prompts[1][:17], prompts[2][:9], prompts[0][:20]]
    first = plain_generate(target, prompts[1], MAX_NEW)[0]
    stop = max(i for i in range(MAX_NEW - 8) if first[i] not in first[:i])
    eos = first[stop]  # row 1 stops early, at its first occurrence of this token
    reference = [plain_generate(target, p, MAX_NEW, eos)[0] for p in prompts]
    assert len(reference[1]) == stop + 1 and len(set(map(len, reference))) > 1
    assert generate(target, prompts, MAX_NEW, eos)[0] == reference
    ours, stats = generate(target, prompts, MAX_NEW, eos, proposer=proposer)
    assert ours == reference
    # two slots: the third and fourth prompts wait, and join a batch whose rows are mid-answer (longer
    # caches, holes) as rows finish; the early EOS frees a slot first
    assert generate(target, prompts, MAX_NEW, eos, slots=2)[0] == reference
    assert generate(target, prompts, MAX_NEW, eos, proposer=proposer, slots=2)[0] == reference
    # a row drafts what it would alone (same context, same positions), so it takes as many steps
    alone = sum(speculative_generate(target, drafter, p, MAX_NEW, eos)[1].target_forwards - 1 for p in prompts)
    assert abs(stats.row_steps - alone) <= len(prompts)
    K = drafter.config.block_size
    cheap = Budget({1: 100.0, 4 * K: 100.0})  # reading more costs nothing (drafting ~0): all drafts
    dear = Budget({1: 1.0, 2: 100.0, 4 * K: 3000.0})
    for budget, slots in ((cheap, None), (dear, None), (cheap, 3)):
        assert generate(target, prompts, MAX_NEW, eos, proposer=proposer, budget=budget, slots=slots)[0] == reference
    assert {n for step in cheap.by_rows for n in step} == {K} and cheap.batch_summary(4)["drafted_fraction"] == 1.0
    assert {n for step in dear.by_rows for n in step} == {1} and dear.batch_summary(4)[
        "drafted_fraction"
    ] < 0.5  # the off switch, with probes


def test_batched_lookup_copies_equal_greedy(target_and_prompts, trained_drafters):
    """Rows whose prompt-lookup copies are grafted onto their drafts (repetitive prompts: copies are
    frequent) emit exactly their own greedy tokens, without a budget and with one, over fewer slots than
    prompts, copies shorter and longer than a block; the budget chooses among the drafts (a row's drafts
    at most a block) and the copies' outcomes calibrate the copies' acceptance."""
    target, _, prompts = target_and_prompts
    drafter = trained_drafters["dflash"]
    K = drafter.config.block_size
    prompts = [torch.cat([p[:12], p[:12], p[:5]]) for p in prompts[:3]]
    reference = [plain_generate(target, p, MAX_NEW)[0] for p in prompts]
    for lookup in (K - 1, 2 * K):
        assert generate(target, prompts, MAX_NEW, proposer=make_proposer(drafter), lookup=lookup)[0] == reference
        budget = Budget({1: 1.0, 4 * K: 1.2}, min_drafts=1)
        assert (
            generate(target, prompts, MAX_NEW, proposer=make_proposer(drafter), budget=budget, slots=2, lookup=lookup)[
                0
            ]
            == reference
        )
        assert budget.copied_rows and budget.batch_summary(2)["copied_fraction"] > 0
        assert sum(budget.lookup.trials) > budget.lookup.prior * len(budget.lookup.trials)
        assert max(n for step in budget.by_rows for n in step) <= K


def test_a_batch_size_is_judged_before_it_drafts(target_and_prompts, trained_drafters):
    """The up-front prediction for a batch size: a typical row at the measured per-depth acceptance,
    the drafting cost measured at that many rows, against a plain step (batched steps timed at that
    size stand in for the one-row cost table, and scale it for fewer rows). Where a forward costs what its
    tokens cost (compute-bound) drafting cannot pay; where extra tokens are nearly free it does."""
    from serve_eval.timing import measure_draft_seconds, measure_verify_costs

    drafter = trained_drafters["dflash"]
    K = drafter.config.block_size
    seconds = measure_draft_seconds(drafter, 4, context=16, repeats=2)
    assert 0 < seconds < 1
    steps = measure_verify_costs(
        target_and_prompts[0], range(1, K + 1), None, context=16, repeats=2, rows=4, plain=True
    )
    assert sorted(steps) == list(range(K + 1)) and all(0 < t < 1 for t in steps.values())  # 0: a plain step
    table = {1: 1.0, 4 * K: 2.0}
    proxy = Budget(table).costs
    dearer = {n: 1.5 * proxy.verify_seconds(4 * n) for n in range(1, K + 1)}
    dearer[2] = 9.0  # one noisy timing: the median ratio ignores it
    measured = Budget(table, step_seconds=dearer, rows=4).costs
    assert measured.tokens_seconds(4, 4 * 3) == pytest.approx(
        dearer[3]
    )  # drafted steps: the table x the measured ratio
    assert measured.tokens_seconds(2, 2 * 3) == pytest.approx(1.5 * proxy.verify_seconds(6))
    assert measured.tokens_seconds(2, 2) == proxy.verify_seconds(2)  # no plain step timed: the table's cost
    # batched steps timed 3x slower than the one-row table (a machine slower while they ran): drafted
    # and plain steps, timed in the same rounds, scale alike, and so does the prediction
    slow = Budget(
        table, step_seconds={n: 3 * t for n, t in {**dearer, 0: 1.2 * proxy.verify_seconds(4)}.items()}, rows=4
    ).costs
    assert slow.tokens_seconds(4, 4) == pytest.approx(3 * 1.2 * proxy.verify_seconds(4))
    assert slow.tokens_seconds(2, 2) == pytest.approx(3 * 1.2 * proxy.verify_seconds(2))
    assert slow.tokens_seconds(4, 12) / slow.tokens_seconds(4, 4) == pytest.approx(
        dearer[3] / (1.2 * proxy.verify_seconds(4))
    )
    for costs, pays in (({1: 1.0, 4 * K: 4.0 * K}, False), ({1: 1.0, 4 * K: 1.2}, True)):
        budget = Budget(costs)
        for _ in range(50):  # drafts at every depth kept 90% of the time
            budget.calibration.record_chain([0.5] * (K - 1), K - 1, K - 1)
            budget.calibration.record_chain([0.5] * (K - 1), 1, 0)
        budget.costs.seed_drafting(4, 0.05)
        assert (budget.predicted_speedup(4, K - 1) > 1) == pays


def test_a_batch_stops_drafting_where_its_own_steps_measure_that_it_does_not_pay():
    """The prediction is optimistic; the loop's measured steps overrule it: after 8 drafted steps whose
    row tokens per second fall below a bare plain step's, 3 plain steps are run, and drafting goes on
    only where it measured faster by the margin; a number of rows with nothing measured goes by the
    prediction."""
    K = 4

    def budget():  # extra tokens cost nothing and drafting is free: the prediction says draft
        made = Budget({1: 1.0, 4 * K: 1.0}, min_drafts=1)
        made.costs.seed_drafting(4, 0.0)
        made.choose_rows([made.calibration.chain_reach([0.9] * (K - 1))] * 4, torch.full((4, K - 1), 0.9))
        return made

    slow, fast, close = budget(), budget(), budget()
    switch = slow.switch_for(4)
    assert (switch.min_drafts, switch.measure, switch.margin) == (8, 3, 1.1)
    for made in (slow, fast, close):
        for _ in range(switch.min_drafts):
            assert made.should_draft(4)
            made.record_step(4, True, 2, 2.0)  # 6 row tokens: 3 a second; a bare plain step (the table's): 4
    for _ in range(switch.measure):  # below the bare step: plain steps, to measure them
        assert not slow.should_draft(4)
        slow.record_step(4, False, 0, 0.5)
    assert not slow.should_draft(4)  # plain steps measured 8 row tokens a second
    for _ in range(switch.measure):
        fast.record_step(4, False, 0, 4.0)  # plain steps slower than the bare one: 1 a second
        close.record_step(4, False, 0, 1.4)  # 2.9 a second: drafted steps are faster, but not by the margin
    assert fast.should_draft(4) and slow.should_draft(3) and not close.should_draft(4)


def test_a_batch_whose_measured_rates_flip_stays_greedy(target_and_prompts, trained_drafters, monkeypatch):
    """Whatever the measured rates say, step after step (here: drafting pays, then not, in turn), every
    row emits exactly its own greedy tokens: the choice picks between two lossless steps."""
    target, _, prompts = target_and_prompts
    drafter = trained_drafters["dflash"]
    K = drafter.config.block_size
    turns = itertools.count()
    monkeypatch.setattr(DraftSwitch, "should_draft", lambda self, predicted=None: next(turns) % 2 == 0)
    budget = Budget({1: 1.0, 4 * K: 1.2}, min_drafts=1)  # the prediction says draft
    reference = [plain_generate(target, p, MAX_NEW)[0] for p in prompts[:3]]
    assert (
        generate(target, prompts[:3], MAX_NEW, proposer=make_proposer(drafter), budget=budget, slots=2)[0] == reference
    )
    switch = budget.switch_for(2)
    assert (
        0 < budget.batch_summary(2)["drafted_fraction"] < 1 and switch.stats[True].seen and switch.plain
    )  # both ran, recorded


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_batched_block_drafts_what_each_row_drafts_alone(target_and_prompts, trained_drafters, kind):
    """Rows of different lengths, features appended at once and queued in two parts, and a row that
    starts over as another prompt (its prefill's features, padded) while features of its former
    occupant are still queued: each row's block logits equal the one-row decoding path's (its own
    context, positions and mask)."""
    from distill.base.features import FeatureCapture

    target, _, prompts = target_and_prompts
    drafter = trained_drafters[kind]
    rows = [prompts[0][:20], prompts[1][:13]]
    capture = FeatureCapture(target, drafter.config.target_layer_ids)
    feats = [capture(p[None]).aux for p in rows]
    batch = BlockProposer(drafter)
    head, tail = torch.zeros(2, 15, feats[0].shape[-1]), torch.zeros(2, 5, feats[0].shape[-1])
    head[0], head[1, :8] = feats[0][0, :15], feats[1][0, :8]  # row 1 keeps 8 of its 15 slots
    tail[0], tail[1] = feats[0][0, 15:], feats[1][0, 8:]
    batch.start([rows[0][:15], rows[1][:8]], head, torch.stack([rows[0][15], rows[1][8]]))
    batch.observe(
        [15, 8], [rows[0][15:20], rows[1][8:13]], tail
    )  # five verified a row (the count is what matters): queued
    batch._flush()
    assert batch.context.lengths.tolist() == [20, 13]
    # row 1's, queued when it finishes (row 0 kept none of these)
    batch.observe([20, 13], [rows[0][:0], rows[1][:2]], torch.randn(2, 3, feats[0].shape[-1]))
    rows[1] = prompts[2][:17]
    feats[1] = capture(rows[1][None]).aux
    batch.put(
        torch.tensor([1]), [rows[1]], torch.cat([feats[1], torch.zeros(1, 3, feats[1].shape[-1])], dim=1), rows[1][-1:]
    )
    batch._flush()
    assert batch.context.lengths.tolist() == [20, 17]
    anchors = torch.stack([p[-1] for p in rows])
    batched = batch.propose(anchors, [len(p) for p in rows], [Sampler(), Sampler()]).logits
    for i, (p, f) in enumerate(zip(rows, feats)):
        alone = BlockProposer(drafter)
        alone.start([p], f, p[-1:])
        logits = alone.propose(p[-1:], [len(p)], [Sampler()]).logits
        assert torch.allclose(batched[i], logits[0], atol=1e-4)
        with pytest.raises(ValueError, match="anchored at"):  # a block follows its row's context directly
            alone.propose(p[-1:], [len(p) + 1], [Sampler()])


def steps_match_alone(target, batch, alone, steps: int, n: int) -> None:
    """``steps`` steps of ``n`` random tokens a row, each row keeping a random count of them: the
    batch's logits equal those of each row's own session (``alone``) every step."""
    for _ in range(steps):
        ids, counts = (
            torch.randint(0, target.config.vocab_size, (len(alone), n)),
            torch.randint(1, n + 1, (len(alone),)),
        )
        together = batch.step(ids)[0]
        torch.testing.assert_close(
            together, torch.cat([a.step(ids[i : i + 1])[0] for i, a in enumerate(alone)]), atol=1e-5, rtol=1e-5
        )
        batch.keep(counts)
        for a, c in zip(alone, counts):
            a.keep(c[None])


def test_batch_rows_read_what_they_read_alone(target_and_prompts):
    """Ragged rows (the prefill pads), each keeping a different number of every step's tokens (the
    rest written over by the next step): every row's logits equal those of its own session."""
    target, _, prompts = target_and_prompts
    rows = [prompts[0][:20], prompts[1][:11], prompts[2][:15]]
    batch, alone = TargetSession(target), [TargetSession(target) for _ in rows]
    first = batch.prefill(rows)[0]
    torch.testing.assert_close(first, torch.cat([a.prefill([p])[0] for a, p in zip(alone, rows)]), atol=1e-5, rtol=1e-5)
    torch.manual_seed(0)
    steps_match_alone(target, batch, alone, steps=6, n=5)
    assert batch.lengths.tolist() == [a.lengths.item() for a in alone]


def test_a_prompt_taking_a_finished_rows_place_reads_what_it_reads_alone(target_and_prompts):
    """A prompt prefilled in a group apart takes the place of a row whose cache holds more slots than
    the prompt has tokens (its entries written over, the rest left): from then on every row's logits
    equal those of its own session."""
    target, _, prompts = target_and_prompts
    rows = [prompts[0][:20], prompts[1][:11]]
    batch, alone = TargetSession(target), [TargetSession(target), TargetSession(target)]
    batch.prefill(rows)
    for a, p in zip(alone, rows):
        a.prefill([p])
    torch.manual_seed(0)
    for _ in range(3):  # the first rows decode, keeping some of each step's tokens
        ids, counts = torch.randint(0, target.config.vocab_size, (2, 4)), torch.randint(1, 5, (2,))
        batch.step(ids)
        batch.keep(counts)
        alone[1].step(ids[1:])
        alone[1].keep(counts[1:])
    group = TargetSession(target)
    first = group.prefill([prompts[1][:5], prompts[2][:9]])[0]
    batch.put(torch.tensor([0]), group, torch.tensor([1]))  # row 0 (20 + ~7 tokens) becomes the 9-token prompt
    alone[0] = TargetSession(target)
    torch.testing.assert_close(first[1:], alone[0].prefill([prompts[2][:9]])[0], atol=1e-5, rtol=1e-5)
    assert batch.lengths.tolist() == [9, alone[1].lengths.item()]
    steps_match_alone(target, batch, alone, steps=3, n=4)


def test_the_up_front_margin_is_strict_for_short_runs_and_sampled_rows():
    from serve_eval.budget import TAIL_MARGIN, UP_FRONT_MARGIN, up_front_margin

    assert up_front_margin(16, 4, sampled=False) == UP_FRONT_MARGIN < TAIL_MARGIN  # four waves through the slots
    assert up_front_margin(16, 8, sampled=False) == TAIL_MARGIN  # two: the tail is much of the run
    assert up_front_margin(16, 4, sampled=True) == TAIL_MARGIN
