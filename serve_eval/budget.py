"""Speculation budgets: how much each step verifies, from measured costs and measured acceptance.

A step over ``R`` rows reads ``t`` tokens in one target forward (each row its bonus and some drafts, or
a tree's nodes) at a measured cost ``c_R(t)`` (:class:`CostModel`), after a draft that costs ``d_R``.
Row ``r`` emits ``1 + sum_i P_r,i`` tokens on average, ``P_r,i`` the chance that its node ``i`` is
kept (in a chain: drafts ``1..i`` all are). Candidates come in each row's order (a chain's depths, a
best-first tree's pop order: a node after its parent), and a node is never likelier than its parent,
so the best choice is a prefix of all rows' candidates ranked by ``P``:

    argmax over prefixes  (R + sum P) / (c_R(tokens) + padding + d_R)

where ``padding`` prices the rows that read fewer tokens than the longest (:data:`PADDING_COST`). One
row is ``R = 1``: ``B* = argmax_B (1 + sum_{i <= B} P_i) / (c(B + 1) + d)``.

``P`` is the product along a node's path of the *calibrated* acceptance ``a(q)`` of each token, ``q``
the drafter's probability of it (:class:`Calibration`: acceptance counted in bins of ``q`` per depth
as decoding runs, starting from ``a(q) = q``).

Lossless: a choice reads the drafter's distributions, the calibration and earlier steps only, never
this step's target logits nor a sampled draft's value (a chain is ranked by the *top* probability at
each position). Where drafts are drawn one after another (EAGLE-3, causal LMs, DSpark's Markov head at
T > 0) ``q_{k+1}`` depends on ``d_k``, so position ``k`` is decided from ``q_1 .. q_k`` alone
(:class:`CausalChain`, forecasting later positions from the acceptance measured at their depths);
autoregressive drafters stop drafting where it says no.

Whether a step drafts at all is :class:`DraftSwitch`'s call, from the speed drafted and plain steps
measured earlier in the same loop. Measurements behind the constants: docs/benchmarks.md.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import operator
import statistics
from collections.abc import Callable
from typing import Any

import torch

#: bin edges over the drafter's probability q; fine near 0, where most tree nodes sit
Q_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0)
COPY_Q = 0.5  # the bin of a prompt-lookup copy's tokens (Calibration.copies): a copy has no q
#: a row padded to the step's longest costs this share of what reading those tokens would (the Linears skip
#: padding, the norms and activations do not; docs/benchmarks.md)
PADDING_COST = 0.2
#: a batch size drafts at all only if predicted this much faster than plain decoding; TAIL_MARGIN where fewer
#: than TAIL_WAVES waves of prompts pass through its slots, or rows are sampled (the tail of rows finishing
#: apart is much of such a run, and the per-step prediction does not see it; docs/benchmarks.md)
UP_FRONT_MARGIN, TAIL_MARGIN, TAIL_WAVES = 1.1, 1.6, 4


def kept_to(acceptances) -> list[float]:
    """The chance of keeping every token up to each depth, from the acceptance at each depth."""
    return list(itertools.accumulate(acceptances, operator.mul))


def up_front_margin(prompts: int, rows: int, sampled: bool) -> float:
    """How much faster than plain decoding a batch size must be predicted before it drafts at all."""
    return UP_FRONT_MARGIN if prompts >= TAIL_WAVES * rows and not sampled else TAIL_MARGIN


class RunningMean:
    """The mean of the values added, each new one weighted ``max(1 / n, floor)``: a plain mean while
    ``1 / n > floor``, then one that forgets at ``floor`` (about the last ``1 / floor`` values)."""

    def __init__(self, floor: float = 0.0):
        self.floor, self.value, self.n = floor, 0.0, 0

    def add(self, x: float) -> float:
        self.n += 1
        self.value += (x - self.value) * max(1 / self.n, self.floor)
        return self.value


class CostModel:
    """Seconds of a step. ``verify_costs``: one row's forward over ``n`` tokens, measured before decoding
    (:func:`serve_eval.timing.measure_verify_costs`) and used as measured (not smoothed: small-matrix
    kernels make some sizes cheaper than the size below them), linear between measured sizes. With
    ``loop_offset`` the loop's own one-row verifies correct the whole table by one offset (longer
    contexts, a drifting machine). ``step_seconds``: batched steps measured at ``rows`` rows, ``n``
    tokens a row (0: a plain step), which scale the table for batches (:meth:`tokens_seconds`)."""

    def __init__(
        self,
        verify_costs: dict[int, float],
        loop_offset: bool = False,
        step_seconds: dict[int, float] | None = None,
        rows: int | None = None,
    ):
        if 1 not in verify_costs:
            raise ValueError("verify_costs must include n = 1 (a plain decoding step)")
        self.sizes = sorted(verify_costs)
        self.seconds = [verify_costs[n] for n in self.sizes]
        self.loop_offset = loop_offset
        self.offset = RunningMean(1 / 64)  # measured verify seconds minus the table's, over the last ~64 verifies
        self.step_seconds, self.rows = step_seconds, rows
        self.scale: dict[bool, float] | None = None  # drafted (True) and plain batched steps against the table
        self.draft = {1: RunningMean()}  # rows -> a step's drafting seconds
        self.token = RunningMean()  # one sequential drafter forward (0: a block drafter)
        self.fixed = RunningMean()  # a one-row step's drafting beyond its sequential forwards
        self._costs: dict[tuple[int, float], dict[int, float]] = {}

    # -- the verify forward ----------------------------------------------------------------------
    def table_seconds(self, n: int) -> float:
        """The table's cost of ``n`` tokens, linear between measured sizes (past the largest: its last slope)."""
        sizes, secs = self.sizes, self.seconds
        if len(sizes) == 1:
            return secs[0]
        i = min(max(bisect.bisect_left(sizes, n), 1), len(sizes) - 1)
        lo, hi = sizes[i - 1], sizes[i]
        return secs[i - 1] + (secs[i] - secs[i - 1]) * (n - lo) / (hi - lo)

    @property
    def verify_offset(self) -> float:
        return self.offset.value

    def verify_seconds(self, n: int) -> float:
        """One row's forward over ``n`` tokens: the table plus the offset the loop's verifies measured."""
        return self.table_seconds(n) + self.offset.value

    def observe_verify(self, n: int, seconds: float) -> None:
        """A one-row verify of ``n`` tokens took ``seconds``: the offset follows (never below minus half a
        plain step). Only with ``loop_offset``: a made-up table stays as given."""
        if self.loop_offset:
            self.offset.add(seconds - self.table_seconds(n))
            self.offset.value = max(self.offset.value, -0.5 * self.table_seconds(1))

    def tokens_seconds(self, rows: int, tokens: int) -> float:
        """A batched forward over ``rows`` rows reading ``tokens`` in all: the one-row table's cost of as
        many tokens, times the ratio batched steps measured against it at ``self.rows`` rows (drafted
        steps: the median over ``n``; plain steps: their own). Both ratios come from one interleaved
        measurement, so a machine running faster or slower than when the table was timed moves drafted
        and plain steps alike."""
        proxy = self.verify_seconds(tokens)
        if self.step_seconds is None or self.rows is None:
            return proxy
        if self.scale is None:
            measured = self.rows
            ratios = sorted(t / self.verify_seconds(measured * m) for m, t in self.step_seconds.items() if m > 1)
            plain = self.step_seconds.get(0)
            self.scale = {
                True: ratios[len(ratios) // 2],
                False: 1.0 if plain is None else plain / self.verify_seconds(measured),
            }
        return proxy * self.scale[tokens > rows]

    def step_costs(self, rows: int, most: int) -> dict[int, float]:
        """:meth:`tokens_seconds` of ``rows`` rows for every total from ``rows`` to ``most`` (cached per
        verify offset for several rows; one row's offset moves every step)."""
        if rows == 1:
            return {t: self.verify_seconds(t) for t in range(1, most + 1)}
        key = (rows, self.offset.value)
        if key not in self._costs or most not in self._costs[key]:
            self._costs[key] = {t: self.tokens_seconds(rows, t) for t in range(rows, max(most, rows) + 1)}
        return self._costs[key]

    # -- drafting ----------------------------------------------------------------------------------
    def observe_draft(self, seconds: float, forward_seconds=(), rows: int = 1) -> None:
        """A step's drafting took ``seconds``, ``forward_seconds`` of them the sequential drafter forwards
        it timed one by one (an autoregressive drafter's, one row)."""
        if rows != 1:
            self.draft.setdefault(rows, RunningMean(0.1)).add(seconds)
            return
        for t in forward_seconds:
            self.token.add(t)
        self.draft[1].add(seconds)
        self.fixed.add(seconds - self.token.value * len(forward_seconds))

    def drafting(self, rows: int = 1) -> float:
        """A step's drafting seconds at ``rows`` rows (a number of rows not measured yet: the dearest seen)."""
        mean = self.draft.get(rows)
        if mean is not None and (mean.n or rows == 1):
            return mean.value
        return max((m.value for m in self.draft.values() if m.n), default=0.0)

    def seed_drafting(self, rows: int, seconds: float) -> None:
        """Drafting at ``rows`` rows measured before decoding: the mean starts there."""
        mean = self.draft.setdefault(rows, RunningMean(0.1))
        mean.value, mean.n = seconds, 1

    @property
    def token_seconds(self) -> float:
        return self.token.value

    @property
    def draft_fixed(self) -> float:
        return self.fixed.value

    def draft_cost(self, drafts: int, horizon: int) -> float:
        """``d(m)`` of a one-row step verifying ``drafts`` of at most ``horizon``: the fixed part and one
        sequential forward per draft, plus the one that showed the next position does not pay."""
        return self.fixed.value + self.token.value * min(drafts + 1, horizon)


class Calibration:
    """The acceptance ``a(q)`` of tokens the drafter gave probability ``q``: counted in bins of ``q``, per
    depth (a node's depth, a draft's position), each depth's rate shrunk towards the bin's rate over
    all depths with the weight of ``prior`` observations, the pooled rates starting from the bins'
    centres. ``copies``: the prompt-lookup copies' own calibration (every copied token in the bin of
    :data:`COPY_Q`), shared with this one wherever this one is."""

    def __init__(self, prior: float = 4.0, copies: bool = True):
        centres = [(lo + hi) / 2 for lo, hi in zip(Q_EDGES[:-1], Q_EDGES[1:])]
        self.prior = prior
        self.accepted = [prior * c for c in centres]  # pooled over depths
        self.trials = [prior] * len(centres)
        self.by_depth: dict[int, tuple[list[float], list[float]]] = {}  # depth -> (accepted, trials) per bin
        self._depth_rates: dict[int, float] = {}
        self.copies = Calibration(prior, copies=False) if copies else None

    @staticmethod
    def _bin(q: float) -> int:
        return min(bisect.bisect_right(Q_EDGES, q) - 1, len(Q_EDGES) - 2)

    def acceptance(self, q: float, depth: int | None = None) -> float:
        """``a(q)`` at ``depth`` (1-based; without one, the pooled rate)."""
        b = self._bin(q)
        pooled = self.accepted[b] / self.trials[b]
        if depth is None or depth not in self.by_depth:
            return pooled
        accepted, trials = self.by_depth[depth]
        return (accepted[b] + self.prior * pooled) / (trials[b] + self.prior)

    def log_acceptance(self, q: torch.Tensor) -> torch.Tensor:
        """``log a(q)`` for per-depth drafter probabilities ``q`` [D, V] (row ``d`` at depth ``d + 1``), ties
        within a bin broken by ``q`` (a vanishing ``1e-3 log q``): ranking by it ranks by calibrated acceptance."""
        edges = torch.tensor(Q_EDGES[1:-1], dtype=q.dtype, device=q.device)
        centres = [(lo + hi) / 2 for lo, hi in zip(Q_EDGES[:-1], Q_EDGES[1:])]
        table = torch.tensor(
            [[self.acceptance(c, d + 1) for c in centres] for d in range(q.shape[0])], dtype=q.dtype, device=q.device
        )
        return table.gather(1, torch.bucketize(q, edges, right=True)).log() + 1e-3 * q.log()

    def count(self, q: float, accepted: float, depth: int) -> None:
        """One observation: a token given ``q`` at ``depth`` was kept (``accepted`` 1), not (0), or kept
        with that probability."""
        b = self._bin(q)
        self._depth_rates.clear()
        self.trials[b] += 1
        self.accepted[b] += accepted
        cells = self.by_depth.setdefault(depth, ([0.0] * len(self.trials), [0.0] * len(self.trials)))
        cells[0][b] += accepted
        cells[1][b] += 1

    def depth_acceptance(self, depth: int) -> float:
        """The rate at which drafts at ``depth`` were kept when their parent was, whatever their ``q``."""
        if depth not in self._depth_rates:  # cached until the next count
            pooled = sum(self.accepted) / sum(self.trials)
            accepted, trials = self.by_depth.get(depth, ([0.0], [0.0]))
            self._depth_rates[depth] = (sum(accepted) + self.prior * pooled) / (sum(trials) + self.prior)
        return self._depth_rates[depth]

    def chain_reach(self, top_q: list[float]) -> list[float]:
        """The chance that a chain is kept up to each depth: the products of the calibrated acceptances
        of its top probabilities at depths ``1..j``."""
        return kept_to(self.acceptance(q, depth) for depth, q in enumerate(top_q, start=1))

    def tree_reach(self, node_q: list[float], parents: list[int], depths: list[int]) -> list[float]:
        """The chance that each node of a tree (pop order, ``parents[i] < i``, -1: the root) is kept."""
        reach: list[float] = []
        for q, parent, depth in zip(node_q, parents, depths):
            reach.append(self.acceptance(q, depth) * (reach[parent] if parent >= 0 else 1.0))
        return reach

    def record_chain(self, top_q: list[float], verified: int, accepted: int, next_outcome: float | None = None) -> None:
        """After a chain step that verified the first ``verified`` drafts (ranked by ``top_q``) and kept
        ``accepted``: every verified position up to the first miss counts; when all were kept, the first
        unverified one counts too with ``next_outcome``, whether (T = 0), or with what probability
        (T > 0), the target would have kept it."""
        for k, q in enumerate(top_q[: min(accepted + 1, verified)]):
            self.count(q, float(k < accepted), k + 1)
        if accepted == verified < len(top_q) and next_outcome is not None:
            self.count(top_q[verified], next_outcome, verified + 1)

    def record_tree(
        self,
        node_q: list[float],
        parents: list[int],
        depths: list[int],
        path: list[int],
        verified: int,
        unverified: dict[int, float] | None = None,
    ) -> None:
        """After a tree walk over the first ``verified`` nodes, ``path`` the accepted ones as indices into
        [root, nodes]: verified nodes whose parent was accepted count, kept or not; so do the unverified
        nodes in ``unverified`` (node -> whether, or with what probability, the target would have kept it)."""
        on_path = set(path)
        for i, (q, parent) in enumerate(zip(node_q[:verified], parents[:verified])):
            if parent + 1 in on_path:
                self.count(q, float(i + 1 in on_path), depths[i])
        for i, outcome in (unverified or {}).items():
            self.count(node_q[i], outcome, depths[i])

    def record_copies(self, copied: list[int], nodes: list[int], path: list[int], emitted: list[int]) -> None:
        """Prompt-lookup copies (``copied`` the copy, ``nodes`` the tree node of each verified copied token):
        each copied token whose parent was accepted counts, kept iff on ``path``; when every verified one
        was, the next copied token counts too, kept iff it is the target's choice after the last
        (``emitted``: the step's accepted tokens and the new bonus, in path order)."""
        on_path = set(path)
        for depth, node in enumerate(nodes, start=1):
            kept = node + 1 in on_path
            self.count(COPY_Q, float(kept), depth)
            if not kept:
                return
        if len(nodes) < len(copied):
            self.count(COPY_Q, float(copied[len(nodes)] == emitted[len(nodes)]), len(nodes) + 1)

    def summary(self) -> list[dict]:
        return [
            {"q": [lo, hi], "acceptance": round(a / t, 4), "seen": int(t - self.prior)}
            for lo, hi, a, t in zip(Q_EDGES[:-1], Q_EDGES[1:], self.accepted, self.trials)
        ]


class Probes:
    """When a loop that stopped drafting drafts again to see whether it should: after ``first`` plain
    steps, then, while the probes keep saying drafting does not pay, after twice as many (up to
    ``limit``); a probe that pays resets the wait."""

    def __init__(self, first: int = 8, limit: int = 64):
        self.first, self.limit = first, limit
        self.after, self.run = first, 0

    def due(self) -> bool:
        return self.run >= self.after

    def skipped(self) -> None:
        self.run += 1

    def drafted(self, paid: bool) -> None:
        """A drafted step; ``paid``: whether drafting, as measured now, beats plain decoding."""
        if paid:
            self.after = self.first
        elif self.due():  # a probe that did not pay
            self.after = min(2 * self.after, self.limit)
        self.run = 0


class _Drafted:
    """Drafted steps taken in one state: running sums that forget old steps (by ``forget`` a step) of row
    tokens, seconds, steps and steps that kept a draft, and how many steps were seen in all."""

    def __init__(self, forget: float):
        self.forget = forget
        self.tokens = self.seconds = self.steps = self.hits = 0.0
        self.seen = 0

    def add(self, tokens: int, seconds: float, hit: bool) -> None:
        f = self.forget
        self.tokens, self.seconds = f * self.tokens + tokens, f * self.seconds + seconds
        self.steps, self.hits = f * self.steps + 1, f * self.hits + hit
        self.seen += 1

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)


