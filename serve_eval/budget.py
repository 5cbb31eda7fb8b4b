"""Speculation budgets chosen every step from measured costs and measured acceptance.

A step reads ``n`` tokens in one target forward (the bonus and ``n - 1`` drafts, or the root and a
tree of ``n - 1`` nodes) at a cost ``c(n)`` measured on this machine (:func:`serve_eval.engine.measure_verify_costs`),
after a draft that costs ``d`` (measured as decoding runs). It emits ``1 + sum_i P_i`` tokens on
average, ``P_i`` the probability that node ``i`` is accepted (in a chain: drafts ``1..i`` all are).
Of the candidate prefixes ``i <= B`` -- the first ``B`` drafts of a chain, or the first ``B`` nodes a
best-first tree popped, which always form a tree because a node is popped after its parent -- the
step verifies the one with the most tokens per second:

    B* = argmax_{B >= 0}  (1 + sum_{i <= B} P_i) / (c(B + 1) + d)

The costs are measured at every size up to 33 tokens (and sparsely beyond, linear in between), and
used as measured: they are not monotone (see :class:`Budget`). The loop's own verifies add one
offset to them all (:meth:`Budget.observe_verify`: longer contexts, a drifting machine).

``P_i`` is the product, along the node's path, of the *calibrated* acceptance ``a(q)`` of each of its
tokens, ``q`` the drafter's probability of that token given its parent: the rate at which tokens the
drafter gave about ``q`` were accepted when their parent was, counted in bins of ``q`` as decoding
runs and starting from ``a(q) = q`` with the weight of ``prior`` observations. (At temperature 0 a
drafter trained towards the target's distribution is under-confident: a token it gives 0.3 is the
target's argmax about half the time. The counts correct that for the drafter at hand.)

Lossless. ``B*`` depends on the drafter's distributions and on earlier steps only, never on the
target's logits for this step nor on the value of a sampled draft: a chain ranks position ``k`` by
the drafter's *top* probability there, not by the probability of the token it drew; at temperature 0
the emitted tokens are the target's greedy ones whatever is verified. Trees are built best-first by
``log a(q)``, from ``q`` and earlier steps alone, so their ``P_i`` come out in the order they are popped.

Causal choices. Speculative sampling keeps draft ``d_k`` with probability ``min(1, p/q_k)``, which
is exact only if whether ``d_k`` is verified at all does not depend on ``d_k``. When the drafts are
drawn one after another -- ``q_{k+1}`` computed from ``d_k``: EAGLE-3, a causal LM, DSpark's Markov
head -- the best prefix above looks at ``q_{k+1}`` and so, through it, at ``d_k``. For those drafters
at temperature > 0, and for autoregressive drafters always (they stop drafting where the rule stops,
which saves their forwards), :meth:`Budget.causal_length` decides position ``k`` from ``q_1 .. q_k``
alone: it verifies ``d_k`` iff some length ``m >= k`` beats stopping before it, ``P_j`` for ``j > k``
forecast from ``P_k`` and the acceptance measured at depths ``k+1 .. j``. Autoregressive drafting
costs ``d(m) = d_0 + t min(m + 1, K - 1)`` for ``m`` verified drafts (``t`` one drafter forward,
measured as decoding runs; the ``+ 1`` is the forward that showed position ``m + 1`` does not pay);
a block drafter's ``t`` is 0.

Whether a one-row chain step drafts at all is :class:`DraftSwitch`'s call, from the speed drafted
and plain steps measured earlier in the same loop.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import operator
import statistics

import torch

#: bin edges over the drafter's probability q; fine near 0, where most tree nodes sit
Q_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0)
COPY_Q = 0.5  # the calibration bin of a prompt-lookup copy's tokens (Budget.copy_calibration): a copy has no q


def kept_to(acceptances) -> list[float]:
    """The chance of keeping every token up to each depth, from the acceptance at each depth."""
    return list(itertools.accumulate(acceptances, operator.mul))


class Budget:
    """Chooses how many drafts (chain) or tree nodes (tree) each step verifies; see the module doc."""

    def __init__(self, verify_costs: dict[int, float], prior: float = 4.0, share: "Budget | None" = None,
                 loop_offset: bool = False):
        if 1 not in verify_costs:
            raise ValueError("verify_costs must include n = 1 (a plain decoding step)")
        self.sizes = sorted(verify_costs)
        # used as measured, not smoothed to be non-decreasing: small-matrix kernels make some sizes
        # cheaper than the size below them (on this CPU 4 tokens cost less than 3, 8 less than 7), and
        # the argmax below then never verifies 3 tokens when it could verify 4
        self.seconds = [verify_costs[n] for n in self.sizes]
        self.loop_offset = loop_offset  # whether the loop's verifies correct the table (observe_verify)
        self.verify_offset = 0.0  # running mean of measured verify seconds minus the table's
        self.verifies_seen = 0
        self.draft_seconds = 0.0  # running mean of a step's measured drafting cost
        self.token_seconds = 0.0  # running mean of one sequential drafter forward (0: a block drafter)
        self.draft_fixed = 0.0  # running mean of a step's drafting cost beyond its sequential forwards
        self.drafts_seen = self.forwards_seen = 0
        centres = [(lo + hi) / 2 for lo, hi in zip(Q_EDGES[:-1], Q_EDGES[1:])]
        self.prior = prior
        self.accepted = [prior * c for c in centres]  # pooled over depths
        self.trials = [prior] * len(centres)
        self.by_depth: dict[int, tuple[list[float], list[float]]] = {}  # depth -> (accepted, trials) per bin
        self._depth_rates: dict[int, float] = {}
        if share is not None:  # one acceptance calibration for budgets of different costs (batch sizes)
            self.prior, self.accepted, self.trials, self.by_depth = share.prior, share.accepted, share.trials, share.by_depth
        self.chosen: list[int] = []  # B* of every step, for the report
        self.predicted_tokens = 0.0  # sums over steps of the expected tokens and seconds of each choice
        self.predicted_seconds = 0.0
        self._last = (1.0, 1)  # expected tokens and verify size of the last choice
        # a Budget calibrating prompt-lookup copies per depth (serve_eval.lookup), shared like the rest
        self.lookup = None if share is None else share.lookup
        self.switch = DraftSwitch(self.verify_seconds(1))  # whether a chain step drafts at all

    def copy_calibration(self) -> "Budget":
        """Prompt-lookup copies' acceptance by depth (:mod:`serve_eval.lookup`), calibrated apart from
        the drafts' in a budget of its own (made on first use; its costs are never read), every copied
        token counted in the bin of ``COPY_Q``."""
        if self.lookup is None:
            self.lookup = Budget({1: 1.0})
        return self.lookup

    # -- costs -------------------------------------------------------------------------------------
    def verify_seconds(self, n: int) -> float:
        """``c(n)``: the table's cost plus the offset the loop's own verifies measured."""
        return self.table_seconds(n) + self.verify_offset

    def table_seconds(self, n: int) -> float:
        """The measured table's cost of ``n`` tokens, linear between measured sizes (and beyond the
        largest, at its last slope)."""
        sizes, secs = self.sizes, self.seconds
        if len(sizes) == 1:
            return secs[0]
        i = min(max(bisect.bisect_left(sizes, n), 1), len(sizes) - 1)
        lo, hi = sizes[i - 1], sizes[i]
        return secs[i - 1] + (secs[i] - secs[i - 1]) * (n - lo) / (hi - lo)

    def observe_draft(self, seconds: float, forward_seconds: list[float] = ()) -> None:
        """A step's drafting took ``seconds``, ``forward_seconds`` of them the sequential drafter
        forwards it timed one by one (an autoregressive drafter's; none for a block drafter)."""
        for t in forward_seconds:
            self.forwards_seen += 1
            self.token_seconds += (t - self.token_seconds) / self.forwards_seen
        self.drafts_seen += 1
        self.draft_seconds += (seconds - self.draft_seconds) / self.drafts_seen
        fixed = seconds - self.token_seconds * len(forward_seconds)
        self.draft_fixed += (fixed - self.draft_fixed) / self.drafts_seen

    def observe_verify(self, n: int, seconds: float) -> None:
        """A step's verify of ``n`` tokens took ``seconds``. The table was measured once, before
        decoding, at one context length; the loop's verifies read longer contexts (attention reads
        every cached position) on a machine whose speed drifts (on the shared CPUs here, by 10-25%
        within minutes). Both shift every size about alike, so the loop's verifies correct the table
        by one offset: their mean excess over it (a running mean over the last ~64 steps), never
        below minus half a plain step. Only with ``loop_offset`` (a table measured on this machine:
        a made-up one stays as given)."""
        if not self.loop_offset:
            return
        self.verifies_seen += 1
        weight = 1 / min(self.verifies_seen, 64)
        self.verify_offset += weight * (seconds - self.table_seconds(n) - self.verify_offset)
        self.verify_offset = max(self.verify_offset, -0.5 * self.table_seconds(1))

    def draft_cost(self, drafts: int, horizon: int) -> float:
        """``d(m)`` of a step verifying ``drafts`` of at most ``horizon`` (see the module doc)."""
        return self.draft_fixed + self.token_seconds * min(drafts + 1, horizon)

    # -- acceptance --------------------------------------------------------------------------------
    @staticmethod
    def _bin(q: float) -> int:
        return min(bisect.bisect_right(Q_EDGES, q) - 1, len(Q_EDGES) - 2)

    def acceptance(self, q: float, depth: int | None = None) -> float:
        """``a(q)`` at ``depth`` (1-based; the draft position, or a tree node's depth): that depth's own
        counts in ``q``'s bin, shrunk towards the bin's rate over all depths with the weight of
        ``prior`` observations. (Tokens at a deep position given the same ``q`` are kept more often:
        the contexts that reach it are the easy ones.) Without a depth, the pooled rate."""
        b = self._bin(q)
        pooled = self.accepted[b] / self.trials[b]
        if depth is None or depth not in self.by_depth:
            return pooled
        accepted, trials = self.by_depth[depth]
        return (accepted[b] + self.prior * pooled) / (trials[b] + self.prior)

    def log_acceptance(self, q: torch.Tensor) -> torch.Tensor:
        """``log a(q)`` for per-depth drafter probabilities ``q`` [D, V] (row ``d`` at depth ``d + 1``),
        ties within a bin broken by ``q`` (a vanishing ``1e-3 log q``): ranking by it ranks by
        calibrated acceptance."""
        edges = torch.tensor(Q_EDGES[1:-1], dtype=q.dtype, device=q.device)
        centres = [(lo + hi) / 2 for lo, hi in zip(Q_EDGES[:-1], Q_EDGES[1:])]
        table = torch.tensor([[self.acceptance(c, d + 1) for c in centres] for d in range(q.shape[0])],
                             dtype=q.dtype, device=q.device)
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

    # -- choices -----------------------------------------------------------------------------------
    def best_prefix(self, reach: list[float]) -> int:
        """``B*`` for nodes whose acceptance probabilities, in candidate order, are ``reach``."""
        cost = self.verify_seconds(1) + self.draft_seconds
        best, best_gain, best_cost, gain = 0, 1.0, cost, 1.0
        for b, p in enumerate(reach, start=1):
            gain += p
            cost = self.verify_seconds(b + 1) + self.draft_seconds
            if gain / cost > best_gain / best_cost:
                best, best_gain, best_cost = b, gain, cost
        self._record_choice(best, best_gain, best_cost)
        return best

    def record_plain(self) -> None:
        """A step that did not draft (:class:`DraftSwitch`): one token for a plain step's cost."""
        self._record_choice(0, 1.0, self.verify_seconds(1))

    def _record_choice(self, drafts: int, gain: float, seconds: float) -> None:
        self.chosen.append(drafts)
        self.predicted_tokens += gain
        self.predicted_seconds += seconds
        self._last = (gain, drafts + 1)

    def extend_last(self, extra: list[tuple[float, int]]) -> int:
        """After a choice: how many of the further candidates ``extra`` (in order; each the expected
        tokens it adds and the tokens it adds to the verify forward) to verify as well, by the same
        rate. The last choice's record grows accordingly."""
        gain, size = self._last
        best, best_gain, best_size = 0, gain, size
        for i, (g, n) in enumerate(extra, start=1):
            gain, size = gain + g, size + n
            if gain / (self.verify_seconds(size) + self.draft_seconds) >= \
                    best_gain / (self.verify_seconds(best_size) + self.draft_seconds):  # ties: the longer (shared nodes are free)
                best, best_gain, best_size = i, gain, size
        self.chosen[-1] = best_size - 1
        self.predicted_tokens += best_gain - self._last[0]
        self.predicted_seconds += self.verify_seconds(best_size) - self.verify_seconds(self._last[1])
        self._last = (best_gain, best_size)
        return best

    def causal_length(self, top_q: list[float], horizon: int | None = None) -> int:
        """How many drafts of a chain to verify when draft ``k`` may be chosen from ``top_q[:k]`` only
        (drafts drawn one after another; see the module doc): those before the first that does not pay,
        lengths up to ``horizon`` (default ``len(top_q)``) forecast. Recorded as a step's choice, like
        :meth:`best_prefix`."""
        chain = CausalChain(self, horizon or len(top_q))
        for q in top_q:
            if not chain.offer(q):
                break
        return self.record_causal(chain)

    def record_causal(self, chain: "CausalChain") -> int:
        """Record the choice a :class:`CausalChain` made (its positions already offered); its length."""
        self._record_choice(chain.kept, chain.gain, chain.cost(chain.kept))
        return chain.kept

    def pays_to_include(self, gain: float, reach: float, k: int, horizon: int, cost) -> bool:
        """Whether verifying position ``k`` beats stopping before it, from what is known up to ``k``:
        ``gain`` the expected tokens of positions ``< k`` (bonus tokens included), ``reach`` the expected
        tokens position ``k`` adds (``P_k``, summed over rows), ``cost(m)`` a step's seconds when it
        verifies ``m`` drafts per row. Lengths ``k .. horizon`` are tried (costs are not monotone),
        each further position kept at the rate measured at its depth (:meth:`depth_acceptance`)."""
        stop = gain / cost(k - 1)
        for m in range(k, horizon + 1):
            gain += reach
            if gain / cost(m) > stop:
                return True
            reach *= self.depth_acceptance(m + 1)
        return False

    def depth_acceptance(self, depth: int) -> float:
        """The rate at which drafts at ``depth`` were kept when their parent was, whatever their ``q``
        (shrunk to the rate over all depths with the weight of ``prior`` observations)."""
        if depth not in self._depth_rates:  # cached until the next count
            pooled = sum(self.accepted) / sum(self.trials)
            accepted, trials = self.by_depth.get(depth, ([0.0], [0.0]))
            self._depth_rates[depth] = (sum(accepted) + self.prior * pooled) / (sum(trials) + self.prior)
        return self._depth_rates[depth]

    def chain_reach(self, top_q: list[float]) -> list[float]:
        """The chance that a chain is kept up to each depth ``j``: the product of the calibrated
        acceptances of its top probabilities at depths ``1..j``."""
        return kept_to(self.acceptance(q, depth) for depth, q in enumerate(top_q, start=1))

    def chain_length(self, top_q: list[float]) -> int:
        """How many drafts of a chain to verify, from the drafter's top probability at each position."""
        return self.best_prefix(self.chain_reach(top_q))

    def tree_size(self, node_q: list[float], parents: list[int], depths: list[int]) -> int:
        """How many of a best-first tree's nodes (pop order) to verify; ``parents[i] < i`` (-1: root)."""
        reach: list[float] = []
        for q, parent, depth in zip(node_q, parents, depths):
            reach.append(self.acceptance(q, depth) * (reach[parent] if parent >= 0 else 1.0))
        return self.best_prefix(reach)

    def record_chain(self, top_q: list[float], verified: int, accepted: int, next_outcome: float | None = None) -> None:
        """After a chain step that verified the first ``verified`` of the drafts ranked by ``top_q`` and
        kept ``accepted`` of them. Every verified position up to the first miss counts; when all were
        kept, the first unverified one counts too, with ``next_outcome``: whether (T = 0), or with what
        probability (T > 0), the target would have kept it -- its logits there come with the step, so
        a budget that verified nothing still learns whether it should have."""
        for k, q in enumerate(top_q[:min(accepted + 1, verified)]):
            self.count(q, float(k < accepted), k + 1)
        if accepted == verified < len(top_q) and next_outcome is not None:
            self.count(top_q[verified], next_outcome, verified + 1)

    def record_tree(self, node_q: list[float], parents: list[int], depths: list[int], path: list[int], verified: int,
                    unverified: dict[int, float] | None = None) -> None:
        """After a tree walk over the first ``verified`` nodes: ``path`` the accepted ones as indices into
        [root, nodes] (root = 0). Verified nodes whose parent was accepted count, kept or not; so do
        the unverified nodes in ``unverified`` (node -> whether, or with what probability, the target
        would have kept it: its logits after the path come with the step)."""
        on_path = set(path)
        for i, (q, parent) in enumerate(zip(node_q[:verified], parents[:verified])):
            if parent + 1 in on_path:
                self.count(q, float(i + 1 in on_path), depths[i])
        for i, outcome in (unverified or {}).items():
            self.count(node_q[i], outcome, depths[i])

    def summary(self) -> dict:
        steps = max(1, len(self.chosen))
        verified = [1 + b for b in self.chosen]
        return {"mean_verified": round(sum(verified) / steps, 3),
                "verified_histogram": {str(n): verified.count(n) for n in sorted(set(verified))},
                "predicted": {"tau": round(self.predicted_tokens / steps, 4),  # what the choices expected
                              "step_ms": round(1e3 * self.predicted_seconds / steps, 3),
                              "tokens_per_s": round(self.predicted_tokens / max(self.predicted_seconds, 1e-12), 2)},
                "verify_ms": {str(n): round(s * 1e3, 3) for n, s in zip(self.sizes, self.seconds)},  # JSON keys
                "verify_offset_ms": round(self.verify_offset * 1e3, 3),
                "draft_ms": round(self.draft_seconds * 1e3, 3),
                **({"switch": self.switch.summary()} if self.switch.skipped else {}),
                **({"draft_forward_ms": round(self.token_seconds * 1e3, 3)} if self.forwards_seen else {}),
                "calibration": [{"q": [lo, hi], "acceptance": round(a / t, 4), "seen": int(t - self.prior)}
                                for lo, hi, a, t in zip(Q_EDGES[:-1], Q_EDGES[1:], self.accepted, self.trials)]}


class CausalChain:
    """:meth:`Budget.causal_length` one position at a time: :meth:`offer` each position's top ``q`` (one
    per row) in order; it answers whether that position is verified, from it and the earlier ones
    alone. An autoregressive drafter asks after each distribution and stops drafting at the first no;
    the batch scheduler offers every row's ``q`` at once, with its batched ``cost``."""

    def __init__(self, budget: Budget, horizon: int, cost=None, rows: int = 1):
        self.budget, self.horizon = budget, horizon
        self.cost = cost or (lambda m: budget.verify_seconds(m + 1) + budget.draft_cost(m, horizon))
        self.reach = [1.0] * rows  # each row's P of the last verified position
        self.gain, self.kept, self.open = float(rows), 0, True

    def offer(self, *qs: float) -> bool:
        if not self.open:
            return False
        depth = self.kept + 1
        reach = [r * self.budget.acceptance(q, depth) for r, q in zip(self.reach, qs)]
        self.open = self.budget.pays_to_include(self.gain, sum(reach), depth, self.horizon, self.cost)
        if self.open:
            self.gain, self.reach, self.kept = self.gain + sum(reach), reach, depth
        return self.open


class Probes:
    """When a loop that stopped drafting drafts again to see whether it should: after ``first`` plain
    steps, then, while the probes keep saying drafting does not pay, after twice as many (up to
    ``limit``); a probe that pays resets the wait (Nightjar's off switch)."""

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
    """Drafted steps taken in one state: running sums (forgetting old steps) of tokens, seconds,
    steps and of the steps that kept a draft, and how many steps were seen in all."""

    FORGET = 0.995  # the sums cover the last few hundred steps

    def __init__(self):
        self.tokens = self.seconds = self.steps = self.hits = 0.0
        self.seen = 0

    def add(self, kept: int, seconds: float) -> None:
        f = self.FORGET
        self.tokens, self.seconds = f * self.tokens + kept + 1, f * self.seconds + seconds
        self.steps, self.hits = f * self.steps + 1, f * self.hits + (kept > 0)
        self.seen += 1

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)


