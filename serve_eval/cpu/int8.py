"""Int8 weights for the drafter while it drafts, on the CPU (``decoding.cpu.int8``).

A Linear ``y = x W^T + b`` (``W``: out x in) is served from integer codes:

* weights, once, per output channel ``o``: ``s_o = max_i |W_oi| / 127``, codes ``C_oi = round(W_oi / s_o)``
  in [-127, 127];
* activations, every call, per row ``r`` (a token): ``a_r = max_i |x_ri| / 127``, ``X_ri = round(x_ri / a_r)``
  (``/ 63`` on the AVX2 kernel, see below);
* ``y_ro = ((S_ro a_r) s_o) + b_o`` with ``S_ro = sum_i X_ri C_oi`` exact in int32 (``|S| <= in * 127^2 < 2^31``
  for ``in`` below 133,000), so the only errors are the two roundings, at most half a step of each factor,
  and a row's outputs do not depend on the rows beside it.

Kernels, the first that serves here:

* ``draftsmith_int8::linear`` (:file:`int8_op.cpp`, built once per machine by :mod:`serve_eval.cpu.native`,
  ~20 s): the codes in panels of 16 outputs x 4 inputs, prefetched into L2 as they stream, rows in tiles whose
  sums stay in registers; a row of zeros (the padding rows of a compiled draft's arriving features) is
  not multiplied. On AVX-512 VNNI (``vpdpbusd``, 64 products an instruction) it computes exactly the
  bits ``torch._int_mm`` computes from the same codes. On AVX2 alone the activations are 7-bit
  (``/ 63``, as fbgemm's AVX2 kernels take them): ``vpmaddubsw``'s 16-bit pair sums then cannot
  saturate, where 8 bits would need the sign moved onto the weights row by row (half again the
  time); the rounding error doubles (0.8% -> 1.5% of the output's norm on random rows). The report's ``drafter_int8.kernel`` names the instruction set;
* ``torch._int_mm`` (codes stored transposed, in x out) where it cannot be built (no compiler, not x86).

Losslessness does not depend on any of it: the loop verifies with the full-precision target, and the
int8 drafter is simply another drafter whose proposals (its ``q``) are what both drafting and the
acceptance test read. Greedy output and the sampled distribution stay exactly the target's; only tau
and the drafting time can move, and the report measures both.

Why here: a drafter's cost on a CPU is reading its weights (the 4,096 x 320 LM head of the testbed
is 5.2 MB in fp32, most of the drafter) and int8 codes are a quarter of that. The weights come from
memory at every draft (the target's forward has streamed through the caches in between), so the
kernel prefetches them ahead of the products. The kernels' times against fbgemm's dynamic int8 GEMM,
``torch._int_mm`` and torchao's int8 configurations are on the benchmarks page (docs/benchmarks.md).

The operator takes plain tensors, so a compiled draft (:mod:`serve_eval.cpu.compiled`) holds it in its
graph like any ATen operator (a shape function is registered). On a GPU the drafter runs in the
target's bf16 and this is refused.

``which``: ``head`` converts the projections onto the vocabulary (``lm_head``, DSpark's ``markov_out``),
the largest weights by far; ``all`` every Linear.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from drafters.vocab import VOCAB_HEADS, CandidateHead, RestrictedHead, over_vocab

from . import native


def _codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 codes, transposed (in x out), and their scales (out)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return torch.round(w / scale[:, None]).to(torch.int8).T.contiguous(), scale


_SOURCE = Path(__file__).with_name("int8_op.cpp")


@functools.cache
def native_op() -> str | None:
    """The instruction set ``draftsmith_int8::linear`` (:file:`int8_op.cpp`) runs on here (``avx512-vnni``,
    ``avx2``), or None where it cannot be built (not an x86 CPU with AVX2, no compiler: ``torch._int_mm`` serves)."""
    # its scalings rounded one by one, as torch's
    if not native.avx2_operator(
        _SOURCE, "serve_eval.cpu.int8: the C++ int8 operator", "torch._int_mm", ("-ffp-contract=off",)
    ):
        return None
    torch.library.register_fake("draftsmith_int8::linear", _fake)
    return torch.ops.draftsmith_int8.allow_vnni(True)


def _fake(rows, packed, colsum, scale, bias, out_features):
    return rows.new_empty(*rows.shape[:-1], out_features)


class Int8Linear(nn.Module):
    """``x W^T + b`` from int8 weight codes and int8 activations (see the module docstring), on
    ``draftsmith_int8::linear`` where it builds (``kernel``: its instruction set), else ``int_mm``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: str = "auto"):
        super().__init__()
        codes, scale = _codes(weight)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        isa = native_op() if kernel == "auto" else None
        self.kernel = isa or "int_mm"
        if isa is not None:
            self.register_buffer("panels", torch.ops.draftsmith_int8.pack(codes.T.contiguous()))
            self.register_buffer("colsum", codes.sum(0, dtype=torch.int32))

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: str = "auto") -> Int8Linear:
        return cls(linear.weight, linear.bias, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dtype == torch.float32 else x.float()
        if self.kernel != "int_mm":
            y = torch.ops.draftsmith_int8.linear(
                rows, self.panels, self.colsum, self.scale, self.bias, self.out_features
            )
        else:
            rows = rows.reshape(-1, x.shape[-1])
            step = rows.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny).div_(127)
            y = torch._int_mm(torch.round(rows / step).to(torch.int8), self.codes).float().mul_(step).mul_(self.scale)
            if self.bias is not None:
                y += self.bias
            y = y.view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)


