"""The speculative-decoding loop (chain verification), and plain decoding of the same target.

One iteration, with ``b`` the target's newest token (the *bonus*, not yet read by the target) at
position ``a`` and every earlier position verified and cached:

1. **Draft.** The drafter proposes ``d_1 .. d_{K-1}`` for positions ``a+1 .. a+K-1`` from the target
   features of positions ``< a`` and ``b`` (a block drafter in one forward; EAGLE-3 autoregressively),
   or, for a plain causal LM drafter (a distilled student; a Parcae model at fewer recurrences than
   the target, i.e. self-speculation), from the tokens alone, with its own KV cache: one token a
   forward, or a PARD-trained LM's whole block in one forward over appended mask tokens.
2. **Verify.** One target forward over ``[b, d_1, .., d_{K-1}]`` at positions ``a .. a+K-1`` (KV
   cache) gives the target's greedy choice ``g_j`` after each of them. With a budget
   (:mod:`serve_eval.budget`) only the prefix of the drafts (or of the tree) that measured costs and
   measured acceptance say pays is read.
3. **Accept** the longest prefix with ``d_j == g_{j-1}``, say ``n`` drafts, and the target's own next
   token ``g_n`` as the new bonus: ``n + 1`` tokens from one target forward. At temperature > 0 the
   drafts are sampled and accepted by speculative rejection sampling (:mod:`serve_eval.sampling`).
4. **Roll back** the target's cache to ``a + n + 1`` positions (``b`` and the accepted drafts) and
   hand the drafter the target features of exactly those positions.

Lossless by construction: at temperature 0 every emitted token is the target's argmax given the
emitted prefix (an accepted draft equals it, the bonus is it), so the output equals plain greedy
decoding token for token, whatever the drafter proposes; at temperature > 0 every emitted token is
distributed as the target's (sampler-processed) distribution given the prefix. The tests check this for every drafter, for drafts that are
always rejected and drafts that are always accepted, and that a rolled-back cache equals a cache
recomputed from scratch.

Trees (``mode="tree"``) verify a best-first draft tree instead of a chain (:mod:`serve_eval.tree`).
Prompt-lookup continuations can be grafted onto either (:mod:`serve_eval.lookup`); a chain with a
copy that departs from it is verified as a tree. Several prompts at once decode in :mod:`serve_eval.batch`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from distill.base.features import FeatureCapture, TargetFeatures
from drafters import Eagle3Drafter, is_block_drafter
from drafters.cache import ContextCache

from .backend import TORCH, Backend
from .budget import COPY_Q, Budget, CausalChain
from .cpu.compiled import proposal as compiled_proposal
from .kv import KVQuant, inplace_cache, keep_entries, kv_quant
from .lookup import NgramIndex, graft
from .sampling import Sampler, top_tokens, verify_chain
from .tree import DraftTree, build_best_first_tree, sample_tree, walk_tree


class TargetSession:
    """The target with a KV cache of the positions it has read (quantized as ``kv`` says,
    :mod:`serve_eval.kv`), stepped as ``backend`` serves it; optionally captures features."""

    def __init__(self, target, capture: FeatureCapture | None = None, kv: KVQuant | None = None,
                 backend: Backend = TORCH):
        self.target = target
        self.run = backend.target_forward(target, capture)  # its capture: the features a drafter reads
        self.cache = inplace_cache(target.config, kv)
        self.length = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                last: bool = False, key_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, TargetFeatures | None]:
        """Read ``ids`` [1, n] at the next positions: logits [n, V] (``last``: the last position's only,
        [1, V], as a prompt's prefill reads them) and the features of those positions."""
        n = ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(self.length, self.length + n, device=ids.device)[None]
        logits, feats = self.run(ids, position_ids, attention_mask, self.cache, torch.tensor([n - 1]) if last else None,
                                 key_positions)
        self.length += n
        return logits[0], feats

    @torch.inference_mode()
    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length

    @torch.inference_mode()
    def forward_tree(self, ids: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor):
        """Read a tree ``ids`` [1, n] (root first) whose node i sits at position ``length + depths[i]``
        and sees the cached prefix and the nodes ``ancestors[i]`` marks. Returns logits and features."""
        n = ids.shape[1]
        positions = (self.length + depths.to(ids.device))[None]
        mask = torch.cat([torch.ones(n, self.length, dtype=torch.bool), ancestors], dim=1)[None, None].to(ids.device)
        keys = torch.cat([torch.arange(self.length, device=ids.device), positions[0]])[None]  # the nodes' positions
        return self.forward(ids, position_ids=positions, attention_mask=mask, key_positions=keys)

    @torch.inference_mode()
    def keep(self, prefix: int, nodes: list[int]) -> None:
        """After a tree forward: keep the first ``prefix`` positions and the tree entries ``nodes``
        (the accepted path, root first). Only the tree's tail moves; the prefix stays where it is."""
        keep_entries(self.cache, prefix, [prefix + i for i in nodes])
        self.length = prefix + len(nodes)


@torch.inference_mode()
def measure_verify_costs(target, sizes, capture=None, context: int = 128, repeats: int = 5,
                         kv: KVQuant | None = None, backend: Backend = TORCH) -> dict[int, float]:
    """Seconds of one target forward over ``n`` new tokens after ``context`` cached ones, for each ``n``
    in ``sizes`` (the fastest of ``repeats`` interleaved rounds: :func:`interleaved_seconds`' ``least``),
    with the loop's feature capture and KV cache. The tokens are random (a private generator: the
    caller's RNG is untouched); cost does not depend on them."""
    device = next(target.parameters()).device
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    session = TargetSession(target, capture, kv, backend)
    session.forward(torch.randint(0, vocab, (1, context), generator=gen).to(device))
    undo = lambda: session.rollback(context)  # noqa: E731
    runs = {n: (functools.partial(session.forward, torch.randint(0, vocab, (1, n), generator=gen).to(device)), undo)
            for n in sorted(set(sizes))}
    return interleaved_seconds(runs, repeats, device, least=True)


def device_clock(device):
    """``now()`` in seconds that first waits for the device's queued work: on CUDA, kernels run after
    the host launched them, so an unsynchronised timer would count the drafter's kernels in whatever
    the host timed next (the verify). The loop syncs every step anyway (it reads the accepted count),
    so the extra waits cost nothing; on a CPU it is ``time.perf_counter``."""
    if torch.device(device).type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def interleaved_seconds(runs: dict, repeats: int, device, least: bool = False) -> dict:
    """The median seconds of each ``runs[key] = (run, after)`` (with ``least``, the fastest): ``repeats``
    rounds after a warm-up round, every ``run()`` once a round (``after()``, when not None, untimed after
    it, e.g. to undo it), so that a machine that drifts moves every key alike (CUDA synchronised:
    :func:`device_clock`); each round starts one key further on, so that no key always runs first or
    always at the same point of a periodic disturbance.

    ``least`` is for cost models, which want what a run itself costs and correct the level online
    (:meth:`~serve_eval.budget.Budget.observe_verify`): another process's burst only ever adds time, and
    one that covers most rounds of some sizes but not others bends a table of medians out of shape (a
    quickstart measured, straight after training its drafter in the same process, 4.62 ms for a 1-token
    verify and 3.73 for 6 tokens, and its budgets then verified 6 tokens every step for a drafter whose
    drafts past the third were never kept); the fastest of the rounds keeps the shape."""
    now = device_clock(device)
    keys = list(runs)
    times = {key: [] for key in keys}
    for round_ in range(repeats + 1):
        shift = round_ % len(keys) if keys else 0
        for key in keys[shift:] + keys[:shift]:
            run, after = runs[key]
            start = now()
            run()
            times[key].append(now() - start)
            if after is not None:
                after()
    pick = min if least else (lambda t: sorted(t)[len(t) // 2])
    return {key: pick(t[1:]) for key, t in times.items()}


def verify_sizes(largest: int) -> list[int]:
    """The forward sizes a budget's cost table measures: every size up to 33 tokens (small-matrix
    kernels make neighbouring sizes differ, see :mod:`serve_eval.budget`), sparser beyond, and ``largest``."""
    grid = [*range(1, 34), *range(40, 129, 8), *range(160, 1025, 32)]
    return [n for n in grid if n < largest] + [largest]


class Proposer:
    """What the loop asks of a drafter: ``begin(prompt)``; ``observe`` the verified tokens (and, when
    ``needs_features``, the target's features of their positions); ``propose`` drafts after the bonus.

    ``conditional``: each draft's distribution depends on the drafts before it, so a budget must choose
    causally at temperature > 0 (:mod:`serve_eval.budget`). ``incremental``: ``propose`` runs one
    forward per draft and takes ``stop(logits) -> bool``, asked with each position's logits: on yes it
    draws that position's token (kept for calibration, not verified) and drafts no further."""

    needs_features = True
    conditional = incremental = False
    block_size: int

    def begin(self, prompt: torch.Tensor) -> None:
        pass


class BlockProposer(Proposer):
    """DFlash / DSpark: caches each layer's keys and values of the verified context features.

    With ``confidence_threshold`` (DSpark), the draft stops before the first position whose predicted
    acceptance ``c_k`` is below it. ``c_k`` is computed from the anchor, the context and drafts
    ``1..k-1`` only, so where the draft stops depends on nothing the target has not seen or is about
    to verify, and the loop stays lossless."""

    def __init__(self, drafter, confidence_threshold: float = 0.0, backend: Backend = TORCH):
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.conditional = drafter.conditional_drafts
        self.confidence_threshold = confidence_threshold
        self.compiled = backend.draft_graph(drafter)  # the draft as one graph, where the backend built one
        self.begin(None)

    def begin(self, prompt: torch.Tensor | None) -> None:
        self.context = ContextCache(spare=self.block_size, capacity=self.compiled.positions if self.compiled else 0)
        self.arrived: torch.Tensor | None = None  # verified positions' features the context has not read yet

    @torch.inference_mode()
    def observe(self, aux: torch.Tensor, start: int, next_tokens: torch.Tensor) -> None:
        """Keep the features for the next draft, whose forward reads them with its block (one product per
        layer for both: ``decode_hidden``); steps that do not draft let them accumulate."""
        self.arrived = aux if self.arrived is None else torch.cat([self.arrived, aux], dim=1)

    def _read(self, features: torch.Tensor) -> None:
        """The context cache appends ``features`` [1, n, F] of its next positions, by the drafter's context
        projection alone (a compiled draft reads at most ``K`` arriving features with its block)."""
        start = self.context.length
        positions = torch.arange(start, start + features.shape[1], device=features.device)[None]
        self.context.append(self.drafter.context_kv(features, positions, lean=True))

    @torch.inference_mode()
    def propose(self, anchor: torch.Tensor, anchor_pos: int, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [K-1] for the positions after the anchor, and the logits they were drawn from [K-1, V].
        Compiled (:mod:`serve_eval.cpu.compiled`), a draft reads up to ``K`` arriving features in its graph;
        more (a prompt's, or those of steps that did not draft) are read into the context first."""
        arriving = None if self.arrived is None else self.arrived.shape[1]
        if self.compiled is not None and arriving and arriving > self.block_size:  # a prompt's, or undrafted steps'
            self._read(self.arrived[:, :-self.block_size])  # all but the last K: one product first, then the graph
            self.arrived, arriving = self.arrived[:, -self.block_size:], self.block_size
        if self.compiled is not None and arriving and self.compiled.fits(self.context.keys, self.context.length + arriving, arriving):
            self.context.check_anchor(anchor_pos, self.arrived)
            hidden, proposal = self.compiled(anchor, self.context, self.arrived, self.compiled.proposes_for(sampler.greedy))
        else:
            hidden, proposal = self.drafter.decode_hidden(anchor, anchor_pos, self.context, self.arrived), None
        self.arrived = None
        tokens, logits, confidence = compiled_proposal(self.drafter, hidden, proposal, anchor.view(1, 1), sampler.choose, sampler.greedy)
        tokens, logits = tokens[0, 0], logits[0, 0]
        if confidence is not None and self.confidence_threshold > 0:
            low = (confidence[0, 0] < self.confidence_threshold).nonzero()
            if len(low):
                keep = max(1, int(low[0]))  # always draft at least one token
                tokens, logits = tokens[:keep], logits[:keep]
        return tokens, logits


class Eagle3Proposer(Proposer):
    """EAGLE-3: a KV cache of step-0 entries for verified positions; drafts autoregressively."""

    conditional = incremental = True

    def __init__(self, drafter):
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.state: dict = {}

    def begin(self, prompt: torch.Tensor) -> None:
        self.state = {}

    @torch.inference_mode()
    def observe(self, aux: torch.Tensor, start: int, next_tokens: torch.Tensor) -> None:
        self.state = self.drafter.extend(self.state, aux, next_tokens.view(1, -1), start)

    @torch.inference_mode()
    def propose(self, anchor: torch.Tensor, anchor_pos: int, sampler: Sampler, stop=None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, logits = self.drafter.propose_chain(self.state, self.block_size - 1, sampler.choose, stop)
        return tokens[0], logits[0]


class LMProposer(Proposer):
    """Any causal LM as an autoregressive drafter: a distilled student, or a Parcae model at fewer
    recurrences than the target runs (self-speculation, ``num_steps=``). It needs no target features:
    it keeps its own KV cache of the tokens it has read, and after each verification it keeps the
    cache up to the first position where what it read differs from the verified sequence (a rejected
    draft, or a tree branch the target did not take), then catches up from there on the next draft."""

    needs_features = False
    conditional = incremental = True

    def __init__(self, model, draft_length: int, **forward_kwargs):
        self.model = model
        self.block_size = draft_length + 1
        self.forward_kwargs = forward_kwargs
        self.cache = None  # made by begin()
        self.sequence: list[int] = []  # verified tokens (the bonus last)
        self.read: list[int] = []  # tokens the cache holds, position by position

    def begin(self, prompt: torch.Tensor) -> None:
        self.cache, self.sequence, self.read = DynamicCache(), prompt.view(-1).tolist(), []

    def observe(self, aux, start: int, next_tokens: torch.Tensor) -> None:
        self.sequence = self.sequence[:start + 1] + next_tokens.view(-1).tolist()
        keep = min(start, len(self.read))
        last = len(self.sequence) - 1  # the bonus is always (re)read by the next draft: its logits start it
        while keep < min(len(self.read), last) and self.read[keep] == self.sequence[keep]:
            keep += 1
        if keep < len(self.read):
            self.cache.crop(keep - len(self.read))
            self.read = self.read[:keep]

    def _read(self, tokens: list[int], device) -> torch.Tensor:
        start = len(self.read)
        ids = torch.tensor([tokens], device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        logits = self.model(input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True, logits_to_keep=1,
                            **self.forward_kwargs).logits[0, -1]  # the head on the last position only
        self.read += tokens
        return logits

    @torch.inference_mode()
    def propose(self, anchor: torch.Tensor, anchor_pos: int, sampler: Sampler, stop=None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, all_logits = [], []
        pending = self.sequence[len(self.read):anchor_pos + 1]  # catch up to the bonus (at anchor_pos)
        for _ in range(self.block_size - 1):
            logits = self._read(pending, anchor.device)
            token = sampler.choose(logits)
            tokens.append(token)
            all_logits.append(logits)
            if stop is not None and stop(logits):
                break
            pending = [int(token)]
        return torch.stack(tokens).view(-1), torch.stack(all_logits)


class PardProposer(LMProposer):
    """A PARD-trained causal LM (:mod:`drafters.pard`, ``config.pard``): one forward reads the tokens it
    has not read yet (the bonus last) and ``K - 1`` mask tokens after them; the bonus's output and the
    masks' give ``K`` drafts, none conditioned on another (a block: verified like DFlash's), and the
    mask entries leave the cache at once. Its cache follows the verified sequence as
    :class:`LMProposer`'s does."""

    conditional = incremental = False

    def __init__(self, model, draft_tokens: int, mask_token_id: int):
        super().__init__(model, draft_tokens)
        self.masks = [mask_token_id] * (draft_tokens - 1)

    @torch.inference_mode()
    def propose(self, anchor: torch.Tensor, anchor_pos: int, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
        pending = self.sequence[len(self.read):anchor_pos + 1]
        start, n = len(self.read), len(pending) + len(self.masks)
        ids = torch.tensor([pending + self.masks], device=anchor.device)
        positions = torch.arange(start, start + n, device=anchor.device)[None]
        logits = self.model(input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True,
                            logits_to_keep=len(self.masks) + 1).logits[0]
        self.cache.crop(-len(self.masks))
        self.read += pending
        return sampler.choose(logits), logits


def make_proposer(drafter, confidence_threshold: float = 0.0, draft_length: int = 7, draft_recurrence: int | None = None,
                  parallel: bool = True, backend: Backend = TORCH):
    """The proposer for a drafter: its own kind for DFlash / DSpark / EAGLE-3, :class:`PardProposer`
    for a PARD-trained LM (``config.pard``; ``parallel=False`` drafts with it autoregressively),
    :class:`LMProposer` for any other causal LM (``draft_length`` tokens per step; ``draft_recurrence``
    for Parcae)."""
    if isinstance(drafter, Eagle3Drafter):
        return Eagle3Proposer(drafter)
    if is_block_drafter(drafter):
        return BlockProposer(drafter, confidence_threshold, backend)
    pard = getattr(drafter.config, "pard", None)
    if pard and parallel:
        return PardProposer(drafter, pard["draft_tokens"], pard["mask_token_id"])
    return LMProposer(drafter, draft_length, **({"num_steps": draft_recurrence} if draft_recurrence else {}))


class _Stopper:
    """The ``stop`` an incremental proposer asks after each position (:class:`~serve_eval.budget.CausalChain`),
    timing the drafter forwards between the questions (the first from the draft's start)."""

    def __init__(self, budget: Budget, sampler: Sampler, horizon: int, start: float, now=time.perf_counter):
        self.chain, self.sampler, self.now = CausalChain(budget, horizon), sampler, now
        self.top_q: list[float] = []
        self.times = [start]

    def __call__(self, logits: torch.Tensor) -> bool:
        self.times.append(self.now())
        top = top_tokens(logits.float(), with_prob=True)[1] if self.sampler.greedy else self.sampler.probs(logits).amax(-1)
        self.top_q.append(float(top.max()))
        return not self.chain.offer(self.top_q[-1])

    def forward_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def _next_outcome(sampler: Sampler, drafts, draft_probs, target_logits, verified: int, accepted: int,
                  bonus: int) -> float | None:
    """Whether (T = 0), or with what probability (T > 0), the first draft left unverified would have
    been kept, from the target's logits after the kept ones (``draft_probs``: the distributions the
    drafts were drawn from; ``bonus``: the token the target chose there, at T = 0 their argmax); None
    when it does not apply."""
    if accepted < verified or verified >= len(drafts):
        return None
    draft = int(drafts[verified])
    if sampler.greedy:
        return float(bonus == draft)
    p, q = float(sampler.probs(target_logits[accepted])[draft]), float(draft_probs[verified, draft])
    return min(1.0, p / q) if q > 0 else 1.0


def _unverified_outcomes(sampler: Sampler, full: DraftTree, verified: int, path: list[int], logits, q) -> dict[int, float]:
    """For the calibration: the nodes past the verified ones (indices into ``full``, the whole best-first
    tree) that would have been tried after the walk's last node, and whether (T = 0), or with what
    probability (T > 0), each would have been kept, from the target's logits there. At T = 0 every such
    child counts (kept iff it is the target's argmax); at T > 0 the first one only, when the last node
    had no verified child: a fresh draw from ``q`` is kept with probability ``sum_x min(p, q)``."""
    last = path[-1]
    children = [i for i in range(verified, len(full)) if int(full.parents[i]) + 1 == last]
    if not children:
        return {}
    row = logits[last]
    if sampler.greedy:
        choice = int(row.argmax())
        return {i: float(int(full.tokens[i]) == choice) for i in children}
    if any(int(full.parents[i]) + 1 == last for i in range(verified)):
        return {}  # its verified children were rejected: the residual, not p, would meet the next one
    depth = int(full.depths[children[0]])
    return {children[0]: float(torch.minimum(sampler.probs(row), q[depth - 1]).sum())}


def _verify_tree(session: "TargetSession", bonus: torch.Tensor, tree: DraftTree, sampler: Sampler, q, walk):
    """One target forward over [bonus, tree] with the ancestor mask and the walk down it: the step's
    ids [1, N+1], the target's logits and features there, the accepted path and the new bonus."""
    ids = torch.cat([bonus.view(1), tree.tokens.to(bonus.device)])[None]
    depths = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
    logits, feats = session.forward_tree(ids, depths, tree.ancestor_mask())
    path, new_bonus = walk(tree, logits, sampler, q)
    return ids, logits, feats, path, new_bonus


def _graft_lookup(tree: DraftTree, copied: list[int], budget: Budget | None):
    """Graft ``copied`` onto ``tree``; with a budget, only as many of its tokens as pay (the per-depth
    acceptance of copied tokens is calibrated apart, in ``budget.lookup``). Returns the tree and the
    node of each kept copied token."""
    if not copied:
        return tree, []
    grafted, nodes = graft(tree, copied)
    if budget is None:
        return grafted, nodes
    reach = budget.copy_calibration().chain_reach([COPY_Q] * len(nodes))
    extra = []
    for p, node in zip(reach, nodes):
        new = node >= len(tree)  # a node the drafter's tree already holds is already counted
        extra.append((p if new else 0.0, int(new)))
    keep = budget.extend_last(extra)
    # the graft appends its new nodes in path order, so keeping the first copied tokens keeps a prefix
    return grafted.prefix(len(tree) + sum(new for _, new in extra[:keep])), nodes[:keep]


def _record_lookup(calibration: Budget, copied: list[int], nodes: list[int], path: list[int], emitted: list[int]) -> None:
    """Count each copied token whose parent was accepted (kept iff on the accepted path); when every
    verified one was, the next copied token counts too, kept iff it is the target's choice after the
    last one (``emitted``: the step's accepted tokens and the new bonus, in path order)."""
    on_path = set(path)
    for depth, node in enumerate(nodes, start=1):
        kept = node + 1 in on_path
        calibration.count(COPY_Q, float(kept), depth)
        if not kept:
            return
    if len(nodes) < len(copied):
        calibration.count(COPY_Q, float(copied[len(nodes)] == emitted[len(nodes)]), len(nodes) + 1)


@dataclass
class GenerationStats:
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
        for k in range(drafts):
            self.drafted_by_position[k] += int(k <= accepted)
            self.accepted_by_position[k] += int(k < accepted)


def _truncate(tokens: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    tokens = tokens[:max_new_tokens]
    if eos is not None and eos in tokens:
        tokens = tokens[:tokens.index(eos) + 1]
    return tokens


@torch.inference_mode()
def plain_generate(target, prompt: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                   sampler: Sampler | None = None, kv: KVQuant | None = None, backend: Backend = TORCH):
    """Plain decoding with a KV cache (the baseline), with the same sampler, KV cache and backend as the
    speculative loop."""
    sampler = sampler or Sampler()
    stats = GenerationStats()
    start = time.perf_counter()
    session = TargetSession(target, kv=kv, backend=backend)
    logits, _ = session.forward(prompt.view(1, -1), last=True)
    out = [int(sampler.choose(logits[-1]))]
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        logits, _ = session.forward(torch.tensor([[out[-1]]], device=prompt.device))
        out.append(int(sampler.choose(logits[-1])))
    stats.target_forwards = len(out)
    stats.tokens = len(out)
    stats.total_seconds = time.perf_counter() - start
    return _truncate(out, max_new_tokens, eos_token_id), stats


@torch.inference_mode()
def speculative_generate(target, drafter, prompt: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                         sampler: Sampler | None = None, proposer=None, verify=verify_chain,
                         confidence_threshold: float = 0.0, mode: str = "chain", tree_budget: int = 16,
                         walk=walk_tree, budget: Budget | None = None, lookup: int = 0, kv: KVQuant | None = None,
                         verify_drafts: int = 0, backend: Backend = TORCH):
    """Speculative decoding with chain or tree verification (see the module docstrings of this file
    and of :mod:`serve_eval.tree`). With a :class:`~serve_eval.budget.Budget` each step verifies the
    prefix of the drafts (chain) or of the ``tree_budget``-node tree with the most expected tokens per
    second; ``lookup`` grafts a prompt-lookup continuation of up to that many tokens
    onto every draft, chain or tree (:mod:`serve_eval.lookup`); ``kv`` quantizes the target's KV cache
    (:mod:`serve_eval.kv`); without a budget, ``verify_drafts`` verifies a chain's first that many
    drafts only (a fixed draft length; 0: all); ``verify`` and ``walk`` are test hooks."""
    sampler = sampler or Sampler()
    proposer = proposer or make_proposer(drafter, confidence_threshold, backend=backend)
    K = proposer.block_size
    stats = GenerationStats(accepted_by_position=[0] * (K - 1), drafted_by_position=[0] * (K - 1))
    now = device_clock(prompt.device)
    start = now()
    capture = FeatureCapture(target, drafter.config.target_layer_ids) if proposer.needs_features else None
    session = TargetSession(target, capture, kv, backend)
    prompt = prompt.view(1, -1)
    proposer.begin(prompt)
    logits, feats = session.forward(prompt, last=True)
    stats.target_forwards += 1
    bonus = sampler.choose(logits[-1])
    proposer.observe(None if feats is None else feats.aux, 0, torch.cat([prompt[0, 1:], bonus.view(1)]))
    out = [int(bonus)]
    index = NgramIndex(prompt[0].tolist()) if lookup else None  # prompt lookup's n-grams, grown with out
    done = out[0] == eos_token_id
    anchor_pos = prompt.shape[1]
    causal = proposer.incremental or (proposer.conditional and not sampler.greedy)  # see serve_eval.budget
    while len(out) < max_new_tokens and not done:
        t0 = now()
        drafting = budget is None or mode != "chain" or budget.switch.should_draft()
        stopper = _Stopper(budget, sampler, K - 1, t0, now) if drafting and budget is not None and mode == "chain" \
            and proposer.incremental else None
        if drafting:
            drafts, draft_logits = proposer.propose(bonus, anchor_pos, sampler, **({"stop": stopper} if stopper else {}))
        else:  # a plain step: the bonus alone (the drafter catches up in observe / its next draft)
            drafts, draft_logits = bonus.new_empty(0), logits.new_empty(0, logits.shape[-1])
        if index is not None:
            index.extend(out[len(index.tokens) - prompt.shape[1]:])
        copied = index.continuation(lookup) if index is not None else []  # drafting too
        t1 = now()
        if mode == "tree":
            q = None if sampler.greedy else sampler.probs(draft_logits)
            probs = draft_logits.float().softmax(-1) if q is None else q
            # best-first by calibrated acceptance when there is a budget (its calibration), else by q
            tree = build_best_first_tree(probs.log() if budget is None else budget.log_acceptance(probs), tree_budget)
            if budget is not None:
                full, parents, node_depths = tree, tree.parents.tolist(), tree.depths.tolist()
                node_q = probs[tree.depths - 1, tree.tokens].tolist()
                tree = tree.prefix(budget.tree_size(node_q, parents, node_depths))
            if q is not None:  # the shape depends on q alone; its tokens are draws (see serve_eval.tree)
                tree = sample_tree(tree, q, sampler)
            drafter_nodes = len(tree)
            tree, copied_nodes = _graft_lookup(tree, copied, budget)
            ids, logits, feats, path, new_bonus = _verify_tree(session, bonus, tree, sampler, q, walk)
            accepted, read = ids[0, path[1:]], ids.shape[1]
            session.keep(anchor_pos, path)
            path_feats = None if feats is None else feats.aux[:, path]
            if budget is not None:
                unverified = _unverified_outcomes(sampler, full, drafter_nodes, path, logits, q) \
                    if path[-1] <= drafter_nodes else {}  # past a copied node the drafter's tree does not apply
                budget.record_tree(node_q, parents, node_depths, path, drafter_nodes, unverified)
                if copied:
                    _record_lookup(budget.lookup, copied, copied_nodes, path, ids[0, path[1:]].tolist() + [int(new_bonus)])
        else:
            if budget is not None and not drafting:
                keep, top_q, q, all_drafts = 0, [], None, drafts
                budget.record_plain()
            elif budget is not None:  # ranked by the top probability at each position, never the drawn token's
                q = None if sampler.greedy else sampler.probs(draft_logits)  # a greedy verify needs no distribution
                if stopper is not None:  # the drafter stopped where its chain said: that choice is the step's
                    top_q, keep = stopper.top_q, budget.record_causal(stopper.chain)
                else:
                    top_q = (top_tokens(draft_logits.float(), with_prob=True)[1] if q is None else q.amax(-1)).tolist()
                    keep = budget.causal_length(top_q, K - 1) if causal else budget.chain_length(top_q)
                all_drafts = drafts
                drafts, draft_logits = drafts[:keep], draft_logits[:keep]
            elif verify_drafts:  # a fixed draft length
                drafts, draft_logits = drafts[:verify_drafts], draft_logits[:verify_drafts]
            tree, copied_nodes = _graft_lookup(DraftTree.chain(drafts), copied, budget) if copied and drafting \
                else (None, [])
            if tree is not None and len(tree) > len(drafts):  # the copy departs: one tree forward verifies both
                draft_q = None if sampler.greedy else sampler.probs(draft_logits)
                ids, logits, feats, path, new_bonus = _verify_tree(session, bonus, tree, sampler, draft_q, walk)
                n = sum(node <= len(drafts) for node in path[1:])  # drafts kept: a copied node's children are copied
                accepted, read = ids[0, path[1:]], ids.shape[1]
                session.keep(anchor_pos, path)
                path_feats = None if feats is None else feats.aux[:, path]
            else:
                logits, feats = session.forward(torch.cat([bonus.view(1), drafts])[None])
                n, new_bonus = verify(sampler, drafts, draft_logits, logits)
                path, accepted, read = list(range(n + 1)), drafts[:n], len(drafts) + 1
                session.rollback(anchor_pos + n + 1)
                path_feats = None if feats is None else feats.aux[:, :n + 1]
            if budget is not None:
                following = int(new_bonus) if len(accepted) == n else int(accepted[n])  # past the drafts: a copied token
                budget.record_chain(top_q, keep, n, _next_outcome(sampler, all_drafts, q, logits, keep, n, following))
                if tree is not None:
                    _record_lookup(budget.lookup, copied, copied_nodes, path, accepted.tolist() + [int(new_bonus)])
        stats.target_forwards += 1
        n = len(accepted)
        stats.count_step(len(drafts), n)
        emitted = torch.cat([accepted, new_bonus.view(1)])
        emitted_list = emitted.tolist()  # one host sync for the step's tokens
        out.extend(emitted_list)
        done = eos_token_id in emitted_list
        t2 = now()
        proposer.observe(path_feats, anchor_pos, emitted)
        anchor_pos += n + 1
        bonus = new_bonus
        draft_seconds = (t1 - t0) + (now() - t2)  # drafting, and reading the accepted features
        stats.draft_seconds += draft_seconds
        if budget is not None:
            budget.observe_verify(read, t2 - t1)
            if drafting:
                budget.observe_draft(draft_seconds, stopper.forward_seconds() if stopper is not None else ())
            if mode == "chain":
                budget.switch.record(drafting, n, now() - t0)
        stats.verify_seconds += t2 - t1
    out = _truncate(out, max_new_tokens, eos_token_id)
    stats.tokens = len(out)
    stats.total_seconds = now() - start
    return out, stats


def served_record(index: int, prompt: torch.Tensor, emitted: list[int], eos: int | None, stats: GenerationStats,
                  temperature: float) -> dict:
    """What the loop served for one prompt, in :mod:`distill.regenerate`'s record form (the exact
    tokens read and emitted; the loop is lossless, so these are the target's own answers and a drafter
    recipe trains on them as on regenerated data), with the step's acceptance: online adaptation."""
    ended = bool(emitted) and emitted[-1] == eos
    return {"id": index, "prompt_ids": prompt.view(-1).tolist(), "response_ids": emitted[:-1] if ended else emitted,
            "eos": ended, "temperature": temperature, "tau": round(stats.tau, 4),
            "accepted_by_position": stats.accepted_by_position, "drafted_by_position": stats.drafted_by_position}


def measure(target, drafter, encoded, dec, eos, sampler, budget_nodes, calibration: Budget | None = None,
            served: list | None = None, backend: Backend = TORCH) -> dict:
    """Baseline and speculative decoding of every prompt, back to back, as ``dec`` (a
    :class:`~distill.config.DecodingSection`) says; ``sampler(i)`` gives prompt i's sampler (the same
    seeds for both loops). The numbers of an eval report, the parity gate and the quantize recipe.
    ``calibration``: a budget whose acceptance calibration the run's budget shares (and extends).
    ``served``: a list that gets, per prompt, what the loop served (:func:`served_record`)."""
    new_proposer = lambda: make_proposer(drafter, dec.drafter.confidence_threshold, dec.drafter.draft_length,  # noqa: E731
                                         dec.drafter.draft_recurrence, dec.drafter.parallel_drafts, backend)
    probe = new_proposer()
    K = probe.block_size
    kv = kv_quant(dec.kv.format, dec.kv.rotate)
    budget = None
    if dec.budget.adaptive:  # one cost table and one acceptance calibration for the whole run
        largest = ((budget_nodes or 1) + 1 if dec.mode == "tree" else K) + dec.lookup.tokens
        capture = FeatureCapture(target, drafter.config.target_layer_ids) if probe.needs_features else None
        budget = Budget(measure_verify_costs(target, verify_sizes(largest), capture, kv=kv, backend=backend), share=calibration,
                        loop_offset=True)
    totals = {"tokens": 0, "forwards": 0, "spec_s": 0.0, "base_tokens": 0, "base_s": 0.0, "draft_s": 0.0, "verify_s": 0.0,
              "sd_tokens": 0, "sd_forwards": 0, "sd_s": 0.0}
    accepted, drafted = [0] * (K - 1), [0] * (K - 1)
    per_prompt, lossless, verify_ms = [], True, []
    speculation = None
    if dec.ssd.enabled:  # imported here: serve_eval.ssd builds on this module
        from .ssd import open_speculation, ssd_generate, ssd_report

        speculation = open_speculation(new_proposer(), dec.ssd.branches, dec.ssd.exponent, dec.ssd.backup, dec.ssd.concurrent)
    try:
        for i, prompt in enumerate(encoded):
            base, base_stats = plain_generate(target, prompt, dec.max_new_tokens, eos, sampler(i), kv, backend)
            ours, stats = speculative_generate(target, drafter, prompt, dec.max_new_tokens, eos, sampler(i),
                                               proposer=new_proposer(), mode=dec.mode, tree_budget=budget_nodes or 1,
                                               budget=budget, lookup=dec.lookup.tokens, kv=kv, verify_drafts=dec.budget.verify_drafts,
                                               backend=backend)
            if speculation is not None:  # plain speculative decoding above; speculative speculation here
                totals["sd_tokens"] += stats.tokens
                totals["sd_forwards"] += stats.target_forwards
                totals["sd_s"] += stats.total_seconds
                sd_same = ours == base
                loop = sampler(i)
                seed = (loop.generator.initial_seed() if loop.generator is not None else i) + 2**32  # the drafter's own
                ours, stats, steps_ms = ssd_generate(target, speculation, prompt, dec.max_new_tokens, eos, loop, seed, kv,
                                                       backend)
                verify_ms += steps_ms
            same = ours == base if dec.temperature == 0 else None  # sampled outputs differ draw by draw
            if speculation is not None and same is not None:
                same = same and sd_same
            lossless = lossless and same if same is not None else None
            totals["tokens"] += stats.tokens
            totals["forwards"] += stats.target_forwards
            totals["spec_s"] += stats.total_seconds
            totals["draft_s"] += stats.draft_seconds
            totals["verify_s"] += stats.verify_seconds
            totals["base_tokens"] += base_stats.tokens
            totals["base_s"] += base_stats.total_seconds
            accepted = [a + b for a, b in zip(accepted, stats.accepted_by_position)]
            drafted = [a + b for a, b in zip(drafted, stats.drafted_by_position)]
            if served is not None:
                served.append(served_record(i, prompt, ours, eos, stats, dec.temperature))
            per_prompt.append({"prompt": i, "tokens": stats.tokens, "tau": round(stats.tau, 4), "lossless": same,
                               "speedup": round((stats.tokens / stats.total_seconds) / (base_stats.tokens / base_stats.total_seconds), 4)})
        ssd = None if speculation is None else ssd_report(speculation, totals, verify_ms, len(encoded))
    finally:
        if speculation is not None:
            speculation.close()
    tokens_per_s = totals["tokens"] / totals["spec_s"]
    baseline_tokens_per_s = totals["base_tokens"] / totals["base_s"]
    adaptive = None
    if budget is not None:  # the cost model's prediction beside what the steps measured (prefill excluded)
        adaptive = budget.summary()
        steps = totals["forwards"] - len(encoded)
        adaptive["measured"] = {"tau": round((totals["tokens"] - len(encoded)) / max(1, steps), 4),
                                "step_ms": round(1e3 * (totals["draft_s"] + totals["verify_s"]) / max(1, steps), 3)}
        adaptive["measured"]["tokens_per_s"] = round(1e3 * adaptive["measured"]["tau"] / max(adaptive["measured"]["step_ms"], 1e-9), 2)
    return {
        "tree_budget": budget_nodes,
        "adaptive": adaptive,
        "tau": round(totals["tokens"] / max(1, totals["forwards"]), 4),
        "acceptance_by_position": [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)],
        "tokens_per_s": round(tokens_per_s, 2),
        "baseline_tokens_per_s": round(baseline_tokens_per_s, 2),
        "speedup": round(tokens_per_s / baseline_tokens_per_s, 4),
        "time_split": {"draft_s": round(totals["draft_s"], 3), "verify_s": round(totals["verify_s"], 3),
                       "other_s": round(totals["spec_s"] - totals["draft_s"] - totals["verify_s"], 3),
                       "draft_fraction": round(totals["draft_s"] / totals["spec_s"], 4),
                       "verify_fraction": round(totals["verify_s"] / totals["spec_s"], 4)},
        "lossless": lossless,
        "per_prompt": per_prompt,
        **({"ssd": ssd} if ssd is not None else {}),
    }
