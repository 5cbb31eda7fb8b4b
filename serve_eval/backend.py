"""Where device-specific acceleration plugs into the decoding loop (``decoding.backend``).

The loop asks its backend for four things and nothing else:

* :meth:`Backend.target_forward`: the target's step (:class:`~serve_eval.forward.TargetForward`);
* :meth:`Backend.draft_graph`: a block drafter's compiled draft, or None (the drafter's eager forward);
* :meth:`Backend.skip_rows`: a context in which the target's Linears may skip a batch's padding rows;
* :meth:`Backend.top_tokens`: greedy tokens and their probability (``torch.argmax``'s tokens, always).

and a recipe asks it once, before a run, to :meth:`~Backend.prepare` both models (in place) and say what
it did. :class:`Backend` is the generic backend: plain torch and transformers, what a GPU runs, and
tested lossless on the CPU too. :class:`serve_eval.cpu.CpuBackend` serves the same loop from the CPU
kernels. Whatever the backend, plain and speculative decoding run the same target forward, so a
speedup compares like with like, and every choice a backend makes changes rounding at most: the loop
verifies against the target as it is served, so it stays lossless.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from .forward import TargetForward
from .sampling import top_tokens

if TYPE_CHECKING:
    from .cpu.compiled import CompiledDraft

BACKENDS = ("auto", "torch", "static", "cpu")


class Backend:
    """The generic backend: the model's own forward, eager drafts, every padding row computed."""

    name = "torch"
    static = False  # whether the loop runs the static-shape step (serve_eval.static)

    def prepare(
        self, target, drafter, prompts=(), max_new_tokens: int = 0, sampled: bool = False, rows: tuple[int, ...] = ()
    ) -> dict:
        """Ready ``target`` and ``drafter`` for decoding ``prompts`` with ``max_new_tokens`` new tokens
        (greedy or ``sampled``, one row and batches of ``rows``). Returns what a report records."""
        return {"backend": self.name, "target_forward": "the model's own"}

    def target_forward(self, target, capture=None) -> TargetForward:
        return TargetForward(target, capture)

    def draft_graph(self, drafter) -> CompiledDraft | None:
        """The compiled draft :meth:`prepare` built for ``drafter`` (a
        :class:`~serve_eval.cpu.compiled.CompiledDraft`), or None: the drafter drafts eagerly."""
        return None

    def compiled_graphs(self) -> dict | None:
        """The graphs compiled so far per function, where the backend compiles them (None: it does not)."""
        return None

    def top_tokens(self, logits: torch.Tensor, with_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's greedy token over ``logits`` [..., V] and, ``with_prob``, its softmax probability
        (:func:`serve_eval.sampling.top_tokens`; a backend may compute them faster, never differently)."""
        return top_tokens(logits, with_prob)

    def skip_rows(self, rows: torch.Tensor, total: int):
        """A context within which a forward over ``total`` flattened rows need compute only ``rows``
        (the others are a batch's padding, whose outputs nothing reads; they must stay finite)."""
        return contextlib.nullcontext()


TORCH = Backend()


def backend_for(
    setting: str,
    device,
    drafter=None,
    drafter_is_target: bool = False,
    static: dict | None = None,
    static_refusal: str | None = None,
    **cpu,
) -> Backend:
    """The backend ``decoding.backend`` names on ``device``: ``auto`` is ``cpu`` on a CPU device, and
    elsewhere ``static`` unless ``static_refusal`` says why the static step cannot serve the run (then
    ``torch``); ``cpu`` on another device is a ValueError naming the key. ``static``: the static backend's
    settings (``decoding.static``: ``compile``, ``buckets``); ``cpu``: the CPU backend's (``decoding.cpu``:
    ``int8``, ``prepack``, ``compile``), resolved for ``drafter``."""
    if setting not in BACKENDS:
        raise ValueError(f"decoding.backend = {setting!r}: expected one of {', '.join(BACKENDS)}")
    device = torch.device(device).type
    if setting == "cpu" and device != "cpu":
        raise ValueError(
            f"decoding.backend = 'cpu' serves the loop from CPU kernels; the models are on {device} (use auto or torch)"
        )
    if setting == "static" or (setting == "auto" and device != "cpu" and static_refusal is None):
        if static_refusal is not None:
            raise ValueError(f"decoding.backend = 'static': {static_refusal}")
        from .static import StaticBackend

        return StaticBackend(**(static or {}))
    if setting == "torch" or (setting == "auto" and device != "cpu"):
        return TORCH
    from .cpu import CpuBackend

    return CpuBackend(drafter, drafter_is_target, **cpu)


def decoding_backend(dec, device, drafter, drafter_is_target: bool = False) -> Backend:
    """:func:`backend_for` as a recipe's ``decoding`` section (:class:`distill.base.decoding.DecodingSection`)
    sets it up for ``drafter`` on ``device``."""
    from .static import serves

    return backend_for(
        dec.backend,
        device,
        drafter,
        drafter_is_target,
        static={"compile": dec.static.compile, "buckets": tuple(dec.static.buckets)},
        static_refusal=dec.static_refusal(serves(drafter)),
        int8=dec.cpu.int8,
        prepack=dec.cpu.prepack,
        compile=dec.cpu.compile,
    )
