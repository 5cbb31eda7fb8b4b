"""Int8 weights for the drafter while it drafts, on the CPU (``decoding.drafter_int8``).

A Linear ``y = x W^T + b`` (``W``: out x in) is served from integer codes:

* weights, once, per output channel ``o``: ``s_o = max_i |W_oi| / 127``, codes ``C_oi = round(W_oi / s_o)``
  in [-127, 127];
* activations, every call, in one of two kernels (the first where this torch has it):

  - fbgemm's dynamic int8 GEMM (``quantized::linear_dynamic``, the weight codes prepacked once), over
    the rows each divided by its largest magnitude ``m_r = max_i |x_ri|`` (and the outputs multiplied
    back): the kernel quantizes its whole input at one step ``a = (max(u, 0) - min(u, 0)) / 127 <= 2/127``
    with a zero point, 7-bit codes so its 16-bit pair sums cannot saturate, which after the row
    scaling is a step of ``a m_r`` for row ``r``. Without the row scaling (the kernel alone) one
    large row sets every row's step: on the shipped drafters' served states the drafts agreed with
    fp32's argmax 93% of the time with every Linear in int8, against 96-97% with it;
  - ATen's ``torch._int_mm`` (codes stored transposed, in x out): each row ``r`` (a token) at its own
    step ``a_r = max_i |x_ri| / 127``, ``X_ri = round(x_ri / a_r)``;

* ``y_ro = a_r s_o sum_i X_ri C_oi + b_o``: the sum is exact in int32 (``|sum| <= in * 127^2 < 2^31`` for
  ``in`` below 133,000), so the only errors are the two roundings, at most half a step of each factor.

Losslessness does not depend on any of it: the loop verifies with the full-precision target, and the
int8 drafter is simply another drafter whose proposals (its ``q``) are what both drafting and the
acceptance test read. Greedy output and the sampled distribution stay exactly the target's; only tau
and the drafting time can move, and the report measures both.

Why here: a drafter's cost on a CPU is reading its weights (the 4,096 x 320 LM head of the testbed
is 5.2 MB in fp32, most of the drafter) and int8 codes are a quarter of that. Measured on this CPU
(1 thread, 8 rows x 320 -> 4,096, the median of 1,000 calls): fp32 0.45-0.47 ms, ``torch._int_mm``
with its per-row quantization 0.22 ms, fbgemm 0.09-0.10 ms; 8 x 320 -> 960 (a layer's q, k and v):
0.092 / 0.069 / 0.034 ms. torchao's ``Int8DynamicActivationIntxWeightConfig`` (the project's ``8da8w``
scheme, :mod:`distill.quantize`) took 5.6 ms and ``Int8DynamicActivationInt8WeightConfig`` 0.79 ms
(a tensor subclass dispatched from Python at every call, with no fused CPU kernel for these shapes).
fbgemm's packed weights are made from a quantized tensor, a kind torch 2.13 deprecates (it warns,
naming no release for the removal): where it is gone, ``torch._int_mm`` serves, tested the same way.
On a GPU the drafter runs in the target's bf16 and this is refused.

A graph (:mod:`serve_eval.compiled`) cannot hold fbgemm's packed object, so the product is an operator
that names one Linear's packed weight by an integer key, and Dynamo keeps one graph through it and
fuses the row scaling around it. That operator is C++ (``draftsmith_int8::linear``, :file:`int8_op.cpp`,
built by :func:`native_op` once per machine, ~20 s, and kept in torch's extensions folder): it calls
exactly what ``quantized::linear_dynamic`` calls, from C++. Reaching an operator implemented in
Python costs ~20 µs a call, and so does handing fbgemm's packed object to ``linear_dynamic`` from
Python (it is converted at every call); the C++ operator is reached in ~12 µs where ``linear_dynamic``
took ~30 and the Python operator ~35 (8 x 320 -> 320, 1 thread, medians of 5,000 calls), and eager
Linears call it too. Where it cannot be built (no compiler), the Python operator
``draftsmith::int8_linear`` serves the graph and eager Linears call ``linear_dynamic``: the same
products, slower to reach (the report's ``drafter_int8.op`` says which).

``which``: ``head`` converts the projections onto the vocabulary (``lm_head``, DSpark's ``markov_out``),
the largest weights by far; ``all`` every Linear.
"""

from __future__ import annotations

import functools
import warnings
import weakref
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


