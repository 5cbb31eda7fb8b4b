"""Speculation budgets (serve_eval.budget), each part on its own: the cost model (measured tables, the
loop's offset, drafting costs), the acceptance calibration, the off switch, and the choice, which
maximises expected tokens per second and keeps a truncated best-first tree a tree."""

from __future__ import annotations

import itertools

import pytest
import torch

from serve_eval.budget import Budget, Calibration, CausalChain, CostModel, DraftSwitch, RunningMean
from serve_eval.timing import measure_verify_costs
from serve_eval.tree import build_best_first_tree


def test_running_means_average_then_forget():
    """The one averaging rule: a plain mean while 1/n exceeds the floor, then a mean that forgets."""
    plain, forgetful = RunningMean(), RunningMean(0.5)
    for x in (1.0, 2.0, 3.0, 10.0):
        plain.add(x)
        forgetful.add(x)
    assert plain.value == pytest.approx(4.0) and plain.n == 4
    assert forgetful.value == pytest.approx(((1.0 + 2.0) / 2 + 3.0) / 2 / 2 + 10.0 / 2)  # 1, 1/2, then 1/2 each


def test_verify_costs_interpolate_between_measured_sizes():
    costs = CostModel({1: 1.0, 2: 1.5, 8: 3.0})
    assert costs.verify_seconds(1) == 1.0 and costs.verify_seconds(2) == 1.5
    assert costs.verify_seconds(5) == pytest.approx(2.25)
    assert costs.verify_seconds(10) == pytest.approx(3.5)  # past the largest: its last slope
    # used as measured: 4 tokens may cost less than 3 (small-matrix kernels), and the choice then
    # verifies 3 drafts rather than 2 although the third is unlikely to be kept
    dip = Budget({1: 1.0, 2: 1.3, 3: 1.6, 4: 1.4})
    assert dip.costs.seconds == [1.0, 1.3, 1.6, 1.4]
    assert dip.best_prefix([0.9, 0.5, 0.05]) == 3
    assert Budget({1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9}).best_prefix([0.9, 0.5, 0.05]) == 2
    with pytest.raises(ValueError, match="n = 1"):
        Budget({2: 1.0})


def test_best_prefix_maximises_expected_tokens_per_second():
    budget = Budget({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4, 16: 4.0})
    budget.costs.observe_draft(0.5)
    for reach in ([0.9, 0.8, 0.7, 0.2, 0.1, 0.05], [0.05, 0.01], [0.99] * 12, []):
        rates = [(1 + sum(reach[:b])) / (budget.costs.verify_seconds(b + 1) + 0.5) for b in range(len(reach) + 1)]
        assert budget.best_prefix(reach) == max(range(len(rates)), key=rates.__getitem__)
    assert budget.chosen == [3, 0, 12, 0]
    costly = Budget({1: 1.0, 2: 3.0})  # a second token costs two plain steps: never worth it here
    assert costly.best_prefix([0.9, 0.9]) == 0


def test_causal_length_decides_each_draft_from_the_positions_up_to_it():
    """What the loop needs for drafts drawn one after another: whether draft k is verified depends on
    ``top_q[:k]`` alone, so nothing computed from draft k (later positions) can change it; a drafter that
    stops where :class:`CausalChain` first says no drafts exactly what the budget verifies, plus that one."""
    gen = torch.Generator().manual_seed(0)
    budget = Budget({1: 1.0, 2: 1.3, 3: 1.6, 4: 1.4, 8: 2.0})  # a dip at 4: the forecast looks past it
    budget.costs.observe_draft(0.2, [0.05, 0.05])
    assert budget.costs.token_seconds == pytest.approx(0.05) and budget.costs.draft_fixed == pytest.approx(0.1)
    lengths = set()
    for _ in range(300):
        top_q = torch.rand(7, generator=gen).tolist()
        kept = budget.causal_length(top_q)
        lengths.add(kept)
        tail = torch.rand(7, generator=gen).tolist()
        for k in range(1, 8):  # positions up to k fixed, anything after them
            assert (budget.causal_length(top_q[:k] + tail[k:], 7) >= k) == (kept >= k)
        chain = CausalChain(budget, 7)
        offered = [chain.offer(q) for q in top_q]
        assert offered == [k < kept for k in range(7)]
    assert len(lengths) > 2  # the choices do vary
    # a confident chain is verified whole, a hopeless one not at all
    assert budget.causal_length([0.99] * 7) == 7 and budget.causal_length([0.001] * 7) == 0