class Int8RestrictedHead(Int8Linear):
    """A :class:`drafters.vocab.RestrictedHead` in int8: codes for the draft vocabulary's rows only, the
    logits scattered back over the whole vocabulary with the head's ``fill`` elsewhere."""

    def __init__(self, head: RestrictedHead):
        super().__init__(head.rows)
        self.vocab_size, self.fill = head.out_features, head.fill
        self.register_buffer("ids", head.ids.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return over_vocab(super().forward(x), self.ids, self.vocab_size, self.fill)


def resolve(setting: str, device: str, drafter_is_target: bool) -> str:
    """What ``decoding.cpu.int8`` means here: ``auto`` is ``all`` on the CPU, ``off`` on a GPU or for a
    target drafting for itself; ``head`` / ``all`` on a GPU are a ValueError (the kernels are the CPU's)."""
    if setting == "auto":
        return "all" if device == "cpu" and not drafter_is_target else "off"
    if setting != "off" and device != "cpu":
        raise ValueError(
            f"decoding.cpu.int8 = {setting!r} serves a drafter's weights in int8 on the CPU "
            f"(serve_eval.cpu.int8); on {device} the drafter runs in the target's dtype (auto or off)"
        )
    return setting


def int8_drafter(drafter: nn.Module, which: str) -> dict:
    """Replace the drafter's Linears (``which``: ``head``, the heads onto the vocabulary, or ``all``) by
    int8 ones, in place, after any draft-vocabulary restriction. Returns what the report records:
    which, how many Linears, the bytes of their weights before (as loaded) and after (codes + scales),
    and the kernel that serves them (``avx512-vnni`` / ``avx2``: ours, :file:`int8_op.cpp`; ``int_mm``)."""
    if which not in ("head", "all"):
        raise ValueError(f"drafter_int8: 'head' or 'all', got {which!r}")
    converted, before, after, kernels = 0, 0, 0, set()
    for parent in list(drafter.modules()):
        for name, child in list(parent.named_children()):
            if (
                not isinstance(child, nn.Linear)
                or isinstance(child, CandidateHead)  # a per-step head keeps its rows
                or (which == "head" and name not in VOCAB_HEADS)
            ):
                continue
            restricted = isinstance(child, RestrictedHead)
            weight = child.rows if restricted else child.weight
            int8 = Int8RestrictedHead(child) if restricted else Int8Linear(weight, child.bias)
            setattr(parent, name, int8)
            converted += 1
            kernels.add(int8.kernel)
            before += weight.numel() * weight.element_size()
            after += int8.codes.numel() + int8.scale.numel() * int8.scale.element_size()
    if not converted:
        raise ValueError(f"drafter_int8 = {which!r}: the drafter has no Linear of that kind")
    return {
        "which": which,
        "linears": converted,
        "weight_bytes": before,
        "int8_bytes": after,
        "kernel": "/".join(sorted(kernels)),
    }