def _fbgemm_pack(codes: torch.Tensor, scale: torch.Tensor):
    """fbgemm's prepacked weight holding exactly ``codes`` (in x out) and ``scale``, or None where this torch
    has no such kernel (see the module docstring)."""
    engines = torch.backends.quantized.supported_engines
    if not hasattr(torch, "_make_per_channel_quantized_tensor") or not {"fbgemm", "x86"} & set(engines):
        return None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
            weight = torch._make_per_channel_quantized_tensor(codes.T.contiguous(), scale.double(),
                                                              torch.zeros_like(scale, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(weight, None)  # the bias is added after the row scaling
    except (AttributeError, RuntimeError):
        return None


_SOURCE = Path(__file__).with_name("int8_op.cpp")


@functools.cache
def native_op():
    """``draftsmith_int8::linear`` (:file:`int8_op.cpp`), or None where it cannot be built here
    (built once per machine: :func:`serve_eval.native.load`)."""
    try:
        native.load(_SOURCE)
        torch.library.register_fake("draftsmith_int8::linear", _fake)
        return torch.ops.draftsmith_int8.linear.default
    except Exception as error:  # noqa: BLE001  (no compiler, a failed build: the Python operator serves)
        warnings.warn(f"serve_eval.int8: the C++ int8 operator could not be built ({type(error).__name__}: {error}); "
                      "the Python one serves, ~20 us slower a product", stacklevel=2)
        return None


def _fake(rows, key):
    return rows.new_empty(rows.shape[0], _LINEARS[key].out_features)


_LINEARS: "weakref.WeakValueDictionary[int, Int8Linear]" = weakref.WeakValueDictionary()
_OPS = torch.library.Library("draftsmith", "DEF")
_OPS.define("int8_linear(Tensor rows, int key) -> Tensor")
_OPS.impl("int8_linear", lambda rows, key: torch.ops.quantized.linear_dynamic(rows, _LINEARS[key].packed, True), "CPU")
torch.library.register_fake("draftsmith::int8_linear", _fake, lib=_OPS)


class Int8Linear(nn.Module):
    """``x W^T + b`` from int8 weight codes and int8 activations (see the module docstring):
    ``kernel`` ``fbgemm`` where this torch has it, else ``int_mm``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: str = "auto"):
        super().__init__()
        codes, scale = _codes(weight)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.packed = _fbgemm_pack(codes, scale) if kernel in ("auto", "fbgemm") else None
        if kernel == "fbgemm" and self.packed is None:
            raise RuntimeError("fbgemm's int8 kernel is not in this torch build")
        self.kernel = "int_mm" if self.packed is None else "fbgemm"
        self.native = None if self.packed is None else native_op()
        self.key = self._register()

    def _register(self) -> int:
        """This Linear's key for the int8 operators (its id: an entry lives as long as the module)."""
        key = id(self)
        _LINEARS[key] = self
        if self.native is not None:
            torch.ops.draftsmith_int8.put(key, self.packed)
            weakref.finalize(self, torch.ops.draftsmith_int8.drop, key)
        return key

    def __setstate__(self, state):  # a copy (deepcopy, unpickling) gets a key of its own
        super().__setstate__(state)
        self.key = self._register()

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: str = "auto") -> "Int8Linear":
        return cls(linear.weight, linear.bias, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (each operation counts: a drafter calls this a few times a token)
        if rows.dtype != torch.float32:
            rows = rows.float()
        peak = rows.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
        if self.packed is not None:  # rows scaled to peak 1; 7-bit activations (reduce_range)
            scaled = rows / peak
            if self.native is not None:
                y = self.native(scaled, self.key)
            elif torch.compiler.is_compiling():
                y = torch.ops.draftsmith.int8_linear(scaled, self.key)
            else:
                y = torch.ops.quantized.linear_dynamic(scaled, self.packed, True)
            y = y.mul_(peak)
        else:
            step = peak.div_(127)
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
    """What ``decoding.drafter_int8`` means here: ``auto`` is ``all`` on the CPU, ``off`` on a GPU or for a
    target drafting for itself; ``head`` / ``all`` on a GPU are a ValueError (the kernel is the CPU's)."""
    if setting == "auto":
        return "all" if device == "cpu" and not drafter_is_target else "off"
    if setting != "off" and device != "cpu":
        raise ValueError(f"decoding.drafter_int8 = {setting!r} serves a drafter's weights in int8 on the CPU "
                         f"(torch._int_mm); on {device} the drafter runs in the target's dtype (auto or off)")
    return setting


def int8_drafter(drafter: nn.Module, which: str) -> dict:
    """Replace the drafter's Linears (``which``: ``head``, the heads onto the vocabulary, or ``all``) by
    int8 ones, in place, after any draft-vocabulary restriction. Returns what the report records:
    which, how many Linears, the bytes of their weights before (as loaded) and after (codes + scales),
    the kernel that serves them and the operator that reaches it (``op``: ``c++``, ``python``; ``none``
    for ``torch._int_mm``)."""
    if which not in ("head", "all"):
        raise ValueError(f"drafter_int8: 'head' or 'all', got {which!r}")
    converted, before, after, kernels, ops = 0, 0, 0, set(), set()
    for parent in list(drafter.modules()):
        for name, child in list(parent.named_children()):
            if (not isinstance(child, nn.Linear) or isinstance(child, CandidateHead)  # a per-step head keeps its rows
                    or (which == "head" and name not in VOCAB_HEADS)):
                continue
            restricted = isinstance(child, RestrictedHead)
            weight = child.rows if restricted else child.weight
            int8 = Int8RestrictedHead(child) if restricted else Int8Linear(weight, child.bias)
            setattr(parent, name, int8)
            converted += 1
            kernels.add(int8.kernel)
            ops.add("none" if int8.packed is None else "c++" if int8.native is not None else "python")
            before += weight.numel() * weight.element_size()
            after += int8.codes.numel() + int8.scale.numel() * int8.scale.element_size()
    if not converted:
        raise ValueError(f"drafter_int8 = {which!r}: the drafter has no Linear of that kind")
    return {"which": which, "linears": converted, "weight_bytes": before, "int8_bytes": after, "kernel": "/".join(sorted(kernels)),
            "op": "/".join(sorted(ops))}