def test_the_loops_verifies_correct_the_table_by_one_offset():
    """Verifies measured 0.5 s over the table move every size's cost by 0.5 (a running mean), which
    makes longer verifies relatively cheaper: the best prefix grows. A made-up table stays as given,
    and the offset never takes a cost below half a plain step."""
    table = {1: 1.0, 2: 1.2, 3: 1.6, 4: 2.4}
    budget, fixed = Budget(table, loop_offset=True), Budget(table)
    assert budget.best_prefix([0.6, 0.5, 0.5]) == 1
    for n in (1, 2, 3, 4) * 20:
        budget.costs.observe_verify(n, table[n] + 0.5)
        fixed.costs.observe_verify(n, table[n] + 0.5)
    assert budget.costs.verify_offset == pytest.approx(0.5) and budget.costs.verify_seconds(3) == pytest.approx(2.1)
    assert budget.best_prefix([0.6, 0.5, 0.5]) == 2
    assert fixed.costs.verify_seconds(3) == 1.6 and fixed.summary()["verify_offset_ms"] == 0
    for _ in range(200):
        budget.costs.observe_verify(1, 0.0)
    assert budget.costs.verify_seconds(1) == pytest.approx(0.5)


def test_acceptance_calibrates_towards_what_was_measured():
    budget = Calibration(prior=4.0)
    assert budget.acceptance(0.33) == pytest.approx(0.35)  # the prior: the bin's centre
    for _ in range(200):  # drafts at q = 0.33 that the target kept 90% of the time
        budget.record_chain([0.33, 0.33, 0.5], 2, 2)  # both verified kept; the third was not verified
        budget.record_chain([0.33] * 10, 10, 9)
        budget.record_chain([0.99, 0.99], 1, 0)  # a confident miss; nothing after it counts
    # counted: every verified position up to the first miss, none after it
    assert budget.acceptance(0.33) == pytest.approx((4 * 0.35 + 200 * 11) / (4 + 200 * 12), abs=1e-9)
    assert budget.acceptance(0.99) < 0.05 and budget.acceptance(0.5) == pytest.approx(0.55)
    # a step that verified nothing still learns what its first draft would have done
    for _ in range(100):
        budget.record_chain([0.5, 0.5], 0, 0, next_outcome=1.0)
    assert budget.acceptance(0.5) == pytest.approx((4 * 0.55 + 100) / 104)
    budget.record_chain([0.5, 0.5], 1, 0, next_outcome=1.0)  # a miss: the next draft's outcome is not known
    assert budget.acceptance(0.5) == pytest.approx((4 * 0.55 + 100) / 105)


def test_log_acceptance_ranks_by_the_calibration():
    budget = Calibration()
    for _ in range(50):
        budget.count(0.35, 1.0, depth=1)  # tokens given ~0.35 at depth 1 were always kept
    q = torch.tensor([0.0, 0.03, 0.35, 0.5])
    scores = budget.log_acceptance(q[None])[0]
    assert scores[0] == float("-inf")  # never a node
    assert torch.allclose(scores[1:].exp(), torch.tensor([budget.acceptance(x, 1) for x in q[1:].tolist()]), rtol=1e-2)
    assert scores[2] > scores[3]  # 0.35 now outranks 0.5


def test_acceptance_is_calibrated_per_depth_and_shrunk_to_the_pooled_rate():
    budget = Calibration(prior=4.0)
    for _ in range(100):
        budget.record_chain([0.55, 0.55], 2, 1)  # same q: depth 1 always kept, depth 2 never
    pooled = (4 * 0.55 + 100) / (4 + 200)
    assert budget.acceptance(0.55) == pytest.approx(pooled)
    assert budget.acceptance(0.55, 1) == pytest.approx((100 + 4 * pooled) / 104)
    assert budget.acceptance(0.55, 2) == pytest.approx(4 * pooled / 104)
    assert budget.acceptance(0.55, 5) == pytest.approx(pooled)  # a depth never seen: the pooled rate


