"""The decoding loop: plain and speculative decoding of R rows at once; one prompt is a batch of one.

One step, for each row with ``b`` its bonus (the target's newest token, not yet read) at position ``a``:

1. **Draft.** The proposer (:mod:`serve_eval.proposers`) drafts after every row's bonus; with
   ``lookup`` each row's prompt-lookup copy is grafted on (:mod:`serve_eval.lookup`).
2. **Choose.** With a :class:`~serve_eval.budget.Budget` the step verifies the prefix of each row's
   drafts (chain) or best-first tree (``mode="tree"``) that measured costs and measured acceptance say
   pays, or no drafts at all where its off switch says drafting does not pay; without one, every draft
   (or a fixed ``verify_drafts`` of a chain's).
3. **Verify.** One target forward over every row's bonus and chosen drafts (rows padded to the
   longest; a tree per row masked to its ancestors: :mod:`serve_eval.session`); each row keeps the
   longest prefix (chain) or path (tree) the target agrees with, greedily or by speculative sampling
   with its own sampler, and the target's own next token as its new bonus (:mod:`serve_eval.verify`).
4. **Keep.** The target's cache keeps each row's accepted tokens; the proposer observes them (and
   their target features).

Lossless by construction: every choice reads the proposer's distributions and earlier steps only, so
at T = 0 each row emits exactly plain greedy decoding's tokens and at T > 0 samples the target's
distribution (tested for every drafter kind, chains and trees, one row and batches, every target family).

Rows finish apart (``max_new_tokens`` or EOS); with ``slots`` fewer than the prompts, waiting prompts
take finished rows' places (continuous batching), prefilled a group of ``slots`` at a time ahead of need.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from distill.base.decoding import static_unsupported
from distill.base.features import FeatureCapture

from .backend import TORCH, Backend
from .budget import COPY_Q, Budget, CausalChain
from .kv import KVQuant
from .lookup import graft
from .proposers import BlockProposer, Eagle3Proposer, LookupProposer, Proposer, make_proposer
from .sampling import Sampler
from .session import TargetSession
from .static import serves, static_generate
from .timing import device_clock
from .tree import DraftTree, build_best_first_tree, sample_tree
from .verify import choose_rows, next_outcome, unverified_outcomes, verify_chains, walk_trees

MODES = ("chain", "tree")


@dataclass
class GenerationStats:
    """One prompt's decoding."""

    tokens: int = 0
    target_forwards: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # drafts accepted at position k
    drafted_by_position: list[int] = field(default_factory=list)  # drafts verified at position k
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward (bonus included)."""
        return self.tokens / max(1, self.target_forwards)

    def count_step(self, drafts: int, accepted: int) -> None:
        """A step that verified ``drafts`` drafts and accepted the first ``accepted``: positions up to the
        first miss count as verified."""
        for k in range(min(drafts, len(self.drafted_by_position))):
            self.drafted_by_position[k] += int(k <= accepted)
            self.accepted_by_position[k] += int(k < accepted)


@dataclass
class BatchStats:
    """A run over several prompts: tokens kept, target steps after the prefills, rows summed over those
    steps, seconds, and each prompt's own :class:`GenerationStats`."""

    tokens: int = 0
    steps: int = 0
    row_steps: int = 0
    seconds: float = 0.0
    prompts: list[GenerationStats] = field(default_factory=list)


def truncate(tokens: list[int], max_new_tokens: int, eos) -> list[int]:
    """``tokens`` cut to ``max_new_tokens`` and after the first ``eos`` (a token id, a collection of them,
    or None): a last step may overshoot."""
    tokens = tokens[:max_new_tokens]
    stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    end = next((i for i, t in enumerate(tokens) if t in stops), None)
    return tokens if end is None else tokens[: end + 1]


class Stopper:
    """The ``stop`` an incremental proposer asks after each position of one row's chain
    (:class:`~serve_eval.budget.CausalChain`), timing the drafter forwards between the questions."""

    def __init__(self, budget: Budget, sampler: Sampler, horizon: int, start: float, now=time.perf_counter):
        self.chain, self.sampler, self.now = CausalChain(budget, horizon), sampler, now
        self.top_q: list[float] = []
        self.times = [start]

    def __call__(self, logits: torch.Tensor) -> bool:
        self.times.append(self.now())
        top = (
            self.sampler.top(logits, with_prob=True)[1] if self.sampler.greedy else self.sampler.probs(logits).amax(-1)
        )
        self.top_q.append(float(top.max()))
        return not self.chain.offer(self.top_q[-1])

    def forward_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


