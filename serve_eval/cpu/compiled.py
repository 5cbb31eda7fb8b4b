"""A block drafter's draft as one compiled graph (``decoding.cpu.compile``).

Eager, one draft of a small block drafter is ~100 small operations (norms, rotations, the int8 row
scaling, masks, the head's argmax) around a few products; on a CPU the operations cost as much as the
products. ``torch.compile`` (inductor's C++ kernels) fuses them, but only where the graph holds still,
so the graph is the drafter's one decoding forward, :meth:`drafters.BlockDrafter.decode` (its shapes
do not change from step to step; eager, the loop runs the same function) and the int8 products through an operator of their own (:mod:`serve_eval.cpu.int8`). What varies from step to step
is data:

* per row, the cache length and the number of arriving features, ``counts`` = ``[start, n]``, a tensor;
* the arriving features, padded to ``K`` rows;
* the cache buffers have one length for the whole run (the longest sequence it decodes, set up
  front), so that no context compiles another graph.

One graph per number of rows, each compiled up front (:meth:`CompiledDraft.warm_all`) by a draft over
throwaway caches, so that no timed draft pays for it; a batch of another size drafts eagerly. Where
more features wait than a graph reads (``K``: a prompt's, or those of steps that did not draft), the
loop appends them to the context in one product first and drafts through the graph.

Each drafter gets graphs of its own, compiled without Dynamo's guards on its modules
(``torch.compiler.skip_guard_on_all_nn_modules_unsafe``): a drafter is compiled once it is ready to
serve (fused products, int8 codes) and changes no more; the guards on the inputs stay. A graph returns the blocks' hidden states and the drafter's greedy proposal over them (DFlash's
head and argmax, DSpark's Markov chain position after position); at T > 0 DFlash draws from the
graph's logits, and a sampled DSpark chain, which conditions on its own draws, runs eagerly over the
graph's block (:func:`proposal`).

Losslessness does not depend on any of it: a compiled drafter is another drafter, whose logits (its
``q``) are what both drafting and verification read. Its logits differ from eager's by rounding only
(fused reductions); tests hold them to eager's and the loop to plain decoding, greedy and sampled.
"""

from __future__ import annotations

import shutil
import types
import weakref

import torch

from drafters.block import BlockDrafter
from drafters.cache import ContextCache
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
        raise ValueError(
            f"decoding.cpu.compile = 'on' compiles a block drafter's draft (DFlash, DSpark); "
            f"{type(drafter).__name__} drafts eagerly (auto or off)"
        )
    if setting == "on" and device == "cpu" and not available():
        raise ValueError(
            "decoding.cpu.compile = 'on': inductor finds no C++ compiler here; install one (g++) or use auto / off"
        )
    return setting


def _draft(drafter, anchors, counts, features, cache, propose: bool):
    """The drafter's decoding forward and, with ``propose``, its greedy proposal (tokens, logits, confidence)."""
    hidden = drafter.decode(anchors, counts, features, cache)
    return hidden, drafter.propose(hidden, anchors[:, None]) if propose else None


def _own_graph():
    """:func:`_draft` compiled for one drafter: Dynamo keeps its graphs per code object, so each drafter
    gets a copy of the code (and no other drafter can reach a graph built over this one's modules)."""
    own = types.FunctionType(_draft.__code__.replace(), _draft.__globals__, _draft.__name__)
    return torch.compile(
        own,
        fullgraph=True,
        dynamic=False,
        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )


class CompiledDraft:
    """The compiled draft of one block drafter over context caches of one length: the longest sequence
    it serves (``positions``: the longest prompt plus the new tokens) plus a block and the padding slot;
    a longer sequence drafts eagerly past it. The backend that made it hands it to the loop
    (:meth:`serve_eval.backend.Backend.draft_graph`), whose context caches take its length as their
    capacity. One graph per number of rows it is warmed for (:meth:`warm_all`)."""

    def __init__(self, drafter: BlockDrafter, positions: int):
        self._drafter = weakref.ref(drafter)  # the backend's table is keyed by the drafter: no cycle
        self.conditional = drafter.conditional_drafts
        self.block_size = drafter.config.block_size
        self.positions = positions + self.block_size + 1  # the last block's slots and the padding slot
        self.rows: set[int] = set()
        # the greedy proposal inside the graph too (DFlash's head; DSpark's Markov chain, position after
        # position); not a per-step vocabulary, which chooses its rows from the data
        self.proposes = not isinstance(drafter.lm_head, CandidateHead)
        self.graph = _own_graph()
        for layer in drafter.layers:  # rotary tables that cover every slot, built here rather than in the graph
            layer.attn.rope_table(
                torch.zeros(1, 1, dtype=torch.long, device=drafter.device),
                drafter.dtype,
                end=self.positions,
                signed=True,
            )
        self.calls = 0

    def warm_all(self, sampled: bool = False, rows: tuple[int, ...] = ()) -> dict:
        """Compile the graphs a run calls, greedy or ``sampled``: one row, batches of each of ``rows`` rows
        and of every count below the smallest of them (a batch's rows finish apart, and its last ones
        draft as a smaller batch). Returns what the eval report records."""
        counts = {*range(1, min(rows, default=1) + 1), *rows}
        for count in sorted(counts)[: torch._dynamo.config.recompile_limit]:  # Dynamo keeps that many graphs of a code
            self.warm(count, sampled)
        return {
            "graph": "decode" + (" + propose" if self.proposes else ""),
            "sampled_proposal": self.proposes_for(greedy=False),
            "cache_positions": self.positions,
            "rows": sorted(self.rows),
        }

    def warm(self, rows: int, sampled: bool) -> None:
        """Compile now the graph a greedy or ``sampled`` run of ``rows`` rows calls, by one draft over
        throwaway caches, so that no draft of the run pays for it."""
        drafter = self._drafter()
        cfg = drafter.config
        propose = self.proposes_for(greedy=not sampled)
        # as the loop drafts and makes its caches: inference tensors, as the guards see them
        with torch.inference_mode():
            cache = ContextCache(spare=self.block_size, capacity=self.positions)
            cache.start(rows)
            like = torch.zeros(
                rows, cfg.num_key_value_heads, 0, cfg.head_dim, dtype=drafter.dtype, device=drafter.device
            )
            cache.ensure(self.positions, like, len(drafter.layers))
            zeros = torch.zeros(rows, dtype=torch.long, device=drafter.device)
            features = like.new_zeros(rows, self.block_size, drafter.fc.in_features)
            self.run(zeros, torch.stack([zeros, zeros + 1], dim=1), features, cache, propose)
        self.rows.add(rows)
        self.calls = 0

    def proposes_for(self, greedy: bool) -> bool:
        """Whether the graph's proposal serves a step: greedy steps, and sampled ones of a drafter whose
        logits do not depend on the drafts before them (DFlash: its tokens are then drawn from the
        graph's logits). A sampled DSpark chain conditions on its own draws: the graph gives the block."""
        return self.proposes and (greedy or not self.conditional)

    def fits(self, cache: ContextCache, end: int, arriving: int) -> bool:
        """Whether a draft can be the graph's: ``cache``'s buffers of the graph's length, for as many rows
        as a graph compiled up front, at most K features ``arriving``, and room after the longest row's
        context (``end``, arrived features counted) for the block and the padding slot."""
        keys = cache.keys
        return (
            bool(keys)
            and keys[0].shape[0] in self.rows
            and keys[0].shape[2] == self.positions
            and arriving <= self.block_size
            and end + self.block_size < self.positions
        )

    def run(
        self, anchors: torch.Tensor, counts: torch.Tensor, features: torch.Tensor, cache: ContextCache, propose: bool
    ):
        """:func:`_draft` as the graph runs it, for ``R`` rows: :meth:`~drafters.BlockDrafter.decode`'s
        hidden states [R, 1, K, H] and, with ``propose``, the greedy proposal over them, as
        :meth:`~drafters.BlockDrafter.propose` gives it. ``features`` [R, K, F]: a buffer of their own (the
        graphs are compiled for its strides; a view's, even one torch calls contiguous, would not match).
        Inputs unlike the warm-up's (e.g. caches made outside inference mode) compile a graph of their own."""
        out = self.graph(self._drafter(), anchors, counts, features, cache, propose)
        self.calls += 1
        return out