def test_tree_size_truncates_a_best_first_tree_to_a_tree_and_records_its_walk():
    torch.manual_seed(0)
    log_probs = (torch.randn(4, 12) * 2).log_softmax(-1)
    tree = build_best_first_tree(log_probs, 10)
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))  # pop order: parents first
    budget = Budget({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 16: 2.5})
    q, parents, depths = (
        log_probs[tree.depths - 1, tree.tokens].exp().tolist(),
        tree.parents.tolist(),
        tree.depths.tolist(),
    )
    n = budget.tree_size(q, parents, depths)
    reach = []
    for qi, p in zip(q, parents):
        reach.append(budget.calibration.acceptance(qi) * (reach[p] if p >= 0 else 1.0))
    best = max(range(11), key=lambda b: (1 + sum(reach[:b])) / (budget.costs.verify_seconds(b + 1) + 0.0))
    assert n == best and 0 < n < 10
    small = tree.prefix(n)
    assert len(small) == n and all(p < n for p in small.parents.tolist())
    # a walk root -> node 0 -> its first child: node 0 counted as kept, its siblings and child's siblings as missed
    child = parents.index(0)
    calibration = budget.calibration
    before = list(calibration.trials)
    calibration.record_tree(q, parents, depths, [0, 1, child + 1], verified=len(q))
    counted = [i for i, p in enumerate(parents) if p in (-1, 0, child)]
    assert sum(calibration.trials) - sum(before) == len(counted)
    # truncated to node 0 alone, which the target kept: node 0's unverified children count, kept iff
    # their token is the target's next choice; node 0's unverified siblings do not
    grandchildren = [i for i, p in enumerate(parents) if p == 0]
    before_trials, before_accepted = sum(calibration.trials), sum(calibration.accepted)
    outcomes = {i: float(i == grandchildren[-1]) for i in grandchildren}
    calibration.record_tree(q, parents, depths, [0, 1], 1, outcomes)
    assert sum(calibration.trials) - before_trials == 1 + len(grandchildren)
    assert sum(calibration.accepted) - before_accepted == pytest.approx(2.0)  # node 0 and the chosen grandchild


def test_measured_verify_costs_cover_the_sizes_and_leave_the_rng_alone(tiny_target_dir):
    from distill.config import TargetConfig
    from distill.models import load_target

    target, _ = load_target(TargetConfig(path=str(tiny_target_dir)))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    costs = measure_verify_costs(target, [1, 4, 2], context=16, repeats=2)
    assert torch.equal(torch.rand(3), expected)
    assert sorted(costs) == [1, 2, 4] and all(c > 0 for c in costs.values())


def test_interleaved_timing_rotates_the_order_and_least_drops_a_burst(monkeypatch):
    """Each round starts one run further on; a burst that slows most rounds of one run moves its median
    but not its fastest round (what a cost table takes: ``least``). The clock is the runs' own: each run
    advances it by what it costs, so the times are exact."""
    import collections

    from serve_eval import timing

    order, calls, clock = [], collections.Counter(), [0.0]
    slow = {"a": {1, 2, 3}, "b": set()}  # rounds (0: the warm-up) a burst slows
    monkeypatch.setattr(timing, "device_clock", lambda device: lambda: clock[0])

    def runner(key):
        def run():
            order.append(key)
            clock[0] += (
                0.001 if calls[key] == 0 else 0.03 if calls[key] in slow[key] else 0.002
            )  # the warm-up: not counted
            calls[key] += 1

        return run

    runs = {key: (runner(key), None) for key in "ab"}
    median = timing.interleaved_seconds(runs, 4, "cpu")
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    calls.clear()
    least = timing.interleaved_seconds(runs, 4, "cpu", least=True)
    assert median == {
        "a": pytest.approx(0.03),
        "b": pytest.approx(0.002),
    }  # rounds 1-4 of a: 0.03 three times, then 0.002
    assert least == {"a": pytest.approx(0.002), "b": pytest.approx(0.002)}