class DraftSwitch:
    """Whether a one-row step drafts at all, from the tokens per second that drafted steps measured
    against what plain steps measured in the same loop (Nightjar's off switch), with
    :class:`Probes` now and then while it is off. It decides from earlier steps only: lossless at
    every temperature.

    Acceptance runs in streaks, so drafted steps are counted apart in two states: after a step that
    kept a draft (``H``) and after one that did not, or did not draft (``M``). In ``H`` a step drafts
    while ``H``'s own rate beats the plain rate. In ``M`` that comparison is short-sighted: a draft
    that hits also takes the loop back to ``H``, and a plain step never does. The rate of drafting
    from ``M`` on is that of the renewal cycle it starts -- one step in ``M``, then ``H`` steps until
    the next miss, ``p_MH / p_HM`` of them on average (``p_MH``: the share of ``M``'s drafts that kept
    one; ``p_HM``: of ``H``'s, that kept none):

        r_M = (tok_M + (p_MH / p_HM) tok_H) / (sec_M + (p_MH / p_HM) sec_H)

    with per-step means of tokens and seconds in each state (the stationary rate of always drafting).
    A stretch of text the drafter cannot follow has ``p_MH`` near 0, so ``r_M`` falls to ``M``'s own
    rate and the loop decodes plainly until a probe hits.

    Until the loop has run plain steps their cost is ``plain_seconds`` (a bare target forward, an
    optimistic reference); the first time drafting falls below it, ``measure`` plain steps are run
    to measure them. Their cost is the median of the last ``PLAIN_WINDOW`` plain steps: one step that
    stalls (the first plain step of an eval once took 203 ms against 4.6 for the others) would hold a
    mean up for a hundred steps, and with it a drafter that runs below plain decoding drafting (a 0.9M
    assistant kept drafting against a plain reference read as 61-68 tokens/s where plain decoding ran
    195-208)."""

    PLAIN_WINDOW = 16

    def __init__(self, plain_seconds: float, min_drafts: int = 16, measure: int = 3, margin: float = 1.0,
                 probes: Probes | None = None):
        self.min_drafts, self.measure = min_drafts, measure
        # skip below this fraction of the plain rate. Both rates are running means over ~200 steps, steady
        # enough to compare as they are; 0.9 kept a drafter that ran at 0.85-0.95x plain decoding drafting
        # once a prepacked target made verifying two tokens cost about one (serve_eval.cpu.prepack)
        self.margin = margin
        self.bare_seconds = plain_seconds
        # the last plain steps' seconds (at least `measure` of them, which should_draft counts)
        self.plain: collections.deque[float] = collections.deque(maxlen=max(self.PLAIN_WINDOW, measure))
        self.stats = {True: _Drafted(), False: _Drafted()}  # H (the last step kept a draft) and M
        self.hit = True
        self.probes = probes or Probes()
        self.skipped = 0

    @property
    def plain_rate(self) -> float:
        return 1 / (statistics.median(self.plain) if self.plain else self.bare_seconds)

    def drafting_rate(self, hit: bool) -> float:
        """Tokens per second of drafting from state ``hit`` on (see the class doc)."""
        h, m = self.stats[True], self.stats[False]
        if hit or not h.steps or not m.steps:
            return self.stats[hit].rate
        p_mh, p_hm = m.hits / m.steps, 1 - h.hits / h.steps
        w = p_mh / max(p_hm, 1e-3)  # H steps per M step of the cycle
        return (m.tokens / m.steps + w * h.tokens / h.steps) / (m.seconds / m.steps + w * h.seconds / h.steps)

    def should_draft(self) -> bool:
        measuring = 0 < len(self.plain) < self.measure
        if not measuring and (self.stats[self.hit].seen < self.min_drafts or self.probes.due()
                              or self.drafting_rate(self.hit) > self.margin * self.plain_rate):
            return True
        self.probes.skipped()
        self.skipped += 1
        return False

    def record(self, drafted: bool, kept: int, seconds: float) -> None:
        """A step that drafted (or not) kept ``kept`` drafts and took ``seconds`` (drafting included)."""
        if drafted:
            cell = self.stats[self.hit]
            cell.add(kept, seconds)
            if cell.seen >= self.min_drafts:
                self.probes.drafted(self.drafting_rate(self.hit) > self.plain_rate)
        else:
            self.plain.append(seconds)
        self.hit = kept > 0

    def summary(self) -> dict:
        return {"skipped_steps": self.skipped,
                "drafted_tokens_per_s": {("after a kept draft" if h else "after a miss"): round(self.stats[h].rate, 2)
                                         for h in (True, False) if self.stats[h].seen},
                "drafting_from_a_miss_tokens_per_s": round(self.drafting_rate(False), 2),
                "plain_tokens_per_s": round(self.plain_rate, 2)}