class _Rows:
    """The batch's rows (their prompts, bonus tokens and target session) and the prompts waiting for a
    slot, prefilled a group of ``slots`` at a time ahead of the rows they will take (one prompt prefilled
    alone as each row finishes costs about twice as much as in a group)."""

    def __init__(
        self,
        target,
        capture,
        kv,
        backend,
        prompts,
        samplers,
        slots: int,
        outs,
        proposers: list[Proposer],
        max_new: int,
        eos: int | None,
    ):
        self.target, self.capture, self.kv, self.backend = target, capture, kv, backend
        self.max_new, self.eos = max_new, eos
        self.prompts, self.samplers, self.slots, self.outs, self.proposers = prompts, samplers, slots, outs, proposers
        self.queue = list(range(len(prompts)))
        self.session: TargetSession | None = None
        self.live: list[int] = []  # each row's prompt
        self.bonus = torch.zeros(0, dtype=torch.long)
        self.group: TargetSession | None = None  # the last group prefilled, and of its rows:
        self.indices: list[int] = []  # their prompts
        self.first = torch.zeros(0, dtype=torch.long)  # their first tokens
        self.aux: torch.Tensor | None = None  # their features
        self.ready: list[int] = []  # those not taken yet

    def _waiting(self) -> bool:
        return bool(self.queue or self.ready)

    def _take(self, count: int) -> torch.Tensor:
        if not self.ready:
            joining = self.queue[: self.slots]
            del self.queue[: len(joining)]
            self.group = TargetSession(self.target, self.capture, self.kv, self.backend)
            logits, feats = self.group.prefill([self.prompts[i] for i in joining])
            self.aux = None if feats is None else feats.aux
            self.first = choose_rows([self.samplers[i] for i in joining], logits)
            for i, t in zip(joining, self.first.tolist()):
                self.outs[i].append(t)
            self.indices, self.ready = joining, list(range(len(joining)))
        which = torch.tensor(self.ready[:count], dtype=torch.long)
        del self.ready[:count]
        return which

    def _joining(self, which: torch.Tensor):
        prompts = [self.prompts[self.indices[w]] for w in which.tolist()]
        aux = None if self.aux is None else self.aux[which.to(self.aux.device)][:, : max(map(len, prompts))]
        return prompts, aux, self.first[which]

    def refill(self, done: list[int]) -> bool:
        """After a step (``done``: the finished rows): each finished row's place taken by a waiting prompt,
        or, with none waiting, the finished rows leave; an empty batch starts with a group. Whether any
        row is left."""
        while True:  # until no finished row can take a waiting prompt (a prompt may be done at its first token)
            if self._waiting() and not self.live:
                which = self._take(self.slots)
                self.session = self.group
                prompts, aux, first = self._joining(which)
                for proposer in self.proposers:
                    proposer.start(prompts, aux, first)
                self.live, self.bonus = [self.indices[w] for w in which.tolist()], first
            elif self._waiting() and done:
                which = self._take(len(done))
                rows = torch.tensor(done[: len(which)], dtype=torch.long)
                self.session.put(rows, self.group, which)
                prompts, aux, first = self._joining(which)
                for proposer in self.proposers:
                    proposer.put(rows, prompts, aux, first)
                self.bonus = self.bonus.index_put((rows.to(self.bonus.device),), first.to(self.bonus.device))
                for r, w in zip(rows.tolist(), which.tolist()):
                    self.live[r] = self.indices[w]
            else:
                break
            done = [r for r in range(len(self.live)) if self.finished(self.live[r])]
        if done:
            if len(done) == len(self.live):
                self.live = []
                return False
            keep = torch.tensor([r for r in range(len(self.live)) if r not in done], dtype=torch.long)
            self.session.select(keep)
            for proposer in self.proposers:
                proposer.select(keep)
            self.live, self.bonus = [self.live[r] for r in keep.tolist()], self.bonus[keep.to(self.bonus.device)]
        return bool(self.live)

    def finished(self, i: int) -> bool:
        out = self.outs[i]
        return len(out) >= self.max_new or (self.eos is not None and self.eos in out)


