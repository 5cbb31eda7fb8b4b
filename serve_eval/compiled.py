"""A block drafter's draft as one compiled graph (``decoding.cpu.compile``).

Eager, one draft of the shipped DFlash drafter is ~100 small operations (norms, rotations, the int8
row scaling, masks, the head's argmax) at 5-10 µs each around six int8 products: on this CPU the
operations cost as much as the products. ``torch.compile`` (inductor's C++ kernels) fuses them, but
only where the graph holds still, so the draft is traced through :meth:`drafters.core.BlockDrafter.
decode_static` (shapes that do not change from step to step; see its docstring for why its block
equals :meth:`~drafters.core.BlockDrafter.decode_hidden`'s) and the int8 products through an operator
of their own (:mod:`serve_eval.int8`). What varies from step to step is data:

* per row, the cache length and the number of arriving features, ``counts`` = ``[start, n]``, a tensor;
* the arriving features, padded to ``K`` rows;
* the cache buffers have one length for the whole run (the longest sequence it decodes, set up front),
  so that no context compiles another graph (with the length marked dynamic instead, inductor's
  kernels and Dynamo's guards each cost more: a draft took 0.83 of eager's time against 0.75).

The same code drafts one row (:class:`~serve_eval.engine.BlockProposer`) or a batch's rows at once
(:class:`~serve_eval.batch.BatchContext`, whose per-row buffers the graph writes by index): one graph
per number of rows, each compiled when the draft is set up (:func:`compile_drafts`'s ``rows``), by a
draft over throwaway caches, so that no timed draft pays for it (a few seconds each with inductor's
on-disk cache warm, ~30 s cold), and one for every count below the smallest batch (its tail, as rows
finish). A batch of another size drafts eagerly. Where more features wait than a graph reads (``K``: a
prompt's, or those of steps that did not draft), the loops append them to the context in one product
first (one row all but the last ``K``, a batch all of them) and draft through the graph rather than
eagerly (4 rows after 8 undrafted steps: 1.5-1.6 ms against 2.0-2.3 eager; after 40, 2.4-2.7 against
3.3-3.4).

Each drafter gets graphs of its own, without Dynamo's guards on its modules (they cost about a tenth
of a compiled draft; see :func:`_without_module_guards`): compile a drafter once it is ready to
serve (fused products, int8 codes), and change it no more. Once a graph is compiled, the loops call
its compiled code directly (:func:`_unguarded`), skipping Dynamo's per-call work altogether (its
remaining guards, frame evaluation): what the guards would check, :meth:`CompiledDraft.fits` and the
graph's key (rows, greedy proposal or not) check, in inference mode only. In the loop, alternated
with the guarded call (``recipes.profile_step``, two pairs): a draft 0.697 / 0.705 ms against 0.846 /
0.934. It reads Dynamo's cache entries through a private interface; where that is missing, the
guarded call serves. A graph returns the blocks' hidden states
and the drafter's greedy proposal over them: DFlash's head and argmax, DSpark's Markov chain position
after position (at T > 0 DFlash draws from the graph's logits; a sampled DSpark chain, which
conditions on its own draws, runs eagerly over the graph's block: :func:`proposal`).

Measured on the shipped DFlash drafter (1 thread): a draft alone, alternated with eager on one cache
state, 0.65-0.72 of eager's time; in the loop, where the target's forward has just pushed the
drafter's weights and code out of the caches, 0.72-0.85 (``python -m recipes.profile_step --cpu-compile
on|off``: 0.160-0.168 plain steps against 0.199-0.201). Four rows at once, alone: 1.87 ms against
2.86 ms eager (the eager batch path also appends the context in a product of its own).

Losslessness does not depend on any of it: a compiled drafter is another drafter, whose logits (its
``q``) are what both drafting and verification read. Its logits differ from eager's by rounding only
(fused reductions); tests hold them to eager's and the loop to plain decoding, greedy and sampled.
"""

from __future__ import annotations

import shutil
import types
import weakref

import torch

from drafters.core import BlockDrafter, ContextCache
from drafters.vocab import CandidateHead