class DraftSwitch:
    """Whether a step of ``rows`` rows drafts at all: drafted steps' measured row tokens per second
    against plain steps' (an off switch), with :class:`Probes` now and then while it is off. It decides
    from earlier steps only: lossless at every temperature.

    With ``streaks`` drafted steps are counted apart in two states, after a step that kept a draft
    (``H``) and after one that did not or did not draft (``M``). In ``H`` a step drafts while ``H``'s rate
    beats plain decoding's. From ``M`` the rate is that of the renewal cycle a draft starts -- one step
    in ``M``, then ``p_MH / p_HM`` steps in ``H`` on average:

        r_M = (tok_M + (p_MH / p_HM) tok_H) / (sec_M + (p_MH / p_HM) sec_H)

    so a stretch the drafter cannot follow (``p_MH`` near 0) decodes plainly until a probe hits.

    The plain rate is ``rows / plain_seconds`` (a bare forward, optimistic) until plain steps ran; the
    first time drafting measures below it, ``measure`` plain steps run to measure them, and from then on
    it is ``rows`` over the median of the last :attr:`PLAIN_WINDOW` plain steps (one stalled step does
    not hold it up). Drafting must beat it by ``margin``, after ``min_drafts`` drafted steps in a state."""

    PLAIN_WINDOW = 16

    def __init__(
        self,
        plain_seconds: float,
        min_drafts: int = 16,
        measure: int = 3,
        margin: float = 1.0,
        probes: Probes | None = None,
        rows: int = 1,
        forget: float = 0.995,
        streaks: bool = True,
    ):
        self.min_drafts, self.measure, self.margin, self.rows, self.streaks = min_drafts, measure, margin, rows, streaks
        self.bare_seconds = plain_seconds
        self.plain: collections.deque[float] = collections.deque(maxlen=max(self.PLAIN_WINDOW, measure))
        self.stats = {True: _Drafted(forget), False: _Drafted(forget)}  # H (the last step kept a draft) and M
        self.hit = True
        self.probes = probes or Probes()
        self.skipped = 0

    @property
    def plain_rate(self) -> float:
        return self.rows / (statistics.median(self.plain) if self.plain else self.bare_seconds)

    def drafting_rate(self, hit: bool) -> float:
        """Row tokens per second of drafting from state ``hit`` on (see the class doc)."""
        h, m = self.stats[True], self.stats[False]
        if hit or not h.steps or not m.steps:
            return self.stats[hit].rate
        p_mh, p_hm = m.hits / m.steps, 1 - h.hits / h.steps
        w = p_mh / max(p_hm, 1e-3)  # H steps per M step of the cycle
        return (m.tokens / m.steps + w * h.tokens / h.steps) / (m.seconds / m.steps + w * h.seconds / h.steps)

    def should_draft(self, predicted: Callable[[], bool] | None = None) -> bool:
        """Whether the next step drafts; ``predicted()`` (asked only where the measured rates say yes):
        whether a prediction agrees."""
        measuring = 0 < len(self.plain) < self.measure
        if not measuring and (
            self.stats[self.hit].seen < self.min_drafts
            or self.probes.due()
            or (self.drafting_rate(self.hit) > self.margin * self.plain_rate and (predicted is None or predicted()))
        ):
            return True
        self.probes.skipped()
        self.skipped += 1
        return False

    def record(self, drafted: bool, kept: int, seconds: float) -> None:
        """A step that drafted (or not) kept ``kept`` drafts over its rows and took ``seconds``."""
        if drafted:
            cell = self.stats[self.hit]
            cell.add(kept + self.rows, seconds, kept > 0)
            if cell.seen >= self.min_drafts:
                self.probes.drafted(self.drafting_rate(self.hit) > self.plain_rate)
        else:
            self.plain.append(seconds)
        self.hit = kept > 0 or not self.streaks

    def summary(self) -> dict:
        return {
            "skipped_steps": self.skipped,
            "drafted_tokens_per_s": {
                ("after a kept draft" if h else "after a miss"): round(self.stats[h].rate, 2)
                for h in (True, False)
                if self.stats[h].seen
            },
            "drafting_from_a_miss_tokens_per_s": round(self.drafting_rate(False), 2),
            "plain_tokens_per_s": round(self.plain_rate, 2),
        }


