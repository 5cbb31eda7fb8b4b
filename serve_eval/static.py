"""The static-shape step (``decoding.backend: static``): the loop as a GPU wants it.

Every tensor a step touches has the same shape from one step to the next, and the step's decisions stay
on the device; the host reads one small tensor a step (whether each row is done):

* **caches of fixed capacity**: the target's keys and values in :class:`StaticLayer` buffers
  [R, H, S, D] (``S``: the longest prompt, the new tokens and one verify), written at each row's own
  slots by one ``index_copy_`` a layer, attention reading all ``S`` slots through a mask built on the
  device from each row's length; the drafter's context in a :class:`~drafters.cache.ContextCache` of
  fixed capacity. A rollback is a length that does not advance: the next step writes over the rest.
* **one verify length**: a step reads each row's bonus and ``n - 1`` drafts, ``n`` the smallest bucket
  (:data:`BUCKETS`) holding the drafts verified; a DSpark confidence cut keeps the shape and masks the
  drafts past it (:func:`~serve_eval.verify.accept_chains` counts them as never drafted).
* **device-side choices**: acceptance, the next bonus (greedy or by speculative sampling,
  :func:`~serve_eval.verify.accept_chains`), the tokens written to an output buffer, each row's lengths,
  the features the next draft reads, the stop test against every stop token; trees built, drawn and
  walked on the device (:mod:`serve_eval.static_tree`).
* **every drafter kind**: block drafters through their decoding forward, EAGLE-3 through its rows'
  forward (:meth:`~drafters.Eagle3Drafter.draft_rows`), causal LMs and PARD LMs over static caches of their
  own, each step reading the row's newly verified tokens before it drafts.
* **compiled**: the target's verify forward and the drafter's draft go through ``torch.compile`` once per
  (rows, length) shape, ``mode="reduce-overhead"`` (CUDA graphs) on CUDA and the default mode elsewhere;
  the graphs compiled are counted (:class:`Compiled`).

Prefills (prompts of any length) run eagerly, once per group of rows. A row that finishes stops
advancing and computes on until its group does (its shape is the group's); ``slots`` fewer than the
prompts decode them a group at a time.

Lossless as the eager loop is: the same target forward per position (a different number of masked
slots and, compiled, fused kernels: rounding only, which the tests and reports hold to plain decoding
through the same static path), the same verification rules.
"""

from __future__ import annotations

import functools
import time
import types
import weakref
from collections import Counter

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from distill.base.features import FeatureCapture, decoder_layers
from distill.base.masks import LayerMasks
from drafters import Eagle3Drafter, is_block_drafter
from drafters.cache import ContextCache

from .backend import Backend
from .forward import TargetForward
from .sampling import Sampler
from .static_tree import best_first_tree, draw_tokens, walk
from .syncs import uncounted
from .verify import _row_probs, accept_chains, choose_rows

BUCKETS = (1, 2, 4, 8, 16, 32)
COMPILE = ("auto", "on", "off")


def bucket(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """The smallest bucket holding ``n`` tokens (``n`` itself past the largest)."""
    return next((b for b in buckets if b >= n), n)


class Compiled:
    """``fn`` through ``torch.compile`` (a copy of its code per instance, so that each model gets graphs of its
    own; no guards on the modules, which do not change while they serve), or eager with ``mode`` None.
    ``graphs[name]`` counts the graphs compiled for it (one per input shape), under ``fn``'s name."""

    def __init__(self, fn, mode: str | None, graphs: Counter):
        self.mode, self.graphs, self.name = mode, graphs, fn.__name__.strip("_")
        if mode is None:
            self.fn = fn
            return
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
        self.fn = torch.compile(
            own,
            fullgraph=True,  # no Python inside a graph: it reads nothing into the host (serve_eval.syncs)
            dynamic=False,
            mode=None if mode == "default" else mode,
            options=None if mode == "reduce-overhead" else {"guard_filter_fn": _skip_module_guards},
        )

    def __call__(self, *args):
        if self.mode is None:
            return self.fn(*args)
        counters = torch._dynamo.utils.counters["stats"]
        before = counters["unique_graphs"]
        with uncounted():
            out = self.fn(*args)
        self.graphs[self.name] += counters["unique_graphs"] - before
        return out


def _skip_module_guards(entries):
    return torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)