@dataclass
class _Row:
    """One row's step: what it verifies and what the calibration learns from it."""

    drafts: torch.Tensor  # the chain verified (its drafts), or all the drafter's drafts (a tree)
    draft_logits: torch.Tensor | None
    tree: DraftTree | None = None  # the tree verified (None: the chain of ``drafts``)
    probs: torch.Tensor | None = None  # the drafter's sampling distributions of a tree's nodes (T > 0)
    top_q: list[float] | None = None  # a chain's top probabilities per position (with a budget)
    q: torch.Tensor | None = None  # a chain's sampling distributions (with a budget, T > 0)
    all_drafts: torch.Tensor | None = None
    keep: int = 0
    full: DraftTree | None = None  # a tree before the budget cut it
    node_q: list | None = None
    parents: list | None = None
    depths: list | None = None
    drafter_nodes: int = 0
    copied: list[int] = field(default_factory=list)
    copied_nodes: list[int] = field(default_factory=list)


@torch.inference_mode()
def generate(
    target,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    samplers: list[Sampler] | None = None,
    proposer: Proposer | None = None,
    *,
    budget: Budget | None = None,
    mode: str = "chain",
    tree_budget: int = 16,
    lookup: int = 0,
    kv: KVQuant | None = None,
    verify_drafts: int = 0,
    slots: int | None = None,
    backend: Backend = TORCH,
) -> tuple[list[list[int]], BatchStats]:
    """Decode ``prompts`` (1-D token tensors), at most ``slots`` rows at a time (default: all), each with its
    own sampler (``samplers``: the same temperature for all), the target's KV cache as ``kv`` says
    (:mod:`serve_eval.kv`) and the target stepped as ``backend`` serves it (:mod:`serve_eval.backend`).
    Without a ``proposer``: plain decoding. With one: speculative decoding (see the module doc) in ``mode``
    chain or tree (``tree_budget`` nodes a row), a ``budget`` choosing each step, ``lookup`` grafting
    prompt-lookup copies of up to that many tokens, ``verify_drafts`` (chains without a budget) verifying
    that many drafts a step. Returns each prompt's tokens and the run's stats."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    samplers = [replace(s, top=backend.top_tokens) for s in samplers or [Sampler() for _ in prompts]]
    if len({s.greedy for s in samplers}) > 1:
        raise ValueError("samplers: every row greedy (temperature 0) or every row sampled, not both")
    if backend.static:
        why = static_unsupported(
            proposer is None
            or isinstance(proposer, (BlockProposer, Eagle3Proposer))
            or (hasattr(proposer, "model") and serves(proposer.model)),
            budget is not None,
            lookup,
            kv is not None,
        )
        if why:
            raise ValueError(f"decoding.backend = 'static': {why}")
        return static_generate(
            target,
            prompts,
            max_new_tokens,
            eos_token_id,
            samplers,
            backend,
            proposer,
            verify_drafts,
            slots,
            tree_budget if mode == "tree" and proposer is not None else 0,
        )
    run = _Run(
        samplers, proposer, budget, mode, tree_budget, verify_drafts, device_clock(prompts[0].device), len(prompts)
    )
    start = run.now()
    capture = (
        FeatureCapture(target, proposer.target_layer_ids) if proposer is not None and proposer.needs_features else None
    )
    copier = LookupProposer(lookup) if lookup and proposer is not None else None
    run.copier = copier
    rows = _Rows(
        target,
        capture,
        kv,
        backend,
        prompts,
        samplers,
        slots or len(prompts),
        run.outs,
        [p for p in (proposer, copier) if p is not None],
        max_new_tokens,
        eos_token_id,
    )
    done: list[int] = []
    while rows.refill(done):
        stats = run.stats
        for i in rows.live:
            stats.prompts[i].target_forwards += 1
        stats.steps += 1
        stats.row_steps += len(rows.live)
        done = run.plain_step(rows) if proposer is None else run.speculative_step(rows)
    seconds = run.now() - start
    outs = run.outs
    for i, out in enumerate(outs):
        outs[i] = truncate(out, max_new_tokens, eos_token_id)
        run.stats.prompts[i].tokens = len(outs[i])
        run.stats.prompts[i].target_forwards += 1  # the prefill
        run.stats.prompts[i].total_seconds = seconds
    run.stats.tokens, run.stats.seconds = sum(map(len, outs)), seconds
    return outs, run.stats


class _Run:
    """One :func:`generate` call's settings, outputs and stats, and its two kinds of step."""

    def __init__(self, samplers, proposer, budget, mode, tree_budget, verify_drafts, now, prompts: int):
        self.samplers, self.proposer, self.budget, self.mode = samplers, proposer, budget, mode
        self.tree_budget, self.verify_drafts, self.now = tree_budget, verify_drafts, now
        self.copier: LookupProposer | None = None
        self.K = proposer.block_size if proposer is not None else 1
        self.outs: list[list[int]] = [[] for _ in range(prompts)]
        self.stats = BatchStats(
            prompts=[
                GenerationStats(accepted_by_position=[0] * (self.K - 1), drafted_by_position=[0] * (self.K - 1))
                for _ in range(prompts)
            ]
        )
        # which choices must be causal (serve_eval.budget): sampled drafts drawn one after another, and one row's
        # autoregressive drafts, which stop where the choice says (several rows draft in full, then choose)
        conditional = proposer is not None and proposer.conditional and not samplers[0].greedy
        self.causal = (conditional or proposer.incremental, conditional) if proposer is not None else (False, False)

    def plain_step(self, rows: _Rows) -> list[int]:
        """Every row reads its bonus; the target's choice after it is the new one. Returns the finished rows."""
        live, R = rows.live, len(rows.live)
        logits, _ = rows.session.step(rows.bonus[:, None])
        rows.session.keep([1] * R)
        rows.bonus = choose_rows([self.samplers[i] for i in live], logits[:, 0])
        for i, t in zip(live, rows.bonus.tolist()):
            self.outs[i].append(t)
        return [r for r, i in enumerate(live) if rows.finished(i)]

    def speculative_step(self, rows: _Rows) -> list[int]:
        """Draft, choose, verify and keep (the module doc), timing the parts for the budget. Returns the
        finished rows."""
        session, live, R, budget, now = rows.session, rows.live, len(rows.live), self.budget, self.now
        samplers = [self.samplers[i] for i in live]
        chain = self.mode == "chain"
        t0 = now()
        drafting = budget is None or not chain or budget.should_draft(R)
        stopper = (
            Stopper(budget, samplers[0], self.K - 1, t0, now)
            if drafting and budget is not None and chain and self.proposer.incremental and R == 1
            else None
        )
        starts = session.row_lengths()  # each row's bonus position
        proposal = self.proposer.propose(rows.bonus, starts, samplers, stopper) if drafting else None
        copies = self.copier.copies() if self.copier is not None and drafting else None
        t1 = now()
        if chain:
            plans = _plan_chains(
                proposal, copies, samplers, budget, self.causal, self.verify_drafts, stopper, self.K, R
            )
        else:
            plans = _plan_trees(proposal, copies, samplers, budget, self.tree_budget)
        step = _tree_step if any(plan.tree is not None for plan in plans) else _chain_step
        reads, logits, paths, new_bonus, accepted, kept_feats = step(session, rows.bonus, plans, samplers)
        rows.bonus = new_bonus
        emitted = [torch.cat([a, new_bonus[r : r + 1]]) for r, a in enumerate(accepted)]
        emitted_lists = [e.tolist() for e in emitted]  # one host read a row for the step's tokens
        if budget is not None:
            _record(budget, plans, samplers, logits, paths, emitted_lists, self.mode)
        for r, i in enumerate(live):
            self.outs[i].extend(emitted_lists[r])
            self.stats.prompts[i].count_step(len(plans[r].drafts), len(accepted[r]))
        done = [r for r, i in enumerate(live) if rows.finished(i)]
        t2 = now()
        if len(done) < R:
            for proposer in rows.proposers:
                proposer.observe(starts, emitted, kept_feats)
        draft_seconds = (t1 - t0) + (now() - t2)
        for i in live:
            self.stats.prompts[i].draft_seconds += draft_seconds
            self.stats.prompts[i].verify_seconds += t2 - t1
        if budget is not None:
            if R == 1:
                budget.costs.observe_verify(reads[0], t2 - t1)
            if drafting:
                budget.costs.observe_draft(
                    draft_seconds, stopper.forward_seconds() if stopper is not None else (), rows=R
                )
            if chain:
                budget.record_step(R, drafting, sum(map(len, accepted)), now() - t0)
        return done


