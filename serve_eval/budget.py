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
used as measured: they are not monotone (see :class:`Budget`).

``P_i`` is the product, along the node's path, of the *calibrated* acceptance ``a(q)`` of each of its
tokens, ``q`` the drafter's probability of that token given its parent: the rate at which tokens the
drafter gave about ``q`` were accepted when their parent was, counted in bins of ``q`` as decoding
runs and starting from ``a(q) = q`` with the weight of ``prior`` observations. (At temperature 0 a
drafter trained towards the target's distribution is under-confident: a token it gives 0.3 is the
target's argmax about half the time. The counts correct that for the drafter at hand.)

Lossless. ``B*`` depends on the drafter's distributions and on earlier steps only, never on the
target's logits for this step nor on the value of a sampled draft: a chain ranks position ``k`` by
the drafter's *top* probability there, not by the probability of the token it drew, so a kept draft
is still distributed as ``q`` and speculative sampling stays exact; at temperature 0 the emitted
tokens are the target's greedy ones whatever is verified. Trees are built best-first by ``log a(q)``,
from ``q`` and earlier steps alone, so their ``P_i`` come out in the order they are popped.
"""

from __future__ import annotations

import bisect

import torch

#: bin edges over the drafter's probability q; fine near 0, where most tree nodes sit
Q_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0)


class Budget:
    """Chooses how many drafts (chain) or tree nodes (tree) each step verifies; see the module doc."""

    def __init__(self, verify_costs: dict[int, float], prior: float = 4.0, share: "Budget | None" = None):
        if 1 not in verify_costs:
            raise ValueError("verify_costs must include n = 1 (a plain decoding step)")
        self.sizes = sorted(verify_costs)
        # used as measured, not smoothed to be non-decreasing: small-matrix kernels make some sizes
        # cheaper than the size below them (on this CPU 4 tokens cost less than 3, 8 less than 7), and
        # the argmax below then never verifies 3 tokens when it could verify 4
        self.seconds = [verify_costs[n] for n in self.sizes]
        self.draft_seconds = 0.0  # running mean of the measured draft cost
        self.drafts_seen = 0
        centres = [(lo + hi) / 2 for lo, hi in zip(Q_EDGES[:-1], Q_EDGES[1:])]
        self.prior = prior
        self.accepted = [prior * c for c in centres]  # pooled over depths
        self.trials = [prior] * len(centres)
        self.by_depth: dict[int, tuple[list[float], list[float]]] = {}  # depth -> (accepted, trials) per bin
        if share is not None:  # one acceptance calibration for budgets of different costs (batch sizes)
            self.prior, self.accepted, self.trials, self.by_depth = share.prior, share.accepted, share.trials, share.by_depth
        self.chosen: list[int] = []  # B* of every step, for the report
        self.predicted_tokens = 0.0  # sums over steps of the expected tokens and seconds of each choice
        self.predicted_seconds = 0.0
        self._last = (1.0, 1)  # expected tokens and verify size of the last choice
        self.lookup = None  # a Budget calibrating grafted prompt-lookup tokens per depth (serve_eval.lookup)

    # -- costs -------------------------------------------------------------------------------------
    def verify_seconds(self, n: int) -> float:
        """``c(n)``, linear between measured sizes (and beyond the largest, at its last slope)."""
        sizes, secs = self.sizes, self.seconds
        if len(sizes) == 1:
            return secs[0]
        i = min(max(bisect.bisect_left(sizes, n), 1), len(sizes) - 1)
        lo, hi = sizes[i - 1], sizes[i]
        return secs[i - 1] + (secs[i] - secs[i - 1]) * (n - lo) / (hi - lo)

    def observe_draft(self, seconds: float) -> None:
        self.drafts_seen += 1
        self.draft_seconds += (seconds - self.draft_seconds) / self.drafts_seen

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
        self.chosen.append(best)
        self.predicted_tokens += best_gain
        self.predicted_seconds += best_cost
        self._last = (best_gain, best + 1)
        return best

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

    def chain_length(self, top_q: list[float]) -> int:
        """How many drafts of a chain to verify, from the drafter's top probability at each position."""
        reach, p = [], 1.0
        for depth, q in enumerate(top_q, start=1):
            p *= self.acceptance(q, depth)
            reach.append(p)
        return self.best_prefix(reach)

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
                "draft_ms": round(self.draft_seconds * 1e3, 3),
                "calibration": [{"q": [lo, hi], "acceptance": round(a / t, 4), "seen": int(t - self.prior)}
                                for lo, hi, a, t in zip(Q_EDGES[:-1], Q_EDGES[1:], self.accepted, self.trials)]}
