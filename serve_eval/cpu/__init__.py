"""The CPU backend (``decoding.backend: cpu``, what ``auto`` picks on a CPU): the decoding loop served
from CPU kernels. Nothing here changes what the loop computes beyond rounding, and a GPU runs none of it.

* :mod:`.native`: builds the C++ operators once per machine and loads them;
* :mod:`.prepack` (``decoding.cpu.prepack``): the target's Linears from weights packed once for our
  AVX2 panel kernel (:file:`linear_op.cpp`) or oneDNN's; a batch's padding rows skipped;
* :mod:`.attention`: the target's (and a block drafter's) few-query attention on our kernel
  (:file:`attention_op.cpp`), served with the prepacked Linears;
* :mod:`.int8` (``decoding.cpu.int8``): the drafter's Linears from int8 codes (:file:`int8_op.cpp`);
* :mod:`.compiled` (``decoding.cpu.compile``): a block drafter's draft as one ``torch.compile`` graph;
* :mod:`.lean`: the target's forward walked without transformers' module machinery (Llama, Qwen3).
"""

from __future__ import annotations

import contextlib
import copy
import weakref

import torch

from ..backend import Backend
from ..forward import TargetForward
from .attention import top_tokens, use_attention
from .compiled import CompiledDraft
from .compiled import resolve as resolve_compile
from .int8 import int8_drafter
from .int8 import resolve as resolve_int8
from .lean import lean_forward
from .prepack import only_rows, prepack_linears
from .prepack import resolve as resolve_prepack


class CpuBackend(Backend):
    """The loop on the CPU kernels. The settings (``decoding.cpu``) are resolved when it is made, for
    ``drafter`` (``auto``: what serves here; a kernel asked for that cannot serve is a ValueError naming
    its key). ``lean``: step the target with :mod:`.lean`'s walk where it reproduces the model's forward
    (off: the model's own forward, for an A/B of the two)."""

    name = "cpu"

    def __init__(
        self,
        drafter=None,
        drafter_is_target: bool = False,
        int8: str = "auto",
        prepack: str = "auto",
        compile: str = "auto",
        lean: bool = True,
    ):
        self.int8 = resolve_int8(int8, "cpu", drafter_is_target)
        self.prepack = resolve_prepack(prepack, "cpu")
        self.compile = resolve_compile(compile, "cpu", drafter) if drafter is not None else "off"
        self.lean = lean
        self.graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> its CompiledDraft

    def prepare(
        self, target, drafter, prompts=(), max_new_tokens: int = 0, sampled: bool = False, rows: tuple[int, ...] = ()
    ) -> dict:
        """A block drafter's fused products, then int8 codes of the drafter's Linears, its draft compiled
        over them (for the longest prompt plus ``max_new_tokens``, one row and batches of ``rows``), and
        the target's Linears prepacked and, with them, its attention (and a block drafter's, before its
        draft is compiled: the graph traces what it calls) on our kernel."""
        import drafters

        block = drafters.is_block_drafter(drafter)
        if block:
            drafter.fuse_projections()
        positions = max((len(p.view(-1)) for p in prompts), default=0) + max_new_tokens
        record = {
            "backend": self.name,
            "drafter_int8": int8_drafter(drafter, self.int8) if self.int8 != "off" else "off",
            "draft_attention": use_attention(drafter) if self.prepack != "off" and block else "off",
        }
        record["draft_compiled"] = (
            self.compile_draft(drafter, positions, sampled, rows) if self.compile == "on" else "off"
        )
        record["target_prepack"] = prepack_linears(target, self.prepack) if self.prepack != "off" else "off"
        record["target_attention"] = use_attention(target) if self.prepack != "off" else "off"
        record["target_forward"] = "lean" if self.lean and lean_forward(target) is not None else "the model's own"
        return record

    def compile_draft(self, drafter, positions: int, sampled: bool = False, rows: tuple[int, ...] = ()) -> dict:
        """Compile ``drafter``'s draft (:class:`~.compiled.CompiledDraft`) for sequences of up to ``positions``
        tokens, greedy or ``sampled``, one row and batches of ``rows``; the loop drafts through it from now
        on. Call it once the drafter is ready to serve (fused products, int8 codes): the graph is traced
        over what it serves. Returns what the eval report records."""
        self.graphs[drafter] = graph = CompiledDraft(drafter, positions)
        return graph.warm_all(sampled, rows)

    def with_lean(self, lean: bool) -> CpuBackend:
        """This backend (its settings and compiled drafts) with the target's forward walked (``lean``) or not."""
        other = copy.copy(self)
        other.lean = lean
        return other

    def target_forward(self, target, capture=None) -> TargetForward:
        return TargetForward(target, capture, lean_forward(target) if self.lean else None)

    def draft_graph(self, drafter):
        try:
            return self.graphs.get(drafter)
        except TypeError:  # not weak-referenceable: never compiled
            return None

    def top_tokens(self, logits: torch.Tensor, with_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return top_tokens(logits, with_prob)

    def skip_rows(self, rows: torch.Tensor, total: int):
        return only_rows(rows, total) if self.prepack == "panels" else contextlib.nullcontext()