def _chain_step(session: TargetSession, bonus: torch.Tensor, plans: list[_Row], samplers: list[Sampler]):
    """Every row reads its bonus and its chain (rows padded to the longest), verifies it and keeps what it
    accepted. Returns the tokens each row read, the logits, each row's path, the new bonus [R], each row's
    accepted drafts and the features of the kept positions (one row: exactly those; several: the step's)."""
    R = len(plans)
    reads = [1 + len(plan.drafts) for plan in plans]
    if R == 1:
        ids = torch.cat([bonus, plans[0].drafts.to(bonus.device)])[None]
    else:
        ids = torch.zeros(R, max(reads), dtype=torch.long, device=bonus.device)
        ids[:, 0] = bonus
        for r, plan in enumerate(plans):
            ids[r, 1 : 1 + len(plan.drafts)] = plan.drafts.to(ids.device)
    logits, feats = session.step(ids, None if len(set(reads)) == 1 else torch.tensor(reads))
    kept, new_bonus = verify_chains(samplers, ids, reads, [plan.draft_logits for plan in plans], logits)
    session.keep([k + 1 for k in kept])
    paths = [list(range(k + 1)) for k in kept]
    accepted = [ids[r, 1 : 1 + k] for r, k in enumerate(kept)]
    kept_feats = None if feats is None else feats.aux[:, : kept[0] + 1] if R == 1 else feats.aux
    return reads, logits, paths, new_bonus, accepted, kept_feats


