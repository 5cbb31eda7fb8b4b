"""Speculative decoding of several prompts at once, and batched plain decoding of the same target.

Rows. Each prompt is a row of one batched forward. Rows keep different numbers of drafts, so their
lengths drift apart. Row ``i`` holds its tokens at the first ``lengths[i]`` slots of the target's KV
cache: a step writes each row's ``n`` tokens after its own length (:mod:`serve_eval.kv`'s per-row
writes), the row keeps as many as it accepts, and the next step writes over the rest. A row attends
to its own slots only (a mask per row: ``slot <= lengths[i] + j`` for its ``j``-th token), and its
positions (RoPE) are its own, so a row computes exactly what it would alone; attention reads up to
the longest row, with no holes to skip. Rows that finish (``max_new_tokens`` or EOS) leave the
batch, and with ``slots`` (fewer rows at a time than prompts) a waiting prompt takes the place, so
the batch keeps ``slots`` rows busy instead of running at the pace of its slowest row (continuous
batching, as serving engines do). Waiting prompts are prefilled a group of ``slots`` at a time, ahead
of need (:class:`Waiting`: one prompt prefilled alone as each row finishes costs about twice as much),
and a prompt takes a finished row's place in place: its entries are copied over that row's slots
(:meth:`BatchTarget.put`) and nothing else of the batch's caches moves. The drafter's context
(target features of each row's verified tokens) is kept the same way, per row and right-padded, so a
block anchored at row ``i``'s length sees exactly row ``i``'s context
(:func:`drafters.masks.block_attention_mask`).

A step. The drafter drafts ``K - 1`` tokens for every row in one batched block forward (one compiled
graph that also reads the last step's features, where the draft is compiled for this many rows:
:mod:`serve_eval.cpu.compiled`; eager otherwise, the features appended to the context first); the scheduler
picks each row's ``n_i`` (row ``i`` reads its bonus and its first ``n_i - 1`` drafts; rows that read
fewer are padded to the longest with their next drafts, which the target's Linears skip and whose
queries attend to one slot: :meth:`BatchTarget.step`); each row verifies its own drafts, greedily or
by speculative sampling with its own generator (:mod:`serve_eval.sampling`): lossless per row, as in
:mod:`serve_eval.engine`. With ``R`` rows the choice maximises expected tokens per second,

    n* = argmax_{n_1..n_R}  (R + sum_i sum_{j < n_i} P_i,j) / (c(sum_i n_i) + pad + d_R),

``P`` from the calibrated acceptance of :class:`~serve_eval.budget.Budget` (the drafter's top
probability per position, never a drawn token's; a row's ``P_i,j`` falls with ``j``, so taking the
row-depths in order of ``P`` and keeping the best prefix of that order finds the best), ``pad`` ``PADDING_COST``
of what the padding would cost as tokens (DSpark's verification length per row; sampled drafts drawn
one after another take one ``n`` for every row), ``c`` the measured cost of a batched step
(before a batch size runs, :func:`measure_step_seconds` times its steps over ``n = 1..K`` tokens a
row and a plain step, in interleaved rounds, so that drafted and plain steps are compared on one
measurement; for fewer rows, as rows finish, the one-row cost of ``R n`` tokens scaled by the same ratios) and
``d_R`` the measured drafting cost at ``R`` rows. Where speculation stops paying (large batches on a compute-bound
CPU) the scheduler also stops drafting: while the best rate its calibration predicts is below plain
decoding's, or the loop's own steps measured otherwise (drafted steps' row tokens per second against
plain steps', after 8 drafted steps at that many rows and, where those fall below a bare plain step,
3 plain steps run to compare: the prediction is optimistic by 10-60%), steps read the bonus only and
the drafter just reads the new features, with a drafted probe step now and then (after 8, 16, 32, 64
plain steps) to notice when that changes (Nightjar's off switch; it acts only after 8 drafted steps,
once the calibration has seen some). With a calibration lent by a one-row run, a batch size is also
judged before it starts: if a typical row at the acceptance measured at each depth, with the
drafting cost measured at that many rows (:func:`measure_draft_seconds`), is not predicted at least
``UP_FRONT_MARGIN`` (1.1) times as fast as plain decoding (``TAIL_MARGIN``, 1.6, where fewer than
``TAIL_WAVES`` (4) waves of prompts pass through the slots, so that the last wave's tail of rows
finishing apart is much of the run, or where rows are sampled), that batch size runs plain decoding outright (no drafts, no feature capture, no probes: vLLM's disable-by-batch-size,
from measured costs). Every choice uses earlier steps and this step's drafter outputs only: lossless.

With ``lookup``, a row may verify its prompt-lookup copy (:mod:`serve_eval.lookup`) instead of its
drafts, where copies' own calibration expects more of it than the drafts' does (a chain either way:
a copy grafted on as a second branch, as one row does, would make each row a tree whose accepted path
moves in the caches); at T > 0 the copy is a point mass, kept with probability ``p(c)``.

Block drafters (DFlash, DSpark) only; EAGLE-3 and causal-LM drafters decode one row at a time.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distill.base.features import FeatureCapture

from .backend import TORCH, Backend
from .budget import COPY_Q, Budget, CausalChain, Probes, kept_to
from .cpu.compiled import proposal as compiled_proposal
from .engine import _next_outcome, _truncate, interleaved_seconds, measure_verify_costs, verify_sizes
from .kv import InPlaceLayer, KVQuant, RowWrites, inplace_cache, kv_quant
from .lookup import NgramIndex
from .sampling import Sampler, top_tokens, verify_chain


class BatchTarget:
    """The target over a batch of rows: a KV cache in which row ``i`` holds its tokens at its first
    ``lengths[i]`` slots (every row writes at slots of its own, :mod:`serve_eval.kv`), and each row's
    length (its next position). ``kv``: the cache's quantization (:mod:`serve_eval.kv`); ``backend``: how
    the target is served (:mod:`serve_eval.backend`)."""

    def __init__(self, target, capture: FeatureCapture | None = None, kv: KVQuant | None = None,
                 backend: Backend = TORCH):
        self.target, self.kv, self.backend = target, kv, backend
        self.run = backend.target_forward(target, capture)  # its capture: the features the drafter reads
        self.cache = inplace_cache(target.config, kv)
        if not all(isinstance(layer, InPlaceLayer) for layer in self.cache.layers):
            raise ValueError("batched decoding needs a target whose every layer attends to the whole cache "
                             "(no sliding-window layers)")
        self.lengths = torch.zeros(0, dtype=torch.long)  # [R]

    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, logits_at: torch.Tensor | None = None):
        """The forward over ``ids`` [R, n] at ``positions``, each row writing its entries after its own
        ``lengths`` slots, attending to the slots ``mask`` [R, n, slots] allows (``logits_at``: the
        logits at that position of each row only)."""
        write_at = RowWrites(self.lengths.to(ids.device), mask.shape[-1])
        for layer in self.cache.layers:
            layer.write_at = write_at
        logits, features = self.run(ids, positions, mask[:, None], self.cache, logits_at)
        return logits, None if features is None else features.aux

    @torch.inference_mode()
    def prefill(self, prompts: list[torch.Tensor]):
        """Read right-padded prompts: each row's logits after its last prompt token [R, V], and the
        features [R, L, F] (row ``i`` valid up to its length)."""
        lengths = torch.tensor([len(p) for p in prompts])
        L = int(lengths.max())
        device = prompts[0].device
        ids = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = p
        mask = torch.ones(L, L, dtype=torch.bool).tril()[None] & (torch.arange(L) < lengths[:, None])[:, None, :]  # causal, real tokens only
        self.lengths = torch.zeros(len(prompts), dtype=torch.long)
        logits, aux = self._run(ids, torch.arange(L, device=device)[None].expand(len(prompts), L), mask.to(device), lengths - 1)
        self.lengths = lengths
        return logits[:, 0], aux

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, counts: torch.Tensor | None = None):
        """Read ``ids`` [R, n] after each row's tokens: logits [R, n, V] and features. Nothing is kept
        until :meth:`keep`: the next step writes over what this one wrote past the kept tokens. With
        ``counts`` [R], row ``i`` reads its first ``counts[i]`` tokens only: the rest is padding, which
        the target's Linears skip (:func:`~serve_eval.cpu.prepack.only_rows`; 0 there, so every number the
        padding leaves in the caches is finite) and whose logits and features mean nothing. A row's
        tokens attend to none after them, padding included: they get the bits they get alone."""
        R, n = ids.shape
        positions = self.lengths[:, None] + torch.arange(n)
        mask = torch.arange(int(self.lengths.max()) + n)[None, None] <= positions[:, :, None]  # its own tokens, causal
        if counts is None or bool((counts >= n).all()):
            return self._run(ids, positions.to(ids.device), mask.to(ids.device))
        real = torch.arange(n)[None] < counts[:, None]  # [R, n]
        mask &= real[:, :, None]  # padding attends to its row's first slot only: finite, and next to free
        mask[:, :, 0] |= ~real
        with self.backend.skip_rows(real.flatten().nonzero().flatten().to(ids.device), R * n):
            return self._run(ids, positions.to(ids.device), mask.to(ids.device))

    def keep(self, counts: torch.Tensor) -> None:
        """After a step: row ``i`` keeps the first ``counts[i]`` tokens it read."""
        self.lengths = self.lengths + counts

    @torch.inference_mode()
    def put(self, rows: torch.Tensor, other: "BatchTarget", which: torch.Tensor) -> None:
        """Rows ``rows`` start over as ``other``'s rows ``which`` (prompts prefilled apart taking the
        places of rows that finished): their entries are copied over the finished rows' slots, nothing
        else of the batch's cache moves."""
        for layer, theirs in zip(self.cache.layers, other.cache.layers):
            layer.put_rows(rows, theirs, which)
        self.lengths = self.lengths.index_put((rows,), other.lengths[which])

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of the batch."""
        for layer in self.cache.layers:
            layer.batch_select_indices(rows.to(layer.device))
        self.lengths = self.lengths[rows]


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    """``t`` [R, H, C, D] with zeros after its ``C`` positions up to ``size``."""
    return F.pad(t, (0, 0, 0, size - t.shape[2]))


class BatchContext:
    """A block drafter's context keys/values per row, compact and right-padded: row ``i`` holds its
    first ``lengths[i]`` positions. Where the drafter's draft is compiled (:mod:`serve_eval.cpu.compiled`)
    the buffers hold the graph's positions from the start, and :meth:`draft` reads the last step's
    features in the graph's forward."""

    def __init__(self, drafter, backend: Backend = TORCH):
        self.drafter = drafter
        self.compiled = backend.draft_graph(drafter)
        self.capacity = self.compiled.positions if self.compiled else 0  # buffers of this length while they fit
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _size(self, end: int) -> int:
        return self.capacity if end < self.capacity else max(2 * end, 64)

    @torch.inference_mode()
    def append(self, aux: torch.Tensor, counts: torch.Tensor) -> None:
        """Row ``i`` appends the first ``counts[i]`` of ``aux`` [R, m, F] (features of its next positions)."""
        R, m, _ = aux.shape
        if not self.keys:
            self.lengths = torch.zeros(R, dtype=torch.long)
        positions = self.lengths[:, None] + torch.arange(m)
        kv = self.drafter.context_kv(aux, positions.to(aux.device), lean=True)
        end = int(self.lengths.max()) + m
        if not self.keys:
            self.keys = [k.new_zeros(R, k.shape[1], self._size(end), k.shape[3]) for k, _ in kv]
            self.values = [v.new_zeros(R, v.shape[1], self._size(end), v.shape[3]) for _, v in kv]
        elif end > self.keys[0].shape[2]:  # grow by doubling
            self.keys = [_padded(k, self._size(end)) for k in self.keys]
            self.values = [_padded(v, self._size(end)) for v in self.values]
        # every row writes all m entries after its length; those past its new length are never attended
        # (a block sees positions < its anchor only) and the next append overwrites them
        rows, slots = torch.arange(R)[:, None], self.lengths[:, None] + torch.arange(m)
        for (k, v), keys, values in zip(kv, self.keys, self.values):
            keys[rows, :, slots] = k.transpose(1, 2)
            values[rows, :, slots] = v.transpose(1, 2)
        self.lengths = self.lengths + counts

    @torch.inference_mode()
    def draft(self, anchors: torch.Tensor, choose, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's block after its context and the queued features, anchored at ``anchors`` [R, 1]:
        the drafts [R, K-1] and their logits [R, K-1, V] (drawn by ``choose`` over [R, 1, K-1, V]). One
        compiled graph reads the last step's features and the blocks together where it fits
        (:meth:`~serve_eval.cpu.compiled.CompiledDraft.fits`), else the drafter's ``block_hidden`` reads the
        context. Features queued by several steps that did not draft are appended first, in one product
        (so the graph still serves: eagerly the draft took ~1.5-2x the time)."""
        graph, proposal = self.compiled, None
        if len(self.pending) > 1:
            self.flush()
        queued = self.pending[0] if self.pending else (None, torch.zeros_like(self.lengths))
        if graph is not None and graph.fits(
                self.keys, int((self.lengths + queued[1]).max()), 0 if queued[0] is None else queued[0].shape[1]):
            aux = queued[0] if queued[0] is not None else self.keys[0].new_zeros(len(self.lengths), 0, self.drafter.fc.in_features)
            device = aux.device
            hidden, proposal = graph.run(anchors[:, 0], torch.stack([self.lengths, queued[1]], dim=1).to(device), aux,
                                         self.keys, self.values, graph.proposes_for(greedy))
            self.lengths, self.pending = self.lengths + queued[1], []
        else:
            lengths, ctx_kv = self.view()
            hidden = self.drafter.block_hidden(None, anchors, lengths.to(anchors.device)[:, None], ctx_kv)
        drafts, logits, _ = compiled_proposal(self.drafter, hidden, proposal, anchors, choose, greedy)
        return drafts[:, 0], logits[:, 0]

    def defer(self, aux: torch.Tensor, counts: torch.Tensor) -> None:
        """:meth:`append` later, at the next :meth:`flush`: steps that draft nothing only queue their
        features, and a run of steps where every row keeps every slot is appended in one call."""
        self.pending.append((aux, counts))

    @torch.inference_mode()
    def flush(self) -> None:
        run: list[torch.Tensor] = []
        for aux, counts in self.pending + [(None, None)]:
            if aux is not None and bool((counts == aux.shape[1]).all()):
                run.append(aux)
                continue
            if run:
                merged = torch.cat(run, dim=1)
                self.append(merged, torch.full((merged.shape[0],), merged.shape[1], dtype=torch.long))
                run = []
            if aux is not None:
                self.append(aux, counts)
        self.pending = []

    @torch.inference_mode()
    def view(self) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Each row's length [R] and the per-layer keys/values [R, H, C, D] (C the longest row), with
        every queued feature appended first."""
        self.flush()
        C = int(self.lengths.max())
        return self.lengths, [(k[:, :, :C], v[:, :, :C]) for k, v in zip(self.keys, self.values)]

    @torch.inference_mode()
    def start(self, aux: torch.Tensor, lengths: torch.Tensor) -> None:
        """Begin anew with rows whose first ``lengths[i]`` positions have features ``aux`` [R, m, F] (a prefill's)."""
        self.keys, self.values, self.pending = [], [], []
        self.append(aux, lengths)

    @torch.inference_mode()
    def put(self, rows: torch.Tensor, aux: torch.Tensor, lengths: torch.Tensor) -> None:
        """Rows ``rows`` start over with the first ``lengths[i]`` positions of features ``aux``
        [len(rows), m, F] (a prefill's; prompts taking the places of rows that finished). Features still
        queued for the rows' former occupants count as none of the new rows': they are written past the
        new lengths, where the next append writes over them."""
        self.pending = [(queued, counts.index_fill(0, rows, 0)) for queued, counts in self.pending]
        m = aux.shape[1]
        kv = self.drafter.context_kv(aux, torch.arange(m, device=aux.device)[None].expand(len(rows), m), lean=True)
        if m > self.keys[0].shape[2]:
            self.keys = [_padded(k, self._size(m)) for k in self.keys]
            self.values = [_padded(v, self._size(m)) for v in self.values]
        at = rows.to(aux.device)
        for (k, v), keys, values in zip(kv, self.keys, self.values):
            keys[at, :, :m] = k
            values[at, :, :m] = v
        self.lengths = self.lengths.index_put((rows,), lengths)

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        self.pending = [(aux[rows], counts[rows]) for aux, counts in self.pending]
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.lengths = self.lengths[rows]


# A batch size drafts at all only if its steps are predicted this much faster than plain ones. The
# per-step model leaves out what a run pays once or now and then, above all the tail: rows finish
# apart (the testbed's 16 prompts range from tau 2.0 to 6.7 alone) and the last ones step with fewer
# rows, where plain decoding's rows all take the same steps; and it takes a typical row at the one-row
# run's acceptance. Measured on the testbed with every batch size drafting (twelfth session, ten
# runs of 4, 8 and 16 rows): the prediction read 1.12-1.58x the measured speedup; 16 rows predicted 1.40-1.54
# and measured 0.94-1.16x, 8 rows 1.62-1.72 and 1.08-1.26x. How much of a run the tail is depends on
# how many waves of prompts pass through the slots (prompts / slots): the last wave tails off, its
# rows finishing apart, and no per-step rate sees it coming.
# - Fewer than TAIL_WAVES waves keep the largest ratio seen, TAIL_MARGIN: with every prompt in a slot
#   from the start (16 rows, 16 prompts), drafting measured 1.18x plain per step and lost the run,
#   0.81-0.86x; 8 rows (two waves) drafting under the measured rates lost it 0.88x (fourteenth session).
# - With more waves only the last one tails off: below UP_FRONT_MARGIN a batch size gains nothing and
#   saves its feature capture and probes by decoding plainly, above it the loop's own measured rates
#   decide (BatchScheduler._measured_pays). The prediction is noisy: on the panel kernel batch 4 (16
#   prompts, 4 slots) read 1.22-1.83 in eleven runs of one day, where drafting measured 1.17-1.49x
#   (eight runs), and a margin of 1.6 would have decoded it plainly in six of the eleven.
# - Sampled rows keep TAIL_MARGIN too: verifying them runs a softmax per row and position in Python,
#   and a sampled draft is kept less often. At T = 1, batch 4 was predicted 1.27-1.32 (twentieth
#   session) and measured 0.87-1.03x in four runs of three sessions (0.87 and 0.93 with the measured
#   rates turning drafting off after its first steps: the probes and the feature capture cost more
#   than the drafted steps gave).
UP_FRONT_MARGIN, TAIL_MARGIN, TAIL_WAVES = 1.1, 1.6, 4


def up_front_margin(prompts: int, rows: int, sampled: bool) -> float:
    """How much faster than plain decoding a batch size must be predicted before it drafts at all."""
    return UP_FRONT_MARGIN if prompts >= TAIL_WAVES * rows and not sampled else TAIL_MARGIN


MEASURED_DRAFTS, MEASURED_PLAIN = 8, 3  # steps a batch size measures before its measured rates decide
MEASURED_FORGET = 0.98  # the measured rates' running sums forget over ~50 steps (the machine drifts)
MEASURED_MARGIN = 1.1  # drafted steps must measure this much faster than plain ones (the tail, see _measured_pays)
# A row padded to the batch's longest costs this share of what reading those tokens would: the Linears
# skip padding and the attention kernel reads one slot for it, but the norms, RoPE and activations run
# over the padded batch (4 rows, 150 cached tokens, on the eighteenth session's CPU: rows reading
# 1, 1, 1, 8 tokens 8.57 ms, 3 each 7.99, 8 each 13.5; 3, 3, 3, 8: 10.3, 4 each 9.17)
PADDING_COST = 0.2


class BatchScheduler:
    """Chooses ``n`` for each batched step and when to stop drafting (see the module doc)."""

    def __init__(self, budget: Budget, block_size: int, probe_first: int = 8, probe_limit: int = 64,
                 min_drafts: int = 8, step_seconds: dict[int, float] | None = None, rows: int | None = None):
        self.budget, self.K = budget, block_size
        self.step_seconds, self.rows = step_seconds, rows  # measured batched steps: n -> seconds at `rows` rows
        self.scale: dict[bool, float] | None = None  # drafted (True) and plain steps against the one-row table (verify_seconds)
        self.min_drafts = min_drafts  # drafted steps seen before the off switch may act (1: a calibrated budget)
        self.draft_seconds: dict[int, float] = {}  # rows -> running mean of the drafting cost
        self.top_q_mean = [0.0] * (block_size - 1)  # per position, running mean over drafted rows of the top q
        self.drafts_seen = 0
        self.probes = Probes(probe_first, probe_limit)
        self.chosen: list[list[int]] = []  # every step's n of each row (1: no drafts verified)
        self.drafted_steps = 0
        self.off = False  # the up-front prediction turned this batch size off
        self.predicted: float | None = None  # the up-front prediction (predicted_speedup), when one was made
        self.margin: float | None = None  # the margin it was held to (UP_FRONT_MARGIN or TAIL_MARGIN)
        # measured in the loop, per number of rows: drafted (True) and plain steps' row tokens, seconds
        # (running sums that forget slowly) and step count (record)
        self.measured: dict[int, dict[bool, list[float]]] = {}
        self._costs: dict[tuple[int, float], dict[int, float]] = {}  # _step_costs
        self.copied_rows = 0  # row-steps that verified a prompt-lookup copy instead of drafts

    def verify_seconds(self, rows: int, n: int) -> float:
        """A batched step over ``rows`` rows reading ``n`` tokens each: the budget's one-row cost of
        ``rows * n`` tokens, scaled by what batched steps measured at this batch size against it
        (:func:`measure_step_seconds`): for ``n > 1`` the median ratio over ``n`` of the drafted steps to
        the table (a batch's masked attention over its rows' own caches, and the features it captures,
        cost more than one row's forward over as many tokens, by 20-40% on this CPU); for ``n = 1`` (a
        plain step) the ratio of the plain step timed in the same rounds. Both ratios come from one
        interleaved measurement, so that a machine running faster or slower than when the one-row table
        was timed moves drafted and plain steps alike, and their ratio, which every choice reads, stays."""
        return self.tokens_seconds(rows, rows * n)

    def tokens_seconds(self, rows: int, tokens: int) -> float:
        """A batched step over ``rows`` rows reading ``tokens`` tokens in all, however they are spread
        over the rows (a row's padding is skipped by the Linears, whose arithmetic is most of what more
        tokens cost): :meth:`verify_seconds`'s cost of ``tokens / rows`` tokens a row."""
        proxy = self.budget.verify_seconds(tokens)
        if self.step_seconds is None:
            return proxy
        if self.scale is None:  # drafted: one ratio, the median over n (single timings of a busy machine are noisy)
            ratios = sorted(t / self.budget.verify_seconds(self.rows * m) for m, t in self.step_seconds.items() if m > 1)
            plain = self.step_seconds.get(0)  # (a table without it: the one-row table's cost as it is)
            self.scale = {True: ratios[len(ratios) // 2], False: 1.0 if plain is None else plain / self.budget.verify_seconds(self.rows)}
        return proxy * self.scale[tokens > rows]

    def predicted_speedup(self, rows: int) -> float:
        """Before a batch of ``rows`` drafts at all: the best predicted rate of drafted steps against
        plain steps, for a typical row kept at the acceptance measured at each depth (the calibration,
        when lent by a one-row run) and the drafting cost measured at ``rows`` (:func:`measure_draft_seconds`)."""
        reach = kept_to(self.budget.depth_acceptance(depth) for depth in range(1, self.K))
        return self._typical_rate(rows, reach) / (rows / self.verify_seconds(rows, 1))

    def _draft_cost(self, rows: int) -> float:
        return self.draft_seconds.get(rows, max(self.draft_seconds.values(), default=0.0))

    def should_draft(self, rows: int) -> bool:
        """Whether this step drafts: while the acceptance seen so far predicts that drafting beats plain
        decoding and the steps measured so far do not contradict it (:meth:`_measured_pays`), or when a
        probe is due."""
        if self.drafts_seen < self.min_drafts or self.probes.due():
            return True
        if self._measured_pays(rows):  # (the cheap test first: every plain step asks)
            reach = self.budget.chain_reach(self.top_q_mean)  # a typical row under the calibration as it stands now
            if self._typical_rate(rows, reach) > rows / self.verify_seconds(rows, 1):
                return True
        self.probes.skipped()
        return False

    def _measured_pays(self, rows: int) -> bool:
        """What the loop's own steps at ``rows`` rows say (the prediction reads 1.1-1.6x the speedup a
        run measures: it leaves out the drafts' cold caches and the per-row bookkeeping): drafted steps'
        row tokens per second against plain steps'. Until ``MEASURED_DRAFTS`` drafted steps ran, yes;
        then against a bare plain step (the cost table's, an optimistic reference) until drafted steps
        fall below it, and from then on against ``MEASURED_PLAIN`` or more plain steps run for the
        purpose (DraftSwitch's rule for one row, on a batch's rates), in both cases by
        ``MEASURED_MARGIN``: drafted rows drift apart, and the last to finish step with fewer rows
        (a tail that plain decoding, whose rows all take the same steps, does not have)."""
        cells = self.measured.get(rows, {})
        drafted, plain = cells.get(True), cells.get(False)
        if drafted is None or drafted[2] < MEASURED_DRAFTS:
            return True
        rate = drafted[0] / drafted[1] / MEASURED_MARGIN
        if plain is None:
            return rate > rows / self.verify_seconds(rows, 1)  # below the bare step: plain steps follow
        return plain[2] >= MEASURED_PLAIN and rate > plain[0] / plain[1]

    def record(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step over ``rows`` rows that drafted (or not) emitted ``tokens`` in ``seconds`` (its drafting,
        verification and bookkeeping)."""
        cell = self.measured.setdefault(rows, {}).setdefault(drafted, [0.0, 0.0, 0])
        cell[0], cell[1], cell[2] = MEASURED_FORGET * cell[0] + tokens, MEASURED_FORGET * cell[1] + seconds, cell[2] + 1

    def _causal(self, rows: int, top_q: torch.Tensor) -> tuple[int, float]:
        """``n`` and its rate when position ``k`` is chosen from positions ``<= k`` alone (sampled drafts
        drawn one after another; :class:`~serve_eval.budget.CausalChain` over every row)."""
        cost = lambda m: self.verify_seconds(rows, m + 1) + self._draft_cost(rows)  # noqa: E731
        chain = CausalChain(self.budget, self.K - 1, cost, rows)
        for qs in top_q.t().tolist():
            if not chain.offer(*qs):
                break
        return chain.kept + 1, chain.gain / cost(chain.kept)

    def _per_row(self, reaches: list[list[float]]) -> tuple[torch.Tensor, float]:
        """Each row's ``n`` and the step's rate, from the chance that row ``r`` keeps its drafts up to
        depth ``j``, ``reaches[r][j - 1]``: the row-depths ranked most likely kept first (a row's chances
        fall with depth, so every row takes a prefix of its drafts), and the prefix of that ranking with
        the most expected tokens per second (DSpark's verification length per row, from the measured
        cost of the step's tokens and its padding). Python floats: a handful of rows and depths."""
        ranked = [(reach, r) for r, row in enumerate(reaches) for reach in row]
        ranked.sort(key=lambda item: item[0], reverse=True)  # stable: ties keep row-major order
        counts, rate = self._best_prefix(len(reaches), ranked)
        return torch.tensor(counts), rate

    def _typical_rate(self, rows: int, reach: list[float]) -> float:
        """The best rate of a drafted step whose ``rows`` rows each keep their drafts up to depth ``j``
        with chance ``reach[j - 1]``, drafting included: :meth:`_per_row` over identical rows, whose
        ranking takes every row's depth 1, then every row's depth 2, and so on."""
        return self._best_prefix(rows, ((p, r) for p in reach for r in range(rows)))[1]

    def _step_costs(self, rows: int) -> dict[int, float]:
        """A drafted step's cost by its tokens in all (``rows + 1`` to ``rows * K``), computed once per
        number of rows (and verify offset: the table is otherwise fixed)."""
        key = (rows, self.budget.verify_offset)
        if key not in self._costs:
            self._costs[key] = {t: self.tokens_seconds(rows, t) for t in range(rows + 1, rows * self.K + 1)}
        return self._costs[key]

    def _best_prefix(self, rows: int, ranked) -> tuple[list[int], float]:
        """Over the prefixes of ``ranked`` (a row-depth's chance of being kept, its row), best first: the
        rows' ``n`` and the rate of the prefix with the most expected tokens per second (at least one draft)."""
        cost = self._step_costs(rows)
        counts, tokens, longest, gain, draft = [1] * rows, rows, 1, 0.0, self._draft_cost(rows)
        best, best_rate = [1] * rows, 0.0
        for value, r in ranked:
            counts[r] += 1
            tokens, longest, gain = tokens + 1, max(longest, counts[r]), gain + value
            seconds = cost[tokens] + PADDING_COST * (cost[rows * longest] - cost[tokens])  # the rows padded to the longest
            rate = (rows + gain) / (seconds + draft)
            if rate > best_rate:
                best, best_rate = list(counts), rate
        return best, best_rate

    def choose(self, top_q: torch.Tensor, causal: bool = False,
               copies: list[int] | None = None) -> tuple[torch.Tensor, list[bool]]:
        """Each row's ``n`` [R] for a drafted step from the drafter's top probabilities [R, K-1]: the
        same ``n`` for every row when drafts are sampled one after another (DSpark at temperature > 0,
        see :mod:`serve_eval.budget`), each row its own otherwise (:meth:`_per_row`). ``copies``: the
        length of each row's prompt-lookup copy (0: none); a row verifies its copy instead of its drafts
        where the copy's calibrated chances sum higher (more tokens expected; the choice reads
        probabilities and calibrations only, never a drawn token, so sampled rows stay exact), and the
        second list says which rows do (none when drafts are sampled one after another)."""
        rows = top_q.shape[0]
        self.drafts_seen += 1
        weight = max(1 / self.drafts_seen, 0.05)  # a running mean that forgets slowly
        self.top_q_mean = [m + (q - m) * weight for m, q in zip(self.top_q_mean, top_q.mean(0).tolist())]
        plain = self.verify_seconds(rows, 1)
        copied = [False] * rows
        if causal:
            n, rate = self._causal(rows, top_q)
            counts = torch.full((rows,), n, dtype=torch.long)
        else:
            reaches = [self.budget.chain_reach(row) for row in top_q.tolist()]
            for r, length in enumerate(copies or []):
                if length:  # copies' own calibration (shared with the one-row loop's grafts)
                    copy = self.budget.copy_calibration().chain_reach([COPY_Q] * length)
                    if sum(copy) > sum(reaches[r]):
                        reaches[r], copied[r] = copy, True
            counts, rate = self._per_row(reaches)
            if rate <= rows / (plain + self._draft_cost(rows)):  # the drafts, already paid for, would not pay
                counts, copied = torch.ones(rows, dtype=torch.long), [False] * rows
        # drafting pays against plain decoding: keep drafting; else wait longer before the next probe
        self.probes.drafted(rate > rows / plain)
        self.drafted_steps += 1
        self.copied_rows += sum(copied)
        return counts, copied

    def observe_draft(self, rows: int, seconds: float) -> None:
        old = self.draft_seconds.get(rows)
        self.draft_seconds[rows] = seconds if old is None else 0.9 * old + 0.1 * seconds

    def summary(self) -> dict:
        steps = max(1, len(self.chosen))
        measured = {"step_ms": {n: round(t * 1e3, 2) for n, t in self.step_seconds.items()}} if self.step_seconds else {}  # 0: plain
        if self.predicted is not None:
            measured["predicted_speedup"] = round(self.predicted, 4)
        if self.margin is not None:
            measured["up_front_margin"] = self.margin
        rates = {("drafted" if drafted else "plain"): round(cell[0] / cell[1], 2)  # row tokens a second, at the batch size
                 for drafted, cell in self.measured.get(self.rows, {}).items() if cell[1] > 0}
        if rates:
            measured["measured_tokens_per_s"] = rates
        if not self.chosen and self.off:
            return {"off": True, "drafted_fraction": 0.0, **measured}
        per_row = [n for step in self.chosen for n in step]  # a row's tokens verified in a step
        return {**measured, "mean_verified": round(sum(per_row) / max(1, len(per_row)), 3),
                "verified_histogram": {str(n): per_row.count(n) for n in sorted(set(per_row))},
                "drafted_fraction": round(self.drafted_steps / steps, 4),
                **({"copied_fraction": round(self.copied_rows / len(per_row), 4)} if self.copied_rows else {})}


@torch.inference_mode()
def measure_draft_seconds(drafter, rows: int, context: int = 128, repeats: int = 5, backend: Backend = TORCH) -> float:
    """Seconds of one batched greedy draft over ``rows`` rows of ``context`` cached positions, one more
    feature arriving per row, as the batched loop drafts (:meth:`BatchContext.draft`: compiled where it
    fits; the fastest of ``repeats`` after a warm-up, as the cost tables it is weighed against:
    :func:`~serve_eval.engine.interleaved_seconds`' ``least``), on random features: the cost does not
    depend on them. A private generator leaves the caller's RNG alone."""
    device = next(drafter.parameters()).device
    cfg = drafter.config
    gen = torch.Generator().manual_seed(0)
    aux = torch.randn(rows, context + 1, drafter.fc.in_features, generator=gen).to(device)
    cached = BatchContext(drafter, backend)
    cached.append(aux[:, :context], torch.full((rows,), context))
    lengths = cached.lengths
    anchors = torch.randint(0, cfg.vocab_size, (rows, 1), generator=gen).to(device)

    def draft():
        cached.lengths = lengths  # the same context each time: what a draft writes after it is overwritten
        cached.defer(aux[:, context:], torch.ones(rows, dtype=torch.long))
        cached.draft(anchors, lambda x: x.argmax(-1), greedy=True)

    return interleaved_seconds({0: (draft, None)}, repeats, device, least=True)[0]


@torch.inference_mode()
def measure_step_seconds(target, capture: FeatureCapture | None, rows: int, max_n: int, context: int,
                         kv: KVQuant | None = None, repeats: int = 5, backend: Backend = TORCH) -> dict[int, float]:
    """Seconds of a batched target step over ``rows`` rows of ``context`` cached tokens reading ``n``
    tokens each with ``capture``'s features, for ``n = 1..max_n``, and at ``0`` a plain step (one token a
    row, no features: batched plain decoding's). Timed in ``repeats`` rounds after a warm-up round,
    every size once a round (each step undone), so that a machine that drifts moves every size alike;
    the fastest round per size (:func:`~serve_eval.engine.interleaved_seconds`' ``least``). On random
    tokens: the cost does not depend on them."""
    device = next(target.parameters()).device
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab, (context,), generator=gen).to(device) for _ in range(rows)]
    runs = {}
    for plain in (True, False):
        session = BatchTarget(target, None if plain else capture, kv, backend)
        session.prefill(prompts)

        for n in [0] if plain else range(1, max_n + 1):  # (a step keeps nothing: each writes over the last)
            ids = torch.randint(0, vocab, (rows, max(n, 1)), generator=gen).to(device)
            runs[n] = (functools.partial(session.step, ids), None)
    return interleaved_seconds(runs, repeats, device, least=True)


@dataclass
class BatchStats:
    tokens: int = 0
    steps: int = 0  # batched target forwards after the prefill
    row_steps: int = 0  # sum over steps of the rows in the batch
    seconds: float = 0.0


def _finish(outs, eos, max_new, stats, start):
    outs = [_truncate(o, max_new, eos) for o in outs]  # a last step may overshoot; only kept tokens count
    stats.tokens = sum(len(o) for o in outs)
    stats.seconds = time.perf_counter() - start
    return outs, stats


class Waiting:
    """The prompts not yet in the batch, prefilled a group at a time ahead of the rows they will take.

    A group is the next ``slots`` prompts (fewer at the end), read in one forward, their first tokens
    chosen with their own samplers; its rows then wait to take the places of rows that finish. Rows
    of a speculative batch finish apart, and a prompt prefilled alone as each one finishes costs about
    twice what it costs in a group (testbed, 64-token prompts: 78 ms against 39 ms a row in fours)."""

    def __init__(self, target, capture: FeatureCapture | None, kv: KVQuant | None, prompts, samplers, slots: int, outs,
                 backend: Backend = TORCH):
        self.target, self.capture, self.kv, self.backend = target, capture, kv, backend
        self.prompts, self.samplers, self.slots, self.outs = prompts, samplers, slots, outs
        self.queue = list(range(len(prompts)))
        self.group: BatchTarget | None = None  # the last group prefilled, and of its rows:
        self.indices: list[int] = []  # their prompts
        self.first = torch.zeros(0, dtype=torch.long)  # their first tokens
        self.aux: torch.Tensor | None = None  # their features (None without a capture)
        self.ready: list[int] = []  # those not taken yet

    def __bool__(self) -> bool:
        return bool(self.queue or self.ready)

    def take(self, count: int) -> torch.Tensor:
        """Up to ``count`` waiting rows, as row numbers of :attr:`group` (the next group prefilled first
        when the last is used up); :attr:`indices`, :attr:`first` and :attr:`aux` give their prompts,
        first tokens and features."""
        if not self.ready:
            joining = self.queue[:self.slots]
            del self.queue[:len(joining)]
            self.group = BatchTarget(self.target, self.capture, self.kv, self.backend)
            logits, self.aux = self.group.prefill([self.prompts[i] for i in joining])
            self.first = _choose_rows([self.samplers[i] for i in joining], logits).cpu()
            for i, t in zip(joining, self.first.tolist()):
                self.outs[i].append(t)
            self.indices, self.ready = joining, list(range(len(joining)))
        which = torch.tensor(self.ready[:count], dtype=torch.long)
        del self.ready[:count]
        return which


def _refill(waiting: Waiting, live: list[int], bonus: torch.Tensor, session: BatchTarget | None,
            context: "BatchContext | None", max_new: int, eos: int | None):
    """The batch after a step: each finished row's place taken by a waiting prompt (its cache rows
    written over: nothing else of the batch's caches moves), or, with none waiting, the finished rows
    leave; an empty batch starts with a group. ``live``: the rows' prompt indices. Returns the rows,
    their bonus tokens and the target session."""
    outs = waiting.outs
    while True:  # until no finished row can take a waiting prompt (a prompt may be done at its first token)
        done = [r for r, i in enumerate(live) if len(outs[i]) >= max_new or (eos is not None and eos in outs[i])]
        if waiting and not live:  # the batch starts (once: rows leave only when none wait) with a whole group
            which = waiting.take(waiting.slots)
            session = waiting.group
            if context is not None:
                context.start(waiting.aux[which], session.lengths.clone())
            live, bonus = [waiting.indices[w] for w in which.tolist()], waiting.first[which]
        elif waiting and done:
            which = waiting.take(len(done))
            rows = torch.tensor(done[:len(which)], dtype=torch.long)
            session.put(rows, waiting.group, which)
            if context is not None:
                context.put(rows, waiting.aux[which], waiting.group.lengths[which])
            bonus = bonus.index_put((rows,), waiting.first[which])
            for r, w in zip(rows.tolist(), which.tolist()):
                live[r] = waiting.indices[w]
        else:
            break
    if done:
        keep = torch.tensor([r for r in range(len(live)) if r not in done], dtype=torch.long)
        for state in (session, context):
            if state is not None:
                state.select(keep)
        live, bonus = [live[r] for r in keep.tolist()], bonus[keep]
    return live, bonus, session


def _copy(indexes: dict[int, NgramIndex], i: int, prompt: torch.Tensor, out: list[int], length: int) -> list[int]:
    """Prompt ``i``'s lookup copy of up to ``length`` tokens, its n-gram index grown with its new tokens."""
    index = indexes.get(i)
    if index is None:
        index = indexes[i] = NgramIndex(prompt.tolist())
    index.extend(out[len(index.tokens) - len(prompt):])
    return index.continuation(length)


def _choose_rows(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [R, ..., V], each with its row's sampler."""
    if samplers[0].greedy:
        return top_tokens(logits)[0]
    return torch.stack([s.choose(row) for s, row in zip(samplers, logits)])


@torch.inference_mode()
def batched_plain_generate(target, prompts: list[torch.Tensor], max_new_tokens: int, eos_token_id: int | None = None,
                           samplers: list[Sampler] | None = None, kv: KVQuant | None = None, slots: int | None = None,
                           backend: Backend = TORCH):
    """Plain decoding of several prompts at once: at most ``slots`` rows (default: all), rows leave the
    batch when they finish and waiting prompts take their places."""
    samplers = samplers or [Sampler() for _ in prompts]
    start, stats = time.perf_counter(), BatchStats()
    outs, live, bonus, session = [[] for _ in prompts], [], torch.zeros(0, dtype=torch.long), None
    waiting = Waiting(target, None, kv, prompts, samplers, slots or len(prompts), outs, backend)
    while True:
        live, bonus, session = _refill(waiting, live, bonus, session, None, max_new_tokens, eos_token_id)
        if not live:
            return _finish(outs, eos_token_id, max_new_tokens, stats, start)
        logits, _ = session.step(bonus[:, None].to(prompts[0].device))
        session.keep(torch.ones(len(live), dtype=torch.long))
        bonus = _choose_rows([samplers[i] for i in live], logits[:, 0]).cpu()
        for i, t in zip(live, bonus.tolist()):
            outs[i].append(t)
        stats.steps += 1
        stats.row_steps += len(live)


@torch.inference_mode()
def batched_speculative_generate(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int,
                                 eos_token_id: int | None = None, samplers: list[Sampler] | None = None,
                                 scheduler: BatchScheduler | None = None, kv: KVQuant | None = None,
                                 slots: int | None = None, lookup: int = 0, backend: Backend = TORCH):
    """Speculative decoding of several prompts at once with a block drafter (see the module doc): at
    most ``slots`` rows (default: all) at a time, waiting prompts taking the places of rows that finish.
    Without a scheduler every step verifies all ``K - 1`` drafts of every row. ``lookup``: a row may
    verify a prompt-lookup copy of up to ``min(lookup, K - 1)`` tokens instead of its drafts (where the
    scheduler expects more of it; without a scheduler, where the copy is ``K - 1`` tokens long)."""
    samplers = samplers or [Sampler() for _ in prompts]
    greedy = samplers[0].greedy
    K = drafter.config.block_size
    start, stats = time.perf_counter(), BatchStats()
    outs, live, bonus, session = [[] for _ in prompts], [], torch.zeros(0, dtype=torch.long), None
    waiting = Waiting(target, FeatureCapture(target, drafter.config.target_layer_ids), kv, prompts, samplers,
                      slots or len(prompts), outs, backend)
    context = BatchContext(drafter, backend)
    indexes: dict[int, NgramIndex] = {}  # prompt -> its text's n-grams (lookup)
    while True:
        live, bonus, session = _refill(waiting, live, bonus, session, context, max_new_tokens, eos_token_id)
        if not live:
            return _finish(outs, eos_token_id, max_new_tokens, stats, start)
        R = len(live)
        row_samplers = [samplers[i] for i in live]
        t0 = time.perf_counter()
        counts, drafts = torch.ones(R, dtype=torch.long), None  # tokens each row reads: its bonus and its first drafts
        copied = [False] * R  # rows that read a prompt-lookup copy instead
        if scheduler is None or scheduler.should_draft(R):
            anchors = bonus.to(next(drafter.parameters()).device)[:, None]
            choose = lambda x: _choose_rows(row_samplers, x)  # noqa: B023, E731  (called within the iteration)
            drafts, draft_logits = context.draft(anchors, choose, greedy)  # [R, K-1], [R, K-1, V]
            if greedy:  # the top probabilities alone: a greedy verify needs no distribution
                q, top_q = None, top_tokens(draft_logits.float(), with_prob=True)[1]
            else:
                q = torch.stack([s.probs(row) for s, row in zip(row_samplers, draft_logits)])
                top_q = q.amax(-1)
            draft_rows = drafts.tolist()  # one host read, for the copies and the records
            copies = [_copy(indexes, i, prompts[i], outs[i], min(lookup, K - 1)) for i in live] if lookup else []
            if copies and greedy:  # a copy the greedy drafts begin with adds nothing: they go as far or further
                copies = [[] if c == row[:len(c)] else c for c, row in zip(copies, draft_rows)]
            if scheduler is None:
                copied = [len(c) == K - 1 for c in copies] or copied  # (copies as long as the drafts)
                counts = torch.full((R,), K)
            else:
                counts, copied = scheduler.choose(top_q, drafter.conditional_drafts and not greedy, [len(c) for c in copies])
                scheduler.observe_draft(R, time.perf_counter() - t0)
            if any(copied):
                drafts = drafts.cpu().clone()
                for r in (r for r, c in enumerate(copied) if c):
                    drafts[r, :len(copies[r])] = torch.tensor(copies[r])  # (the scheduler reads no further)
        lengths = counts.tolist()
        n = max(lengths)  # rows that read fewer tokens are padded with their next drafts
        ids = bonus[:, None] if n == 1 else torch.cat([bonus[:, None], drafts[:, :n - 1].cpu()], dim=1)
        logits, aux = session.step(ids.to(prompts[0].device), counts)
        if greedy:
            choice = top_tokens(logits)[0].cpu()  # [R, n]
            kept = (ids[:, 1:] == choice[:, :-1]).int().cumprod(1).sum(1).minimum(counts - 1) if n > 1 else torch.zeros(R, dtype=torch.long)
            new_bonus = choice[torch.arange(R), kept]
        else:
            kept_list, bonus_list = [], []
            for r, m in enumerate(lengths):  # a copy is a point mass: no drafter distribution
                k, b = verify_chain(row_samplers[r], ids[r, 1:m], None if copied[r] or m == 1 else draft_logits[r, :m - 1], logits[r, :m])
                kept_list.append(k)
                bonus_list.append(int(b))
            kept, new_bonus = torch.tensor(kept_list), torch.tensor(bonus_list)
        kept_rows, bonus_rows = kept.tolist(), new_bonus.tolist()  # one host read each for the step's bookkeeping
        if scheduler is not None:
            scheduler.chosen.append(lengths)
            if drafts is not None:
                top_rows = top_q.tolist()  # (draft_rows: the drafts as drawn, copies not in; copied rows skip them)
                for r, m in enumerate(lengths):
                    if copied[r]:  # the copies' calibration; all kept: whether the next copied token is the target's
                        following = float(copies[r][m - 1] == bonus_rows[r]) if m - 1 < len(copies[r]) else None
                        scheduler.budget.lookup.record_chain([COPY_Q] * len(copies[r]), m - 1, kept_rows[r], following)
                        continue
                    outcome = _next_outcome(row_samplers[r], draft_rows[r], None if q is None else q[r], logits[r], m - 1,
                                            kept_rows[r], bonus_rows[r])
                    scheduler.budget.record_chain(top_rows[r], m - 1, kept_rows[r], outcome)
        session.keep(kept + 1)
        context.defer(aux, kept + 1)
        for r, i in enumerate(live):
            outs[i].extend(ids[r, 1:1 + kept_rows[r]].tolist() + [bonus_rows[r]])
        if scheduler is not None:
            scheduler.record(R, drafts is not None, sum(kept_rows) + R, time.perf_counter() - t0)
        bonus = new_bonus
        stats.steps += 1
        stats.row_steps += R



def measure_batches(target, drafter, encoded, dec, eos, sampler, batch_sizes: list[int],
                    calibration: Budget | None = None, backend: Backend = TORCH) -> list[dict]:
    """Batched plain and batched speculative decoding of all the prompts, in the order plain, speculative,
    speculative, plain (``dec.batches.rounds`` times), for each batch size ``B``: at most ``B`` rows at a time, waiting prompts taking the places of rows that finish
    (``sampler(i)``: prompt i's sampler, the same seeds for both loops). One acceptance
    calibration (``calibration``'s, when given: e.g. that of a one-row run of the same drafter, which
    learns on every step, where a batch scheduler that stops drafting learns only from its probes)
    and one cost table serve every batch size; each has its own scheduler."""
    K = drafter.config.block_size
    kv = kv_quant(dec.kv.format, dec.kv.rotate)
    budget = None
    if dec.budget.adaptive:
        capture = FeatureCapture(target, drafter.config.target_layer_ids)
        budget = Budget(measure_verify_costs(target, verify_sizes(max(batch_sizes) * K), capture, kv=kv, backend=backend),
                        share=calibration)
    rows = []
    prompts, samplers = list(encoded), lambda: [sampler(i) for i in range(len(encoded))]  # noqa: E731
    for B in batch_sizes:
        # a calibration lent by a one-row run is trusted from the first drafted step on
        scheduler = None
        if budget is not None:  # the batched step's own cost at this size, over a cache about the mean's length
            # the mean prompt and three quarters of the answer: attention reads up to the longest row
            context = sum(map(len, prompts)) // len(prompts) + dec.max_new_tokens * 3 // 4
            steps = measure_step_seconds(target, capture, B, K, context, kv, backend=backend)
            scheduler = BatchScheduler(budget, K, min_drafts=1 if calibration else 8, step_seconds=steps, rows=B)
            scheduler.draft_seconds[B] = measure_draft_seconds(drafter, B, backend=backend)
            scheduler.predicted = scheduler.predicted_speedup(B)
            if calibration is not None:  # a calibrated prediction: below the margin drafting would not pay here
                scheduler.margin = up_front_margin(len(prompts), B, sampled=dec.temperature > 0)
                scheduler.off = scheduler.predicted < scheduler.margin
        def plain(B=B):
            return batched_plain_generate(target, prompts, dec.max_new_tokens, eos, samplers(), kv, slots=B, backend=backend)

        def speculative(B=B, scheduler=scheduler):
            if scheduler is not None and scheduler.off:  # speculation off: the loop is plain decoding
                return plain()
            return batched_speculative_generate(target, drafter, prompts, dec.max_new_tokens, eos, samplers(), scheduler, kv,
                                                slots=B, lookup=dec.lookup.tokens, backend=backend)

        # plain, speculative, speculative, plain (each round): a machine that drifts (these do) shifts both sides alike
        graph = backend.draft_graph(drafter)
        graph_before = graph.calls if graph else 0
        outs, spec, base = [], [], []  # every run's tokens; speculative and plain runs' stats in time order
        for _ in range(dec.batches.rounds):
            for kind, run in (("plain", plain), ("spec", speculative), ("spec", speculative), ("plain", plain)):
                out, run_stats = run()
                outs.append(out)
                (spec if kind == "spec" else base).append(run_stats)
        tokens_per_s = sum(s.tokens for s in spec) / sum(s.seconds for s in spec)
        baseline = sum(s.tokens for s in base) / sum(s.seconds for s in base)
        # half k pairs speculative run k with the plain run on its side of the round (first with first)
        halves = [(s.tokens / s.seconds) / (b.tokens / b.seconds) for s, b in zip(spec, base)]
        rows.append({"batch": B, "prompts": len(prompts), "rounds": dec.batches.rounds,
                     "tau": round(sum(s.tokens for s in spec) / sum(s.row_steps + len(prompts) for s in spec), 4),  # each prefill reads its row once
                     "tokens_per_s": round(tokens_per_s, 2), "baseline_tokens_per_s": round(baseline, 2),
                     "speedup": round(tokens_per_s / baseline, 4),
                     "speedup_halves": [round(h, 4) for h in halves],
                     "lossless": all(o == outs[0] for o in outs) if dec.temperature == 0 else None,
                     "scheduler": None if scheduler is None else scheduler.summary(),
                     **({"graph_drafts": graph.calls - graph_before} if graph else {})})  # drafts the compiled graph made
    return rows