class CausalChain:
    """:meth:`Budget.causal_length` one position at a time: :meth:`offer` each position's top ``q`` (one
    per row) in order; it answers whether that position is verified, from it and the earlier ones
    alone. An autoregressive drafter asks after each distribution and stops drafting at the first no;
    several rows offer every row's ``q`` at once, with their batched ``cost``."""

    def __init__(self, budget: Budget, horizon: int, cost=None, rows: int = 1):
        self.budget, self.horizon = budget, horizon
        costs = budget.costs
        self.cost = cost or (lambda m: costs.verify_seconds(m + 1) + costs.draft_cost(m, horizon))
        self.reach = [1.0] * rows  # each row's P of the last verified position
        self.gain, self.kept, self.open = float(rows), 0, True

    def offer(self, *qs: float) -> bool:
        if not self.open:
            return False
        depth = self.kept + 1
        reach = [r * self.budget.calibration.acceptance(q, depth) for r, q in zip(self.reach, qs)]
        self.open = self.budget.pays_to_include(self.gain, sum(reach), depth, self.horizon, self.cost)
        if self.open:
            self.gain, self.reach, self.kept = self.gain + sum(reach), reach, depth
        return self.open


class Budget:
    """Chooses what each step verifies (see the module doc) and whether it drafts: a :class:`CostModel`,
    a :class:`Calibration` (``calibration``: one to share, e.g. a one-row run's lent to batches), and a
    :class:`DraftSwitch` per number of rows. ``step_seconds`` / ``rows``: batched steps measured at
    ``rows`` rows (:class:`CostModel`); ``min_drafts``: several rows' drafted steps before the
    calibration's prediction may stop drafting (1: a calibration lent by a one-row run)."""

    def __init__(
        self,
        verify_costs: dict[int, float],
        prior: float = 4.0,
        calibration: Calibration | None = None,
        loop_offset: bool = False,
        step_seconds: dict[int, float] | None = None,
        rows: int | None = None,
        min_drafts: int = 8,
    ):
        self.costs = CostModel(verify_costs, loop_offset, step_seconds, rows)
        self.calibration = calibration or Calibration(prior)
        self.lookup = self.calibration.copies  # prompt-lookup copies' calibration
        self.chosen: list[int] = []  # one row: the drafts (or nodes) verified each step
        self.by_rows: list[list[int]] = []  # several rows: each row's tokens read each step
        self.predicted_tokens = self.predicted_seconds = 0.0  # sums over one-row steps of what each choice expected
        self._last = (1.0, 1)  # expected tokens and verify size of the last one-row choice
        self.switches: dict[int, DraftSwitch] = {}
        self.min_drafts, self.drafts_seen, self.drafted_steps, self.copied_rows = min_drafts, 0, 0, 0
        self.top_q_mean: list[RunningMean] = []  # several rows: per position, the drafted rows' mean top q
        self.off = False  # several rows: the up-front prediction turned this batch size off
        self.predicted: float | None = None  # the up-front prediction (predicted_speedup), when made
        self.margin: float | None = None  # the margin it was held to

    # -- the off switch ----------------------------------------------------------------------------
    def switch_for(self, rows: int = 1) -> DraftSwitch:
        """The :class:`DraftSwitch` of ``rows`` rows: one row's counts streaks; several rows' compares by
        a margin (their rows finish apart, a tail plain decoding does not have) and forgets faster."""
        if rows not in self.switches:
            plain = self.costs.tokens_seconds(rows, rows) if rows > 1 else self.costs.verify_seconds(1)
            self.switches[rows] = (
                DraftSwitch(plain)
                if rows == 1
                else DraftSwitch(plain, min_drafts=8, margin=1.1, rows=rows, forget=0.98, streaks=False)
            )
        return self.switches[rows]

    @property
    def switch(self) -> DraftSwitch:
        return self.switch_for(1)

    def should_draft(self, rows: int = 1) -> bool:
        """Whether a chain step of ``rows`` rows drafts: its switch's call; for several rows also the
        calibration's prediction for a typical row as it stands (once it has seen ``min_drafts`` steps)."""
        if rows == 1:
            return self.switch.should_draft()
        if self.drafts_seen < self.min_drafts:
            return True

        def predicted() -> bool:
            reach = self.calibration.chain_reach([m.value for m in self.top_q_mean])
            return self._typical_rate(rows, reach) > rows / self.costs.tokens_seconds(rows, rows)

        return self.switch_for(rows).should_draft(predicted)

    def record_step(self, rows: int, drafted: bool, kept: int, seconds: float) -> None:
        """A chain step of ``rows`` rows that drafted (or not) kept ``kept`` drafts in all in ``seconds``."""
        self.switch_for(rows).record(drafted, kept, seconds)

    # -- one row's choices -------------------------------------------------------------------------
    def best_prefix(self, reach: list[float]) -> int:
        """``B*`` for one row's nodes whose chances of being kept, in candidate order, are ``reach``."""
        d = self.costs.drafting()
        cost = self.costs.verify_seconds(1) + d
        best, best_gain, best_cost, gain = 0, 1.0, cost, 1.0
        for b, p in enumerate(reach, start=1):
            gain += p
            cost = self.costs.verify_seconds(b + 1) + d
            if gain / cost > best_gain / best_cost:
                best, best_gain, best_cost = b, gain, cost
        self._record_choice(best, best_gain, best_cost)
        return best

    def chain_length(self, top_q: list[float]) -> int:
        """How many drafts of a chain to verify, from the drafter's top probability at each position."""
        return self.best_prefix(self.calibration.chain_reach(top_q))

    def tree_size(self, node_q: list[float], parents: list[int], depths: list[int]) -> int:
        """How many of a best-first tree's nodes (pop order) to verify; ``parents[i] < i`` (-1: root)."""
        return self.best_prefix(self.calibration.tree_reach(node_q, parents, depths))

    def record_plain(self) -> None:
        """A one-row step that did not draft: one token for a plain step's cost."""
        self._record_choice(0, 1.0, self.costs.verify_seconds(1))

    def _record_choice(self, drafts: int, gain: float, seconds: float) -> None:
        self.chosen.append(drafts)
        self.predicted_tokens += gain
        self.predicted_seconds += seconds
        self._last = (gain, drafts + 1)

    def extend_last(self, extra: list[tuple[float, int]]) -> int:
        """After a one-row choice: how many of the further candidates ``extra`` (in order; each the expected
        tokens it adds and the tokens it adds to the forward) to verify as well, by the same rate (ties:
        the longer, shared nodes are free). The last choice's record grows accordingly."""
        d, verify = self.costs.drafting(), self.costs.verify_seconds
        gain, size = self._last
        best, best_gain, best_size = 0, gain, size
        for i, (g, n) in enumerate(extra, start=1):
            gain, size = gain + g, size + n
            if gain / (verify(size) + d) >= best_gain / (verify(best_size) + d):
                best, best_gain, best_size = i, gain, size
        self.chosen[-1] = best_size - 1
        self.predicted_tokens += best_gain - self._last[0]
        self.predicted_seconds += verify(best_size) - verify(self._last[1])
        self._last = (best_gain, best_size)
        return best

    def causal_length(self, top_q: list[float], horizon: int | None = None) -> int:
        """How many drafts of a chain to verify when draft ``k`` may be chosen from ``top_q[:k]`` only
        (drafts drawn one after another): those before the first that does not pay, lengths up to
        ``horizon`` (default ``len(top_q)``) forecast. Recorded as a step's choice."""
        chain = CausalChain(self, horizon or len(top_q))
        for q in top_q:
            if not chain.offer(q):
                break
        return self.record_causal(chain)

    def record_causal(self, chain: CausalChain) -> int:
        """Record the choice a :class:`CausalChain` made (its positions already offered); its length."""
        self._record_choice(chain.kept, chain.gain, chain.cost(chain.kept))
        return chain.kept

    def pays_to_include(self, gain: float, reach: float, k: int, horizon: int, cost) -> bool:
        """Whether verifying position ``k`` beats stopping before it, from what is known up to ``k``:
        ``gain`` the expected tokens of positions ``< k`` (bonus tokens included), ``reach`` the expected
        tokens position ``k`` adds (summed over rows), ``cost(m)`` a step's seconds verifying ``m``
        drafts per row. Lengths ``k .. horizon`` are tried (costs are not monotone), each further
        position kept at the rate measured at its depth."""
        stop = gain / cost(k - 1)
        for m in range(k, horizon + 1):
            gain += reach
            if gain / cost(m) > stop:
                return True
            reach *= self.calibration.depth_acceptance(m + 1)
        return False

    # -- several rows' choices ---------------------------------------------------------------------
    def choose_rows(self, reaches: list[list[float]], top_q: torch.Tensor | None = None) -> list[int]:
        """Each row's tokens to read (its bonus and a prefix of its candidates) from the chance that it
        keeps them up to each one, ``reaches[r]`` (candidates in the row's order): the prefix of all
        rows' candidates ranked by that chance with the most expected tokens per second, padding priced
        (:data:`PADDING_COST`); every row 1 where that does not beat a plain step. ``top_q`` [R, D]: the
        drafter's top probabilities, for the typical row :meth:`should_draft` predicts from."""
        rows = len(reaches)
        self._saw_drafts(top_q)
        ranked = sorted(
            ((reach, r) for r, row in enumerate(reaches) for reach in row), key=lambda item: item[0], reverse=True
        )
        counts, rate = self._best_prefix(rows, ranked, max(map(len, reaches), default=0) + 1)
        if rate <= rows / (self.costs.tokens_seconds(rows, rows) + self.costs.drafting(rows)):
            counts = [1] * rows  # the drafts, already paid for, would not pay
        self.by_rows.append(counts)
        return counts

    def choose_rows_causal(self, top_q: torch.Tensor) -> list[int]:
        """One length for every row when drafts are drawn one after another: position ``k`` decided from
        every row's top ``q`` up to ``k`` (:class:`CausalChain` over the rows, their batched cost)."""
        rows, horizon = top_q.shape
        self._saw_drafts(top_q)
        cost = lambda m: self.costs.tokens_seconds(rows, rows * (m + 1)) + self.costs.drafting(rows)  # noqa: E731
        chain = CausalChain(self, horizon, cost, rows)
        for qs in top_q.t().tolist():
            if not chain.offer(*qs):
                break
        counts = [chain.kept + 1] * rows
        self.by_rows.append(counts)
        return counts

    def _saw_drafts(self, top_q: torch.Tensor | None) -> None:
        self.drafts_seen += 1
        self.drafted_steps += 1
        if top_q is not None and top_q.numel():
            means = top_q.mean(0).tolist()
            if not self.top_q_mean:
                self.top_q_mean = [RunningMean(0.05) for _ in means]
            for mean, q in zip(self.top_q_mean, means):
                mean.add(q)

    def record_rows_plain(self, rows: int) -> None:
        self.by_rows.append([1] * rows)

    def _best_prefix(self, rows: int, ranked, longest_possible: int) -> tuple[list[int], float]:
        """Over the prefixes of ``ranked`` (a candidate's chance of being kept, its row), best first: the rows'
        token counts and the rate of the prefix with the most expected tokens per second (one candidate at least)."""
        cost = self.costs.step_costs(rows, rows * max(longest_possible, 2))
        counts, tokens, longest, gain, draft = [1] * rows, rows, 1, 0.0, self.costs.drafting(rows)
        best, best_rate = [1] * rows, 0.0
        for value, r in ranked:
            counts[r] += 1
            tokens, longest, gain = tokens + 1, max(longest, counts[r]), gain + value
            seconds = cost[tokens] + PADDING_COST * (cost[rows * longest] - cost[tokens])
            rate = (rows + gain) / (seconds + draft)
            if rate > best_rate:
                best, best_rate = list(counts), rate
        return best, best_rate

    def _typical_rate(self, rows: int, reach: list[float]) -> float:
        """The best rate of a drafted step whose ``rows`` rows each keep their drafts up to depth ``j`` with
        chance ``reach[j - 1]``: every row's depth 1 ranked first, then every row's depth 2, and so on."""
        return self._best_prefix(rows, ((p, r) for p in reach for r in range(rows)), len(reach) + 1)[1]

    def predicted_speedup(self, rows: int, depths: int) -> float:
        """Before a batch of ``rows`` drafts at all: the best predicted rate of drafted steps against plain
        ones, for a typical row kept at the acceptance measured at each of ``depths`` depths."""
        reach = kept_to(self.calibration.depth_acceptance(depth) for depth in range(1, depths + 1))
        return self._typical_rate(rows, reach) / (rows / self.costs.tokens_seconds(rows, rows))

    # -- reports -----------------------------------------------------------------------------------
    def summary(self) -> dict:
        """One row's report: what was verified, what the choices expected, the costs and the calibration."""
        steps = max(1, len(self.chosen))
        verified = [1 + b for b in self.chosen]
        costs = self.costs
        return {
            "mean_verified": round(sum(verified) / steps, 3),
            "verified_histogram": {str(n): verified.count(n) for n in sorted(set(verified))},
            "predicted": {
                "tau": round(self.predicted_tokens / steps, 4),
                "step_ms": round(1e3 * self.predicted_seconds / steps, 3),
                "tokens_per_s": round(self.predicted_tokens / max(self.predicted_seconds, 1e-12), 2),
            },
            "verify_ms": {str(n): round(s * 1e3, 3) for n, s in zip(costs.sizes, costs.seconds)},
            "verify_offset_ms": round(costs.verify_offset * 1e3, 3),
            "draft_ms": round(costs.drafting() * 1e3, 3),
            **({"switch": self.switch.summary()} if 1 in self.switches and self.switch.skipped else {}),
            **({"draft_forward_ms": round(costs.token_seconds * 1e3, 3)} if costs.token.n else {}),
            "calibration": self.calibration.summary(),
        }

    def batch_summary(self, rows: int) -> dict:
        """A batch size's report: its measured step table, prediction and margin, measured rates, and
        what its steps verified."""
        costs = self.costs
        measured: dict[str, Any] = {}
        if costs.step_seconds:
            measured["step_ms"] = {n: round(t * 1e3, 2) for n, t in costs.step_seconds.items()}
        if self.predicted is not None:
            measured["predicted_speedup"] = round(self.predicted, 4)
        if self.margin is not None:
            measured["up_front_margin"] = self.margin
        switch = self.switches.get(rows)
        if switch is not None:
            rates = {"drafted": round(switch.stats[True].rate, 2)} if switch.stats[True].seen else {}
            if switch.plain:
                rates["plain"] = round(switch.plain_rate, 2)
            if rates:
                measured["measured_tokens_per_s"] = rates
        if not self.by_rows and self.off:
            return {"off": True, "drafted_fraction": 0.0, **measured}
        per_row = [n for step in self.by_rows for n in step]
        return {
            **measured,
            "mean_verified": round(sum(per_row) / max(1, len(per_row)), 3),
            "verified_histogram": {str(n): per_row.count(n) for n in sorted(set(per_row))},
            "drafted_fraction": round(self.drafted_steps / max(1, len(self.by_rows)), 4),
            **({"copied_fraction": round(self.copied_rows / len(per_row), 4)} if self.copied_rows else {}),
        }