def _tree_step(session: TargetSession, bonus: torch.Tensor, plans: list[_Row], samplers: list[Sampler]):
    """Every row reads its bonus and its tree (a chain's as a tree of one branch; padded to the step's
    largest, masked to its own ancestors), walks it and keeps its accepted path. Returns as :func:`_chain_step`."""
    R = len(plans)
    trees = [plan.tree if plan.tree is not None else DraftTree.chain(plan.drafts) for plan in plans]
    n = max(len(tree) for tree in trees) + 1
    ids = torch.zeros(R, n, dtype=torch.long, device=bonus.device)
    depths, ancestors = torch.zeros(R, n, dtype=torch.long), torch.zeros(R, n, n, dtype=torch.bool)
    ids[:, 0] = bonus
    for r, tree in enumerate(trees):
        ids[r, 1 : len(tree) + 1] = tree.tokens.to(ids.device)
        depths[r, 1 : len(tree) + 1] = tree.depths
        ancestors[r, : len(tree) + 1, : len(tree) + 1] = tree.ancestor_mask()
    reads = [len(tree) + 1 for tree in trees]
    logits, feats = session.step_tree(ids, depths, ancestors, None if len(set(reads)) == 1 else torch.tensor(reads))
    greedy = samplers[0].greedy
    probs = [
        plan.probs
        if plan.tree is not None
        else (None if greedy or plan.draft_logits is None else samplers[r].probs(plan.draft_logits))
        for r, plan in enumerate(plans)
    ]
    paths, new_bonus = walk_trees(samplers, trees, logits, probs)
    session.keep_paths(paths)
    accepted = [ids[r, path[1:]] for r, path in enumerate(paths)]
    if feats is None:
        kept_feats = None
    elif R == 1:
        kept_feats = feats.aux[:, paths[0]]
    else:
        width = max(map(len, paths))
        index = torch.tensor([p + [0] * (width - len(p)) for p in paths], device=feats.aux.device)
        kept_feats = feats.aux[torch.arange(R, device=index.device)[:, None], index]
    return reads, logits, paths, new_bonus, accepted, kept_feats


def _plan_chains(proposal, copies, samplers, budget, causal, verify_drafts, stopper, K, R) -> list[_Row]:
    """Each row's chain: the drafts a budget (or ``verify_drafts``) keeps, and its prompt-lookup copy grafted on.
    ``causal``: whether one row's choice, and several rows', must be causal."""
    if proposal is None:  # a plain step: the bonus alone (the drafter catches up in observe / its next draft)
        if budget is not None:
            budget.record_plain() if R == 1 else budget.record_rows_plain(R)
        return [_Row(torch.zeros(0, dtype=torch.long), None) for _ in range(R)]
    greedy = samplers[0].greedy
    tokens, logits = proposal.tokens, proposal.logits
    lengths = [proposal.length(r) for r in range(R)]
    plans = [_Row(tokens[r, : lengths[r]], None if logits is None else logits[r, : lengths[r]]) for r in range(R)]
    if budget is not None:  # ranked by the top probability at each position, never the drawn token's
        _choose_chains(plans, logits, lengths, samplers, budget, causal, stopper, K)
    elif verify_drafts:  # a fixed draft length
        for plan in plans:
            plan.drafts, plan.draft_logits = plan.drafts[:verify_drafts], plan.draft_logits[:verify_drafts]
    if copies:
        for r, plan in enumerate(plans):
            if copies[r]:
                tree, nodes = _graft_lookup(DraftTree.chain(plan.drafts), copies[r], budget, R)
                if len(tree) > len(plan.drafts):  # the copy departs: one tree forward verifies both
                    plan.tree, plan.copied, plan.copied_nodes = tree, copies[r], nodes
                    plan.probs = None if greedy else samplers[r].probs(plan.draft_logits)
                elif budget is not None:
                    plan.copied, plan.copied_nodes = copies[r], nodes
    return plans