class StaticBackend(Backend):
    """The generic backend with the static-shape step: the models' own forwards, compiled as ``compile``
    says (``auto``: on), verify lengths rounded up to ``buckets``."""

    name = "static"
    static = True

    def __init__(self, compile: str = "auto", buckets: tuple[int, ...] = BUCKETS):
        if compile not in COMPILE:
            raise ValueError(f"decoding.static.compile = {compile!r}: expected one of {', '.join(COMPILE)}")
        self.compile, self.buckets = compile, tuple(sorted(buckets))
        self._compiled: weakref.WeakKeyDictionary = (
            weakref.WeakKeyDictionary()
        )  # model -> its Compiled functions, by name
        self.graphs: Counter[str] = Counter()  # graphs compiled so far: the verify's and the draft's, per shape
        self.capacity = 0  # the target cache's slots: set for a run by prepare, so that one graph serves every call

    def slots_for(self, needed: int) -> int:
        """The cache capacity of a group that needs ``needed`` slots: the prepared one where it holds them,
        else the next power of two (at least 256): few capacities, so few graphs."""
        if needed <= self.capacity:
            return self.capacity
        return max(256, 1 << (needed - 1).bit_length())

    def compiled(self, model, fn, device) -> Compiled:
        """``fn`` over ``model`` as this backend runs it: one :class:`Compiled` per model and function for the
        backend's life, so that its graphs serve every run."""
        mine = self._compiled.setdefault(model, {})  # a target drafting for itself has both functions
        if fn.__name__ not in mine:
            mine[fn.__name__] = Compiled(fn, self.mode(device), self.graphs)
        return mine[fn.__name__]

    def mode(self, device) -> str | None:
        """The ``torch.compile`` mode on ``device`` (None: eager)."""
        if self.compile == "off":
            return None
        return "reduce-overhead" if torch.device(device).type == "cuda" else "default"

    def compiled_graphs(self) -> dict:
        return dict(self.graphs)

    def prepare(self, target, drafter, prompts=(), max_new_tokens=0, sampled=False, rows=()) -> dict:
        if drafter is not None and is_block_drafter(drafter):
            drafter.fuse_projections()
        block = drafter.config.block_size if drafter is not None and is_block_drafter(drafter) else 1
        self.capacity = self.slots_for(
            max(map(len, prompts), default=0) + max_new_tokens + bucket(block, self.buckets) + 1
        )
        return {
            "backend": self.name,
            "target_forward": "the model's own, static shapes",
            "compile": self.mode(next(target.parameters()).device) or "off",
            "buckets": list(self.buckets),
            "cache_slots": self.capacity,
        }