def available() -> bool:
    """Whether inductor can build its CPU kernels here: it needs a C++ compiler."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return shutil.which(get_cpp_compiler()) is not None
    except Exception:  # noqa: BLE001  (no inductor, no compiler: both mean no)
        return False


def resolve(setting: str, device: str, drafter) -> str:
    """What ``decoding.cpu.compile`` means here: ``auto`` is ``on`` for a block drafter on the CPU where
    inductor can compile, else ``off``; ``on`` for another drafter, or without a compiler, is a ValueError.
    (On a GPU ``on`` compiles the same graph; it is not measured here, so ``auto`` leaves it off.)"""
    block = isinstance(drafter, BlockDrafter)
    if setting == "auto":
        return "on" if device == "cpu" and block and available() else "off"
    if setting == "on" and not block:
        raise ValueError(f"decoding.cpu.compile = 'on' compiles a block drafter's draft (DFlash, DSpark); "
                         f"{type(drafter).__name__} drafts eagerly (auto or off)")
    if setting == "on" and device == "cpu" and not available():
        raise ValueError("decoding.cpu.compile = 'on': inductor finds no C++ compiler here; install one (g++) or use auto / off")
    return setting


def _draft(drafter, anchors, counts, features, keys, values, propose: bool):
    hidden = drafter.decode_static(anchors, counts, features, keys, values)
    return hidden, drafter.propose(hidden, anchors[:, None]) if propose else None  # greedy: (tokens, logits, confidence)


def _without_module_guards(entries) -> list[bool]:
    """Dynamo's guards minus those on the drafter's modules and their attributes (~220 of ~290, about a
    tenth of a compiled draft's time): each drafter has a graph of its own (:func:`_own_graph`) and is
    not changed once compiled, while the guards on the inputs (the caches' shapes among them) stay."""
    return [not entry.orig_guard.source.is_unspecialized_nn_module() for entry in entries]


def _entries(graph) -> list | None:
    """Dynamo's cache entries for ``graph``'s code, newest first, or None where this torch does not expose
    them (a private interface)."""
    try:
        return torch._dynamo.eval_frame._debug_get_cache_entry_list(graph._torchdynamo_orig_callable.__code__)
    except Exception:  # noqa: BLE001  (another torch: the guarded call serves)
        return None


def _unguarded(graph, entries_before: int):
    """The code Dynamo compiled for ``graph``'s newest graph (the one just compiled, when exactly one
    was), as a function that runs it without Dynamo's per-call work: its guards and frame evaluation,
    ~70-100 µs of a ~350 µs draft (measured alternated, warm). None where this torch's Dynamo does
    not expose it (the guarded call serves then)."""
    entries = _entries(graph)
    if entries is None or len(entries) != entries_before + 1:
        return None
    return types.FunctionType(entries[0].code, graph._torchdynamo_orig_callable.__globals__)


def _own_graph():
    """:func:`_draft` compiled for one drafter: Dynamo keeps its graphs per code object, so each drafter
    gets a copy of the code (and no other drafter can reach a graph built over this one's modules)."""
    own = types.FunctionType(_draft.__code__.replace(), _draft.__globals__, _draft.__name__)
    return torch.compile(own, fullgraph=True, dynamic=False, options={"guard_filter_fn": _without_module_guards})


class CompiledDraft:
    """The compiled draft of one block drafter over caches of ``positions`` slots (:func:`compile_drafts`
    makes it, the loop's :class:`~serve_eval.engine.BlockProposer` and the batched loop's
    :class:`~serve_eval.batch.BatchContext` find it with :func:`for_drafter` and give their caches that
    capacity). One graph per number of rows it is called with (``rows``: those compiled up front)."""

    def __init__(self, drafter: BlockDrafter, positions: int):
        self._drafter = weakref.ref(drafter)  # (a strong one would keep the drafter's _COMPILED entry alive forever)
        self.conditional = drafter.conditional_drafts
        self.block_size = drafter.config.block_size
        self.positions = positions
        self.rows: set[int] = set()
        # the greedy proposal inside the graph too (DFlash's head; DSpark's Markov chain, position after
        # position); not a per-step vocabulary, which chooses its rows from the data
        self.proposes = not isinstance(drafter.lm_head, CandidateHead)
        self.graph = _own_graph()
        for layer in drafter.layers:  # rotary tables that cover every slot, built here rather than in the graph
            layer.attn.rope_table(torch.zeros(1, 1, dtype=torch.long, device=drafter.device), drafter.dtype,
                                  end=positions, signed=True)
        self.calls = 0
        # (rows, propose) -> the compiled code of that graph without Dynamo's guards (_unguarded): what the
        # guards would check is what fits() checks (rows, the buffers' length) and the key, and the
        # loops draft in inference mode, as the graphs were compiled
        self.unguarded: dict[tuple[int, bool], types.FunctionType] = {}

    def warm(self, rows: int, sampled: bool) -> None:
        """Compile now the graph a greedy or ``sampled`` run of ``rows`` rows calls, by one draft over
        throwaway caches, so that no draft of the run pays for it (another graph would still compile
        when first called)."""
        drafter = self._drafter()
        cfg = drafter.config
        like = torch.zeros((), dtype=drafter.dtype, device=drafter.device)
        buffers = [like.new_zeros(rows, cfg.num_key_value_heads, self.positions, cfg.head_dim) for _ in range(2 * len(drafter.layers))]
        zeros = torch.zeros(rows, dtype=torch.long, device=drafter.device)
        propose = self.proposes_for(greedy=not sampled)
        before = _entries(self.graph)
        with torch.inference_mode():  # as the loops draft: Dynamo's guards include the grad mode
            self.run(zeros, torch.stack([zeros, zeros + 1], dim=1), like.new_zeros(rows, 1, drafter.fc.in_features),
                     buffers[::2], buffers[1::2], propose)
        self.rows.add(rows)
        direct = _unguarded(self.graph, len(before)) if before is not None else None
        if direct is not None:
            self.unguarded[(rows, propose)] = direct
        self.calls = 0

    def proposes_for(self, greedy: bool) -> bool:
        """Whether the graph's proposal serves a step: greedy steps, and sampled ones of a drafter whose
        logits do not depend on the drafts before them (DFlash: its tokens are then drawn from the
        graph's logits). A sampled DSpark chain conditions on its own draws: the graph gives the block."""
        return self.proposes and (greedy or not self.conditional)

    def fits(self, keys: list[torch.Tensor], end: int, arriving: int) -> bool:
        """Whether a draft can be the graph's: context buffers ``keys`` of the graph's length, for as many
        rows as a graph compiled up front, at most K features ``arriving``, and room after the longest
        row's context (``end``, arrived features counted) for the block and the padding slot."""
        return (bool(keys) and keys[0].shape[0] in self.rows and keys[0].shape[2] == self.positions
                and arriving <= self.block_size and end + self.block_size < self.positions)

    def run(self, anchors: torch.Tensor, counts: torch.Tensor, arriving: torch.Tensor,
            keys: list[torch.Tensor], values: list[torch.Tensor], propose: bool):
        """The graph's draft for ``R`` rows: anchors [R], ``counts`` [R, 2] = each row's cached length and
        the number of the ``arriving`` features [R, m, F] (``m <= K``) that are its own; returns the
        hidden states [R, 1, K, H] and, with ``propose``, the greedy proposal over them, as
        :meth:`~drafters.core.BlockDrafter.propose` gives it. The buffers then hold the arrived positions."""
        features = torch.nn.functional.pad(arriving, (0, 0, 0, self.block_size - arriving.shape[1]))  # zero rows: not multiplied
        direct = self.unguarded.get((len(anchors), propose)) if torch.is_inference_mode_enabled() else None
        out = (direct or self.graph)(self._drafter(), anchors, counts, features, keys, values, propose)
        self.calls += 1
        return out

    def __call__(self, anchor: torch.Tensor, cache: ContextCache, arrived: torch.Tensor, propose: bool):
        """The block after ``cache`` and the ``arrived`` features [1, n, F] (where it :meth:`fits`): its hidden
        states [1, 1, K, H] and, with ``propose``, the drafter's greedy proposal over them (tokens,
        logits and confidence, as :meth:`~drafters.core.BlockDrafter.propose` gives them); the cache
        then holds the arrived positions, as after :meth:`~drafters.core.BlockDrafter.decode_hidden`."""
        start, n = cache.length, arrived.shape[1]
        out = self.run(anchor.view(1), torch.tensor([[start, n]], device=arrived.device), arrived, cache.keys, cache.values, propose)
        cache.length = start + n
        return out


_COMPILED: "weakref.WeakKeyDictionary[BlockDrafter, CompiledDraft]" = weakref.WeakKeyDictionary()


def compile_drafts(drafter: BlockDrafter, positions: int, sampled: bool = False, rows: tuple[int, ...] = (1,)) -> dict:
    """Compile ``drafter``'s draft and serve its drafts from the graph from now on, for sequences of up
    to ``positions`` tokens (the longest prompt plus the new tokens: the cache buffers' one length; a
    longer one drafts eagerly past it), greedy or ``sampled``, one row at a time and batches of each of
    ``rows`` rows, and of every count below the smallest of them: a batch's rows finish apart, and its
    last ones draft as a smaller batch (testbed, batch 4's tail: 2 / 3 rows drafted in 0.55 / 0.81 ms
    compiled against 2.45 / 2.80 eager). A batch of another size drafts eagerly. Call it after the
    drafter's fused products and int8 codes: the graph is traced over what it serves. Returns what the
    eval report records."""
    positions += drafter.config.block_size + 1  # the last block's slots and the padding slot
    _COMPILED[drafter] = compiled = CompiledDraft(drafter, positions)
    counts = {*range(1, min(rows, default=1) + 1), *rows}
    for count in sorted(counts)[:torch._dynamo.config.recompile_limit]:  # Dynamo keeps that many graphs of a code
        compiled.warm(count, sampled)
    return {"graph": "decode_static" + (" + propose" if compiled.proposes else ""),
            "sampled_proposal": compiled.proposes_for(greedy=False), "cache_positions": positions,
            "rows": sorted(compiled.rows)}


def proposal(drafter, hidden: torch.Tensor, graphs: tuple | None, anchors: torch.Tensor, choose, greedy: bool):
    """The drafter's proposal (tokens, logits, confidence) over a block's ``hidden`` states: the graph's
    own where it gave one (``graphs``; its tokens drawn from its logits when sampling, as
    :meth:`CompiledDraft.proposes_for` allows), else the drafter's ``propose`` with ``choose``."""
    if graphs is None:
        return drafter.propose(hidden, anchors, choose)
    return graphs if greedy else (choose(graphs[1]), *graphs[1:])


def for_drafter(drafter) -> CompiledDraft | None:
    """The compiled draft :func:`compile_drafts` set up for ``drafter``, if any."""
    try:
        return _COMPILED.get(drafter)
    except TypeError:  # not weak-referenceable: never compiled
        return None