def _choose_chains(
    plans: list[_Row], logits, lengths: list[int], samplers, budget: Budget, causal, stopper, K: int
) -> None:
    """Each row's drafts cut to what the budget chooses, from the drafter's top probability at each position
    (one row: its best prefix, causal where it must be, or where its drafter stopped; several rows: one
    ranking of all their positions, or one causal length for all)."""
    greedy = samplers[0].greedy
    for r, plan in enumerate(plans):
        plan.all_drafts = plan.drafts
        plan.q = None if greedy else samplers[r].probs(plan.draft_logits)  # a greedy verify needs no distribution
    if len(plans) == 1:
        plan = plans[0]
        if stopper is not None:  # the drafter stopped where its chain said: that choice is the step's
            plan.top_q, keep = stopper.top_q, budget.record_causal(stopper.chain)
        else:
            plan.top_q = (
                samplers[0].top(plan.draft_logits, with_prob=True)[1] if plan.q is None else plan.q.amax(-1)
            ).tolist()
            keep = budget.causal_length(plan.top_q, K - 1) if causal[0] else budget.chain_length(plan.top_q)
        keeps = [keep]
    else:
        top_q = (
            samplers[0].top(logits, with_prob=True)[1]
            if greedy
            else torch.stack([plan.q for plan in plans]).amax(-1)
            if len(set(lengths)) == 1
            else torch.stack([s.probs(row) for s, row in zip(samplers, logits)]).amax(-1)
        )
        top_rows = top_q.tolist()
        for r, plan in enumerate(plans):
            plan.top_q = top_rows[r][: lengths[r]]
        if causal[1]:
            counts = budget.choose_rows_causal(top_q[:, : min(lengths)])
        else:
            counts = budget.choose_rows([budget.calibration.chain_reach(plan.top_q) for plan in plans], top_q)
        keeps = [min(c - 1, length) for c, length in zip(counts, lengths)]
    for plan, keep in zip(plans, keeps):
        plan.keep = keep
        plan.drafts, plan.draft_logits = plan.drafts[:keep], plan.draft_logits[:keep]


def _plan_trees(proposal, copies, samplers, budget, tree_budget) -> list[_Row]:
    """Each row's best-first tree (by calibrated acceptance with a budget, else by ``q``), cut by the budget,
    sampled at T > 0, and its prompt-lookup copy grafted on."""
    greedy = samplers[0].greedy
    R = len(samplers)
    plans = []
    for r in range(R):
        length = proposal.length(r)
        drafts, draft_logits = proposal.tokens[r, :length], proposal.logits[r, :length]
        q = None if greedy else samplers[r].probs(draft_logits)
        probs = draft_logits.float().softmax(-1) if q is None else q
        tree = build_best_first_tree(
            probs.log() if budget is None else budget.calibration.log_acceptance(probs), tree_budget
        )
        plan = _Row(drafts, draft_logits, all_drafts=drafts, probs=q)
        if budget is not None:
            plan.full, plan.parents, plan.depths = tree, tree.parents.tolist(), tree.depths.tolist()
            plan.node_q = probs[tree.depths - 1, tree.tokens].tolist()
        plan.tree = tree
        plans.append(plan)
    if budget is not None:
        if R == 1:
            plan = plans[0]
            sizes = [budget.tree_size(plan.node_q, plan.parents, plan.depths)]
        else:
            reaches = [budget.calibration.tree_reach(plan.node_q, plan.parents, plan.depths) for plan in plans]
            sizes = [c - 1 for c in budget.choose_rows(reaches)]
        for plan, size in zip(plans, sizes):
            plan.tree = plan.tree.prefix(size)
    for r, plan in enumerate(plans):
        if plan.probs is not None:  # the shape depends on q alone; its tokens are draws (see serve_eval.tree)
            plan.tree = sample_tree(plan.tree, plan.probs, samplers[r])
        plan.drafter_nodes = len(plan.tree)
        if copies and copies[r]:
            plan.tree, plan.copied_nodes = _graft_lookup(plan.tree, copies[r], budget, R)
            plan.copied = copies[r]
    return plans