def _toy_greedy_run():
    """A toy target, an untrained DFlash drafter for it, a prompt and the target's 30 greedy tokens."""
    from distill.config import DrafterSection
    from distill.drafter_eval import build_drafter
    from serve_eval.loop import plain_generate

    from .test_sampling import toy_lm

    torch.manual_seed(0)
    target = toy_lm(16, 3, 32, positions=128)
    drafter = build_drafter(
        DrafterSection(kind="dflash", block_size=4, target_layer_ids=[0, 1, 2]), target, "toy", mask_token_id=5
    ).eval()
    prompt = torch.tensor([1, 2, 3])
    return target, drafter, prompt, plain_generate(target, prompt, 30)[0]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_budget_changes_what_is_verified_but_not_what_is_emitted(mode):
    """Greedy decoding with a budget that makes long drafts costly: shorter steps, the same tokens."""
    from serve_eval.loop import speculative_generate

    target, drafter, prompt, reference = _toy_greedy_run()
    for costs in ({1: 1.0, 2: 1.05, 8: 1.3}, {1: 1.0, 2: 1.6, 8: 5.0}):
        budget = Budget(costs)
        out, stats = speculative_generate(target, drafter, prompt, 30, mode=mode, tree_budget=6, budget=budget)
        assert out == reference
        assert len(budget.chosen) == stats.target_forwards - 1  # one choice per step (the prefill has none)
    assert any(b == 0 for b in budget.chosen) and max(itertools.chain(budget.chosen)) <= 6


def test_the_draft_switch_stops_drafting_where_it_does_not_pay_and_probes():
    """Drafted steps measured slower than plain steps: after ``min_drafts`` of them the switch skips,
    drafting again after 8, then 16, 32, 64, 64 skipped steps while the probes keep not paying; a
    probe that pays turns drafting back on. Each state (after a kept draft / a miss) counts apart."""
    switch = DraftSwitch(plain_seconds=1.0, min_drafts=4)
    decisions = []
    for _ in range(300):
        drafting = switch.should_draft()
        decisions.append(drafting)
        switch.record(drafting, 0, 2.0 if drafting else 1.0)  # a draft that kept nothing, at twice a plain step
    gaps = [i for i, d in enumerate(decisions) if d]
    assert gaps[:5] == [0, 1, 2, 3, 4]  # one step after a kept draft (the start), four after a miss
    assert [b - a - 1 for a, b in zip(gaps[4:], gaps[5:])] == [8, 16, 32, 64, 64, 64][: len(gaps) - 5]
    assert switch.summary()["skipped_steps"] == 300 - len(gaps)
    for _ in range(3):  # probes that pay: 4 tokens in 2 plain steps' time
        while not switch.should_draft():
            switch.record(False, 0, 1.0)
        switch.record(True, 3, 2.0)
    assert all(switch.should_draft() for _ in range(5))  # after a kept draft, drafting pays


def test_one_stalled_plain_step_does_not_hold_up_the_plain_reference():
    """The switch's plain reference is the median of the last plain steps: one that stalls (a first
    call, a collection) does not make plain decoding look slow, and drafted steps that run below the
    plain steps stop drafting (a mean would read the plain rate as a fraction of what it is)."""
    switch = DraftSwitch(plain_seconds=1.0, min_drafts=4)
    for seconds in (1.0, 60.0, 1.0, 1.0):
        switch.record(False, 0, seconds)
    assert switch.plain_rate == 1.0
    for _ in range(8):
        switch.record(True, 0, 1.2)  # drafts that keep nothing: 1 token in 1.2 plain steps' time
    assert not switch.should_draft()