# -- the target's cache ------------------------------------------------------------------------------
class RowSlots:
    """Where a step's entries go: row ``r``'s ``n`` entries at slots ``starts[r] + j`` of buffers
    [R, H, S, D]; one flat ``index_copy_`` per buffer (``starts``: a device tensor the step sets)."""

    def __init__(self):
        self.starts: torch.Tensor | None = None

    def write(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        R, H, S, D = buffer.shape
        n = new.shape[2]
        heads = torch.arange(R * H, device=buffer.device).view(R, H) * S + self.starts[:, None]
        index = (heads[:, :, None] + torch.arange(n, device=buffer.device)).flatten()
        buffer.view(R * H * S, D).index_copy_(0, index, new.reshape(R * H * n, D))


class StaticLayer(DynamicLayer):
    """One attention layer's keys and values in buffers of ``capacity`` slots, allocated at the first
    write (the prefill), written at :class:`RowSlots`' slots; attention reads all of them, the step's
    mask hiding what a row must not see. Zero where never written (a masked ``0 * NaN`` would not be)."""

    def __init__(self, capacity: int, slots: RowSlots):
        super().__init__()
        self.capacity, self.slots = capacity, slots

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        R, H = key_states.shape[:2]
        self.keys = key_states.new_zeros(R, H, self.capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(R, value_states.shape[1], self.capacity, value_states.shape[-1])
        if self.device.type == "cuda":  # CUDA graphs may mutate buffers at fixed addresses only
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.slots.write(self.keys, key_states)
        self.slots.write(self.values, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.capacity if self.is_initialized else 0


def static_cache(config, capacity: int, slots: RowSlots) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose every attention layer is a :class:`StaticLayer` (windowed
    layers keep every slot too: the step's masks apply the windows); other kinds of layer are a ValueError."""
    cache = DynamicCache(config=config)
    others = {type(layer).__name__ for layer in cache.layers} - {
        DynamicLayer.__name__,
        DynamicSlidingWindowLayer.__name__,
    }
    if others:
        raise ValueError(f"decoding.backend = 'static' keeps attention caches only; this target has {sorted(others)}")
    cache.layers = [StaticLayer(capacity, slots) for _ in cache.layers]
    return cache


def compact(cache: DynamicCache, lengths: torch.Tensor, path: torch.Tensor) -> None:
    """Each row's accepted tree path (``path`` [R, W], indices into the tree read at its slots
    ``lengths[r]`` on) moved down to the slots right after its cached ones, in every layer."""
    for layer in cache.layers:
        for buffer in (layer.keys, layer.values):
            R, H, S, D = buffer.shape
            base = (torch.arange(R * H, device=buffer.device).view(R, H) * S + lengths[:, None])[:, :, None]
            source = (base + path[:, None, :]).flatten()
            dest = (base + torch.arange(path.shape[1], device=buffer.device)).flatten()
            flat = buffer.view(R * H * S, D)
            flat.index_copy_(0, dest, flat.index_select(0, source))


def _verify(target, ids, positions, mask, cache, captured: dict, layer_ids: tuple):
    """The target's forward over ``ids`` [R, n] (the compiled unit): logits [R, n, V] and the features of
    ``layer_ids`` [R, n, F] (hooks fill ``captured``), or None."""
    logits = target(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True).logits
    return logits, torch.cat([captured.pop(i) for i in layer_ids], dim=-1) if layer_ids else None  # left empty


def _draft(drafter, anchors, counts, features, context, propose: bool):
    """The block drafter's decoding forward and, with ``propose``, its greedy proposal (the compiled unit)."""
    hidden = drafter.decode(anchors, counts, features, context)
    return hidden, drafter.propose(hidden, anchors[:, None]) if propose else None


def _draft_eagle3(drafter, features, next_tokens, counts, lengths, g, keys, values, steps: int, propose: bool):
    """EAGLE-3's draft (the compiled unit): the arriving features appended to each row's context, then,
    with ``propose``, its greedy chain of ``steps`` drafts. Returns the newest layer outputs, the rows'
    lengths and the proposal (or None)."""
    new = drafter.extend_rows(features, next_tokens, counts, lengths, keys, values)
    g = torch.where((counts > 0)[:, None, None], new, g)
    lengths = lengths + counts
    return g, lengths, drafter.draft_rows(g, lengths, keys, values, steps) if propose else None


def _draft_lm(model, ids, positions, mask, cache, kwargs: dict):
    """A causal LM's forward over ``ids`` [R, n] (the compiled unit of an LM or PARD drafter's draft)."""
    return model(
        input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True, **kwargs
    ).logits


def serves(drafter) -> bool:
    """Whether the static step drafts with ``drafter``: block drafters (DFlash, DSpark), EAGLE-3, a causal LM
    whose every layer keeps an attention cache (a student, a PARD LM), or none."""
    if drafter is None or is_block_drafter(drafter) or isinstance(drafter, Eagle3Drafter):
        return True
    layers = DynamicCache(config=drafter.config).layers
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)


class _Hooks:
    """Hooks on the target for the length of a run: the features' layers fill ``captured``, and each
    windowed attention layer reads its mask from ``windowed[w]`` (what :class:`LayerMasks` cuts per call,
    here set before each step so that a compiled forward reads it as an input)."""

    def __init__(self, target, layer_ids: list[int]):
        self.captured: dict = {}
        self.masks = LayerMasks(target)
        self.windowed: dict[int, torch.Tensor] = {}
        self.handles = []
        layers = decoder_layers(target) if layer_ids else []
        for i in layer_ids:
            self.handles.append(layers[i].register_forward_hook(functools.partial(self._grab, i)))
        for attention, w in self.masks.windowed:
            self.handles.append(
                attention.register_forward_pre_hook(functools.partial(self._window, w), with_kwargs=True)
            )

    def _grab(self, key, _module, _inputs, output):
        self.captured[key] = output[0] if isinstance(output, tuple) else output

    def _window(self, w, _module, args, kwargs):
        return args, {**kwargs, "attention_mask": self.windowed[w]}

    def set_masks(self, mask: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` [R, 1, n, S] as the model takes it, and each window's cut by the queries' ``positions``
        [R, n] and each slot's position ``keys`` [R, S] (None: slot ``s`` holds position ``s``)."""
        if self.masks.windowed:
            keys = torch.arange(mask.shape[-1], device=mask.device)[None] if keys is None else keys
            distance = positions[:, None, :, None] - keys[:, None, None, :]
            for w in {w for _, w in self.masks.windowed}:
                self.windowed[w] = self.masks.prepare(mask & (distance < w))
        return self.masks.prepare(mask)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Clock:
    """Seconds spent drafting and verifying, without waiting for the device: CUDA events recorded around
    each phase and read once at the end; on a CPU, the time itself."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def phases(self) -> tuple[float, float]:
        """(draft, verify) seconds: marks taken before the draft, the verify and after it, each step."""
        m = self.marks
        span = (lambda a, b: a.elapsed_time(b) / 1000) if self.cuda else (lambda a, b: b - a)
        draft = sum(span(m[i], m[i + 1]) for i in range(0, len(m) - 2, 3))
        verify = sum(span(m[i + 1], m[i + 2]) for i in range(0, len(m) - 2, 3))
        return draft, verify


@torch.inference_mode()
def static_generate(
    target,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    stop_ids,
    samplers: list[Sampler],
    backend: StaticBackend,
    proposer=None,
    verify_drafts: int = 0,
    slots: int | None = None,
    tree_budget: int = 0,
):
    """Decode ``prompts`` as :func:`serve_eval.loop.generate` does (plain without a ``proposer``, speculative
    with a block drafter's, EAGLE-3's, a causal LM's or a PARD LM's: chains, or trees of ``tree_budget``
    nodes), ``slots`` rows at a time,
    through the static step; ``stop_ids``:
    the tokens that end a row (an int, a collection, or None). Returns each prompt's tokens and a
    :class:`~serve_eval.loop.BatchStats`."""
    from .loop import BatchStats, GenerationStats, truncate

    K = proposer.block_size if proposer is not None else 1
    drafts = min(verify_drafts or K - 1, K - 1)
    stats = BatchStats(
        prompts=[GenerationStats(accepted_by_position=[0] * drafts, drafted_by_position=[0] * drafts) for _ in prompts]
    )
    stops = sorted({stop_ids} if isinstance(stop_ids, int) else set(stop_ids or ()))
    outs: list[list[int]] = []
    start = time.perf_counter()
    width = slots or len(prompts)
    for first in range(0, len(prompts), width):
        group = list(range(first, min(first + width, len(prompts))))
        run = _Group(target, proposer, [prompts[i] for i in group], max_new_tokens, stops, backend, tree_budget)
        tokens = run.decode([samplers[i] for i in group], drafts, [stats.prompts[i] for i in group], tree_budget)
        outs += tokens
        stats.steps += run.steps
        stats.row_steps += run.steps * len(group)
    seconds = time.perf_counter() - start
    for i, out in enumerate(outs):
        outs[i] = truncate(out, max_new_tokens, stops)
        stats.prompts[i].tokens, stats.prompts[i].total_seconds = len(outs[i]), seconds
    stats.tokens, stats.seconds = sum(map(len, outs)), seconds
    return outs, stats


class _Group:
    """One group of rows decoded together: the target's static cache and, with a drafter, its context."""

    def __init__(self, target, proposer, prompts, max_new: int, stops: list[int], backend, tree_budget: int = 0):
        from .proposers import BlockProposer, Eagle3Proposer, PardProposer

        drafter = None if proposer is None else getattr(proposer, "drafter", None) or proposer.model
        self.target, self.drafter, self.backend = target, drafter, backend
        self.kind = (
            None
            if proposer is None
            else "block"
            if isinstance(proposer, BlockProposer)
            else "eagle3"
            if isinstance(proposer, Eagle3Proposer)
            else "pard"
            if isinstance(proposer, PardProposer)
            else "lm"
        )
        self.threshold = getattr(proposer, "confidence_threshold", 0.0)
        self.layer_ids = tuple(proposer.target_layer_ids or ()) if proposer is not None else ()
        self.lm_kwargs = getattr(proposer, "forward_kwargs", {})
        self.mask_token_id = getattr(proposer, "mask_token_id", None)
        self.device = next(target.parameters()).device
        self.R, self.max_new = len(prompts), max_new
        self.lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        self.longest = int(self.lengths.max())
        self.K = proposer.block_size if proposer is not None else 1
        self.capacity = backend.slots_for(
            self.longest + max_new + max(bucket(self.K, backend.buckets), tree_budget + 1) + 1
        )
        self.slots = RowSlots()
        self.cache = static_cache(target.config, self.capacity, self.slots)
        self.stops = torch.tensor(stops or [-1], device=self.device)  # -1: no token stops a row
        self.prompts = prompts
        self.steps = 0
        self.eagle = self.kind == "eagle3"
        self.verify = backend.compiled(target, _verify, self.device)
        draft = {"block": _draft, "eagle3": _draft_eagle3, "lm": _draft_lm, "pard": _draft_lm}.get(self.kind)
        self.draft = backend.compiled(drafter, draft, self.device) if draft is not None else None

    def _prefill(self, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every prompt through the target (eager, once), written at slots 0..; the logits after each
        prompt's last token [R, V] and the prompts' features [R, L, F] (None without ``layer_ids``)."""
        R, L, device = self.R, self.longest, self.device
        ids = torch.zeros(R, L, dtype=torch.long, device=device)
        for r, p in enumerate(self.prompts):
            ids[r, : len(p)] = p.to(device)
        positions = torch.arange(L, device=device)[None].expand(R, L)
        slot = torch.arange(self.capacity, device=device)
        mask = (slot <= positions[:, :, None]) & (slot < self.lengths[:, None])[:, None, :]  # causal, real tokens
        self.slots.starts = torch.zeros(R, dtype=torch.long, device=device)
        capture = FeatureCapture(self.target, layer_ids) if layer_ids else None
        logits, feats = TargetForward(self.target, capture)(
            ids, positions, mask[:, None], self.cache, logits_at=self.lengths - 1
        )
        return logits[:, 0], None if feats is None else feats.aux

    def decode(  # noqa: PLR0912, PLR0915 (the step in order)
        self, samplers: list[Sampler], drafts: int, stats: list, tree_budget: int = 0
    ) -> list[list[int]]:
        """Decode the group's rows: ``drafts`` a step (0: plain) as a chain, or with ``tree_budget`` a tree of
        that many nodes. Fills each row's ``stats`` and returns its tokens (up to where it stopped; the
        caller truncates)."""
        R, device, drafter, threshold = self.R, self.device, self.drafter, self.threshold
        layer_ids = list(self.layer_ids)
        logits, aux = self._prefill(layer_ids)
        bonus = choose_rows(samplers, logits)
        n = bucket(drafts + 1, self.backend.buckets) if drafter is not None else 1
        if self.kind in ("lm", "pard"):
            context, features, arriving = self._lm_context(bonus)
        elif drafter is not None:
            context, features, arriving = self._context(aux, bonus)
        W = self.K if tree_budget else n  # tokens a step can emit
        width = self.max_new + W
        out = torch.zeros(R, width, dtype=torch.long, device=device)
        out[:, 0] = bonus
        written = torch.ones(R, dtype=torch.long, device=device)
        done = (written >= self.max_new) | torch.isin(bonus, self.stops)
        position = torch.arange(max(drafts, 1), device=device)
        verified = torch.zeros(R, len(position), dtype=torch.long, device=device)
        accepted = torch.zeros_like(verified)
        self.hooks, self.clock = _Hooks(self.target, layer_ids), _Clock(device)
        steps = torch.arange(W, device=device)
        try:
            while True:
                finished = done.tolist()  # the step's one host read
                if all(finished):
                    break
                self.steps += 1
                for r in range(R):
                    stats[r].target_forwards += not finished[r]
                if device.type == "cuda":  # a new step: CUDA graphs may reuse the last one's output memory
                    torch.compiler.cudagraph_mark_step_begin()
                self.clock.mark()
                if drafter is None:
                    emitted, kept, following, feats, limit = self._chain(bonus[:, None], samplers)
                else:
                    if self.kind in ("lm", "pard"):
                        block = self._lm_block(context, arriving, samplers)
                    else:
                        block = self._block(bonus, context, features, arriving, samplers)
                    if tree_budget:
                        emitted, kept, following, feats, limit = self._tree(bonus, block, samplers, tree_budget)
                    else:
                        ids, draft_logits, limit = self._chain_ids(bonus, block, samplers, threshold, n)
                        emitted, kept, following, feats, limit = self._chain(ids, samplers, draft_logits, limit)
                self.clock.mark()
                live = ~done
                out.scatter_(1, (written[:, None] + steps).clamp_max(width - 1), emitted)  # a done row's past its end
                advance = torch.where(live, kept + 1, 0)
                stopped = (torch.isin(emitted, self.stops) & (steps <= kept[:, None])).any(1)
                written += advance
                self.lengths = self.lengths + advance
                bonus = torch.where(live, following, bonus)
                done = done | (live & stopped) | (written >= self.max_new)
                if drafts:  # positions up to the first miss count as verified
                    reached = live[:, None] & (position <= kept[:, None])
                    verified += reached & (position < (drafts if limit is None else limit[:, None]))
                    accepted += reached & (position < kept[:, None])
                if drafter is not None:
                    if feats is not None:
                        features[:, : min(feats.shape[1], self.K)] = feats[:, : self.K]
                    arriving = advance
                    if self.eagle or self.kind in ("lm", "pard"):  # the tokens after the arriving positions
                        self.next_tokens[:, : min(emitted.shape[1], self.K)] = emitted[:, : self.K]
        finally:
            self.hooks.remove()
            if self.kind in ("lm", "pard"):
                self.lm_hooks.remove()
        draft_seconds, verify_seconds = self.clock.phases()
        for s, v, a in zip(stats, verified.tolist(), accepted.tolist()):
            s.draft_seconds, s.verify_seconds = draft_seconds, verify_seconds
            s.target_forwards += 1  # the prefill
            if drafts:
                s.drafted_by_position, s.accepted_by_position = v, a
        return [row[:w] for row, w in zip(out.tolist(), written.tolist())]

    def _forward(self, ids, positions, mask, key_positions=None):
        """The target's verify over ``ids`` [R, n] at ``positions``, each row writing at its own length and
        seeing the slots ``mask`` [R, n, S] allows (compiled per shape): logits and the drafter's features."""
        self.slots.starts = self.lengths
        return self.verify(
            self.target, ids, positions, self.hooks.set_masks(mask[:, None], positions, key_positions), self.cache,
            self.hooks.captured, self.layer_ids,
        )  # fmt: skip

    def _chain(self, ids, samplers, draft_logits=None, limit=None):
        """Verify each row's bonus and drafts ``ids`` [R, n]: the tokens it emits [R, n] (its drafts kept,
        then the next token), the drafts kept [R], the next token, the features of the positions read and
        how many drafts each row could keep."""
        n = ids.shape[1]
        positions = self.lengths[:, None] + torch.arange(n, device=ids.device)
        mask = torch.arange(self.capacity, device=ids.device) <= positions[:, :, None]  # its own slots, causal
        logits, feats = self._forward(ids, positions, mask)
        kept, following = accept_chains(samplers, ids, logits, draft_logits, limit)
        emitted = ids.roll(-1, 1).scatter(1, kept[:, None], following[:, None])  # drafts kept, then the next
        return emitted, kept, following, feats, limit

    def _tree(self, bonus, block, samplers, budget: int):
        """Each row's best-first tree of ``budget`` nodes over the block's distributions (drawn from them at
        T > 0, :mod:`serve_eval.static_tree`), verified in one forward and walked; the accepted path's
        entries moved down after the row's cached ones. Returns as :meth:`_chain`, over the path."""
        tokens, logits, _ = block
        greedy = samplers[0].greedy
        q = logits.float().softmax(-1) if greedy else _row_probs(samplers, logits)
        trees = best_first_tree(q.log(), budget)
        if not greedy:
            trees = draw_tokens(trees, q, samplers)
        ids = torch.cat([bonus[:, None], trees.tokens], dim=1)  # [R, N + 1]: the root first
        depths = torch.cat([torch.zeros_like(trees.depths[:, :1]), trees.depths], dim=1)
        lengths = self.lengths[:, None]
        slot = torch.arange(self.capacity, device=ids.device)[None]
        node = slot - lengths  # [R, S]: the tree node a slot holds (< 0: a cached one)
        inside = (node >= 0) & (node <= budget)
        at = node.clamp(0, budget)
        seen = trees.ancestors().gather(2, at[:, None, :].expand(-1, budget + 1, -1))
        mask = (node < 0)[:, None, :] | (inside[:, None, :] & seen)
        key_positions = torch.where(inside, lengths + depths.gather(1, at), slot)
        logits_t, feats = self._forward(ids, lengths + depths, mask, key_positions)
        path, length, following = walk(trees, logits_t, samplers, None if greedy else q)
        compact(self.cache, self.lengths, path)
        kept = length - 1
        emitted = ids.gather(1, path.roll(-1, 1)).scatter(1, kept[:, None], following[:, None])
        kept_feats = None if feats is None else feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))
        return emitted, kept, following, kept_feats, None

    # -- the drafter ----------------------------------------------------------------------------------
    def _context(self, aux: torch.Tensor, bonus: torch.Tensor):
        """The drafter's context cache with every prompt's features written in (row ``r``'s first
        ``len(prompt)``; EAGLE-3: each with its next token, the last with the first bonus), and the
        buffers the arriving features take: [R, K, F] and counts [R]."""
        drafter, R, K = self.drafter, self.R, self.K
        cfg = drafter.config
        layers = 1 if self.eagle else len(drafter.layers)
        context = ContextCache(spare=K, capacity=self.capacity + K + 1)
        context.start(R)
        like = aux.new_zeros(R, cfg.num_key_value_heads, 0, cfg.head_dim).to(drafter.dtype)
        context.ensure(self.capacity + K + 1, like, layers)
        if self.device.type == "cuda":
            for buffer in context.keys + context.values:
                torch._dynamo.mark_static_address(buffer)
        aux = aux.to(drafter.dtype)
        positions = torch.arange(aux.shape[1], device=aux.device)[None].expand(R, -1)
        if self.eagle:
            following = torch.zeros(R, aux.shape[1], dtype=torch.long, device=self.device)
            for r, p in enumerate(self.prompts):
                following[r, : len(p) - 1] = p[1:].to(self.device)
            following.scatter_(1, (self.lengths - 1)[:, None], bonus[:, None])
            zeros = torch.zeros_like(self.lengths)
            self.g = drafter.extend_rows(aux, following, self.lengths, zeros, context.keys[0], context.values[0])
            self.next_tokens = torch.zeros(R, K, dtype=torch.long, device=self.device)
        else:
            for (k, v), keys, values in zip(
                drafter.context_kv(aux, positions, lean=True), context.keys, context.values
            ):
                keys[:, :, : k.shape[2]] = k
                values[:, :, : v.shape[2]] = v
        self.context_lengths = self.lengths.clone()
        features = torch.zeros(R, K, drafter.fc.in_features, dtype=drafter.dtype, device=self.device)
        return context, features, torch.zeros(R, dtype=torch.long, device=self.device)

    # -- a causal-LM drafter (a student, Parcae) or a PARD one: its own static cache over the rows ------------
    def _lm_context(self, bonus: torch.Tensor):
        """The LM's static cache with every prompt read (eagerly, once); the first step reads the bonus."""
        model, R, K = self.drafter, self.R, self.K
        self.lm_slots = RowSlots()
        cache = static_cache(model.config, self.capacity + 2 * K, self.lm_slots)
        L, device = self.longest, self.device
        ids = torch.zeros(R, L, dtype=torch.long, device=device)
        for r, p in enumerate(self.prompts):
            ids[r, : len(p)] = p.to(device)
        positions = torch.arange(L, device=device)[None].expand(R, L)
        slot = torch.arange(self.capacity + 2 * K, device=device)
        mask = (slot <= positions[:, :, None]) & (slot < self.lengths[:, None])[:, None, :]
        self.lm_slots.starts = torch.zeros(R, dtype=torch.long, device=device)
        self.lm_hooks = _Hooks(model, [])
        mask = self.lm_hooks.set_masks(mask[:, None], positions)
        model(
            input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, logits_to_keep=1, **self.lm_kwargs
        )
        self.context_lengths = self.lengths.clone()
        self.next_tokens = torch.zeros(R, K, dtype=torch.long, device=device)
        self.next_tokens[:, 0] = bonus
        return cache, None, torch.ones(R, dtype=torch.long, device=device)

    def _lm_forward(self, cache, ids, positions):
        slot = torch.arange(cache.layers[0].capacity, device=ids.device)
        mask = self.lm_hooks.set_masks((slot <= positions[:, :, None])[:, None], positions)
        self.lm_slots.starts = positions[:, 0]
        return self.draft(self.drafter, ids, positions, mask, cache, self.lm_kwargs)

    def _lm_block(self, cache, arriving, samplers):
        """The LM reads each row's newly verified tokens (``arriving`` of ``next_tokens``, the bonus last) and
        drafts ``K - 1``: one token a forward after them (an LM), or all from one forward over them and
        ``K - 2`` mask tokens (PARD); the drafts' entries are scratch, the next read writes over them."""
        K, device = self.K, self.device
        i = torch.arange(K, device=device)
        choose = functools.partial(choose_rows, samplers)
        if self.kind == "pard":
            j = torch.arange(2 * K - 2, device=device)
            padded = torch.cat([self.next_tokens, torch.zeros_like(self.next_tokens[:, : K - 2])], dim=1)
            ids = torch.where(j < arriving[:, None], padded, self.mask_token_id)
            logits = self._lm_forward(cache, ids, self.context_lengths[:, None] + j)
            at = (arriving[:, None] - 1 + i[: K - 1]).clamp(0, 2 * K - 3)  # a finished row reads none
            logits = logits.gather(1, at[:, :, None].expand(-1, -1, logits.shape[-1]))
            self.context_lengths = self.context_lengths + arriving
            return choose(logits), logits, None
        logits = self._lm_forward(cache, self.next_tokens, self.context_lengths[:, None] + i)
        step = logits.gather(1, (arriving - 1).clamp_min(0)[:, None, None].expand(-1, 1, logits.shape[-1]))
        self.context_lengths = self.context_lengths + arriving
        tokens, all_logits = [], []
        for s in range(K - 1):
            tokens.append(choose(step))
            all_logits.append(step)
            if s < K - 2:
                step = self._lm_forward(cache, tokens[-1], (self.context_lengths + s)[:, None])
        return torch.cat(tokens, dim=1), torch.cat(all_logits, dim=1), None

    def _block(self, bonus, context, features, arriving, samplers):
        """The block after each row's bonus, drafted from its context and the features that arrived:
        drafts [R, K - 1], the logits they were drawn from [R, K - 1, V] and a DSpark's confidence (or None)."""
        drafter, greedy = self.drafter, samplers[0].greedy
        if self.eagle:
            keys, values = context.keys[0], context.values[0]
            self.g, self.context_lengths, proposal = self.draft(
                drafter, features, self.next_tokens, arriving, self.context_lengths, self.g, keys, values,
                self.K - 1, greedy,
            )  # fmt: skip
            if proposal is None:  # sampled: each draft drawn from the logits before it
                choose = functools.partial(choose_rows, samplers)
                proposal = drafter.draft_rows(self.g, self.context_lengths, keys, values, self.K - 1, choose)
            return proposal[0], proposal[1], None
        counts = torch.stack([self.context_lengths, arriving], dim=1)
        propose = greedy or not drafter.conditional_drafts
        hidden, proposal = self.draft(drafter, bonus, counts, features, context, propose)
        self.context_lengths = self.context_lengths + arriving
        if proposal is None or not greedy:
            choose = functools.partial(choose_rows, samplers)
            if proposal is None:
                proposal = drafter.propose(hidden, bonus[:, None], choose)
            else:  # DFlash: the graph's logits, drawn from here
                proposal = (choose(proposal[1]), *proposal[1:])
        confidence = None if proposal[2] is None else proposal[2][:, 0]
        return proposal[0][:, 0], proposal[1][:, 0], confidence

    def _chain_ids(self, bonus, block, samplers, threshold: float, n: int):
        """The chain verify's ids [R, n] (the bonus, then drafts, padded to the bucket), the drafts'
        logits (sampled rows) and how many drafts each row may keep (None: all)."""
        tokens, logits, confidence = block
        limit = None
        if confidence is not None and threshold > 0:  # DSpark: stop before the first position below it
            low = confidence < threshold
            limit = torch.where(low.any(1), low.int().argmax(1), low.shape[1]).clamp_min(1)
        d = n - 1
        ids = torch.cat([bonus[:, None], tokens[:, :d]], dim=1)
        logits = logits[:, :d]
        if ids.shape[1] < n:  # a bucket past the drafts: padding, never kept
            pad = n - ids.shape[1]
            ids = torch.cat([ids, ids.new_zeros(self.R, pad)], dim=1)
            logits = torch.cat([logits, logits.new_zeros(self.R, pad, logits.shape[-1])], dim=1)
            limit = torch.full_like(bonus, tokens.shape[1]) if limit is None else limit
        return ids, None if samplers[0].greedy else logits, limit