def _graft_lookup(tree: DraftTree, copied: list[int], budget: Budget | None, rows: int):
    """Graft ``copied`` onto ``tree``; with a budget, only as many of its tokens as pay (one row: by the
    rate of the step's choice; several rows: those its copies' calibration gives at least even odds of
    being reached). Returns the tree and the node of each kept copied token."""
    grafted, nodes = graft(tree, copied)
    if budget is None:
        return grafted, nodes
    reach = budget.lookup.chain_reach([COPY_Q] * len(nodes))
    extra = []
    for p, node in zip(reach, nodes):
        new = node >= len(tree)  # a node the drafter's tree already holds is already counted
        extra.append((p if new else 0.0, int(new)))
    keep = budget.extend_last(extra) if rows == 1 else next((i for i, p in enumerate(reach) if p < 0.5), len(reach))
    # the graft appends its new nodes in path order, so keeping the first copied tokens keeps a prefix
    return grafted.prefix(len(tree) + sum(new for _, new in extra[:keep])), nodes[:keep]


def _record(budget: Budget, plans: list[_Row], samplers, logits, paths, emitted, mode) -> None:
    """What the step's rows teach the calibration: each verified position up to the first miss, and
    beyond the verified ones what the target's logits say would have been kept; the copies' own."""
    calibration = budget.calibration
    for r, plan in enumerate(plans):
        path = paths[r]
        if mode == "tree":
            if plan.full is not None:
                unverified = (
                    unverified_outcomes(samplers[r], plan.full, plan.drafter_nodes, path, logits[r], plan.probs)
                    if path[-1] <= plan.drafter_nodes
                    else {}
                )  # past a copied node the drafter's tree does not apply
                calibration.record_tree(plan.node_q, plan.parents, plan.depths, path, plan.drafter_nodes, unverified)
        elif plan.top_q is not None:
            n = sum(node <= len(plan.drafts) for node in path[1:])  # drafts kept: a copied node's children are copied
            following = emitted[r][n]  # the target's choice after the kept drafts (or a copied token it kept)
            outcome = next_outcome(samplers[r], plan.all_drafts, plan.q, logits[r], plan.keep, n, following)
            calibration.record_chain(plan.top_q, plan.keep, n, outcome)
        if plan.copied:
            budget.lookup.record_copies(plan.copied, plan.copied_nodes, path, emitted[r])
            budget.copied_rows += 1


def speculative_generate(
    target,
    drafter,
    prompt: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    sampler: Sampler | None = None,
    proposer: Proposer | None = None,
    confidence_threshold: float = 0.0,
    mode: str = "chain",
    tree_budget: int = 16,
    budget: Budget | None = None,
    lookup: int = 0,
    kv: KVQuant | None = None,
    verify_drafts: int = 0,
    backend: Backend = TORCH,
) -> tuple[list[int], GenerationStats]:
    """Speculative decoding of one prompt (:func:`generate` over one row) with ``drafter``'s proposer
    (:func:`~serve_eval.proposers.make_proposer`, or ``proposer``)."""
    proposer = proposer or make_proposer(drafter, confidence_threshold, backend=backend)
    outs, stats = generate(
        target,
        [prompt.view(-1)],
        max_new_tokens,
        eos_token_id,
        [sampler or Sampler()],
        proposer,
        budget=budget,
        mode=mode,
        tree_budget=tree_budget,
        lookup=lookup,
        kv=kv,
        verify_drafts=verify_drafts,
        backend=backend,
    )
    return outs[0], stats.prompts[0]


def plain_generate(
    target,
    prompt: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    sampler: Sampler | None = None,
    kv: KVQuant | None = None,
    backend: Backend = TORCH,
) -> tuple[list[int], GenerationStats]:
    """Plain decoding of one prompt (:func:`generate` without a proposer): the baseline, with the same
    sampler, KV cache and backend as the speculative loop."""
    outs, stats = generate(
        target, [prompt.view(-1)], max_new_tokens, eos_token_id, [sampler or Sampler()], kv=kv, backend=backend
    )
    return outs[0], stats.prompts[0]