def _run_switch(miss_keeps_every: int | None, steps: int = 400) -> DraftSwitch:
    """A switch over scripted steps: plain steps take 1 s, drafted ones 1.5 s. After a kept draft
    (H) every third draft misses and the others keep 3; after a miss (M) a draft keeps 1 every
    ``miss_keeps_every`` steps (never if None) and nothing otherwise."""
    switch, count = DraftSwitch(plain_seconds=1.0, min_drafts=8), {True: 0, False: 0}
    for _ in range(steps):
        if not switch.should_draft():
            switch.record(False, 0, 1.0)
            continue
        state = switch.hit
        count[state] += 1
        if state:
            kept = 0 if count[state] % 3 == 0 else 3
        else:
            kept = 1 if miss_keeps_every and count[state] % miss_keeps_every == 0 else 0
        switch.record(True, kept, 1.5)
    return switch


def test_the_draft_switch_drafts_after_a_miss_when_the_cycle_it_starts_pays():
    """After a miss, drafted steps alone run below the plain rate, but one in three takes the loop
    back to H, where drafting pays: the renewal cycle (one M step, then p_MH / p_HM H steps) beats
    plain decoding and the switch keeps drafting. Where a draft after a miss never hits, the cycle
    is M alone and the switch decodes plainly, probing now and then."""
    switch = _run_switch(miss_keeps_every=3)
    m, h = switch.stats[False], switch.stats[True]
    assert m.rate < switch.plain_rate < h.rate  # M's own drafts do not pay ...
    # ... the cycle does: (4/3 + (1/3)/(1/3) * 3) tokens in (1.5 + 1.5) s
    assert switch.drafting_rate(False) == pytest.approx((4 / 3 + 3) / 3.0, rel=0.05)
    assert switch.skipped == 0
    never = _run_switch(miss_keeps_every=None)
    assert never.drafting_rate(False) == pytest.approx(1 / 1.5, rel=0.01)
    assert never.skipped > 300  # plain steps, probes between them


def test_skipped_drafts_leave_the_output_alone(monkeypatch):
    """Greedy chain decoding whose switch skips every other step (plain steps in between drafted
    ones, the drafter catching up) emits the target's greedy tokens, for a block drafter and an
    autoregressive one."""
    from serve_eval.loop import speculative_generate
    from serve_eval.proposers import LMProposer

    calls = itertools.count()
    monkeypatch.setattr(DraftSwitch, "should_draft", lambda self: next(calls) % 2 == 0)
    target, drafter, prompt, reference = _toy_greedy_run()
    for proposer in (None, LMProposer(target, 3)):  # the target drafting for itself: every draft kept
        budget = Budget({1: 1.0, 2: 1.05, 8: 1.3})
        out, stats = speculative_generate(target, drafter, prompt, 30, budget=budget, proposer=proposer)
        assert out == reference
        assert 0 < budget.chosen.count(0) < len(budget.chosen)
    assert stats.tokens / stats.target_forwards > 1.5  # drafted steps did keep drafts


def test_extend_last_adds_candidates_while_the_rate_grows():
    budget = Budget({1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0, 8: 3.0})
    assert budget.best_prefix([0.9]) == 1  # 2 tokens, 1.9 expected
    # two more free (size 3 costs what 2 does), a third that costs a second step
    assert budget.extend_last([(0.8, 1), (0.0, 0), (0.1, 1)]) == 2
    assert budget.chosen == [2] and budget.predicted_tokens == pytest.approx(2.7)
    assert budget.predicted_seconds == pytest.approx(1.0)


def test_several_rows_choose_by_one_ranking_that_one_row_shares():
    """One row's choice over rows equals its best prefix; several rows take the best prefix of all their
    candidates ranked by their chances, each row a prefix of its own, and read nothing where no draft pays."""
    budget = Budget({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4, 16: 4.0})
    reach = [0.9, 0.8, 0.3, 0.05]
    assert budget.choose_rows([reach]) == [1 + Budget({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4, 16: 4.0}).best_prefix(reach)]
    counts = budget.choose_rows([[0.9, 0.8, 0.1], [0.5, 0.01, 0.0], [0.99, 0.98, 0.97]])
    assert counts[2] >= counts[0] >= counts[1] >= 1
    assert Budget({1: 1.0, 2: 5.0, 16: 50.0}).choose_rows([[0.5, 0.4], [0.5, 0.4]]) == [1, 1]
