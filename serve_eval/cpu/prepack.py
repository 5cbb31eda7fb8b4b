"""The target's Linears served from weights prepacked once, on the CPU (``decoding.cpu.prepack``).

A Linear ``y = x W^T + b`` computes the same fp32 products whichever kernel runs it; what changes is how
fast. A decode step of the testbed target reads its 45 MB of weights (more than the 32 MB L3) once per
forward for 1 to 8 rows of ``x``: the time to stream the weights is the floor, and a kernel that
reaches it makes verifying 8 tokens cost little more than decoding 1. Two kernels, the first that
this machine has:

* ``panels`` (:file:`linear_op.cpp`, ``draftsmith_fp32::linear``): the weight repacked once into
  panels of 16 output columns, each streamed once per forward while tiles of up to 6 rows accumulate
  in registers (12 FMAs per two weight loads); the last one or two rows of a taller call run across
  two or four panels at once (eight FMA chains, not two or four waiting on their latency). The
  stream's software prefetch follows the tile's height: none for one or two rows (the hardware
  prefetcher keeps up), 16 KB ahead into L2 for four to six, so that a tile's FMAs overlap the stream
  instead of taking turns with it: verifying five or six tokens costs what decoding one does.
  Where the target's weights exceed the last-level cache (the testbed's 45 MB against a 32 MB L3),
  one- and two-row products (plain decoding's) prefetch them non-temporally, a few lines ahead, so
  that streaming them evicts nothing: the KV cache and the step's small tensors stay cached from one
  forward to the next (taller tiles keep their L2 prefetch).
  A weight whose every value is an fp16 one (a checkpoint saved in fp16 and served in fp32, as the
  testbed target is) is packed in fp16 and widened to fp32 in registers: the same products and bits
  from half the bytes (the testbed target's 45 MB become 22.5, which stay in a 32 MB L3).
  Every output is the same FMA chain over the inputs in
  order, so a row's result does not depend on how many rows share the call: a token verified among
  eight gets the bits it gets decoded alone. For more than ``PANEL_ROWS`` rows (a long prompt's
  prefill) ``F.linear``'s blocked GEMM, which reads each input row once per block, serves instead.
  Built once per machine (:mod:`serve_eval.cpu.native`, ~20 s) where the CPU has AVX2 and FMA and a C++
  compiler is at hand.
* ``onednn``: oneDNN's weight reorder (``torch.ops.mkldnn._reorder_linear_weight``, once) and its
  kernel (``torch.ops.mkldnn._linear_pointwise``), the private ops torch's own compiler (inductor's CPU
  freezing pass) emits for a frozen fp32 Linear. ``F.linear`` (MKL ``sgemm``) repacks ``W`` into its
  panel layout on every call for more than one row, so the weight crosses the memory bus about twice.

``python -m recipes.bench_linears`` times the kernels on the testbed target's Linears; the numbers are on
[the benchmarks page](docs/benchmarks.md).

Invariants:

* Both loops decode with the same target object, so plain decoding gets the faster kernel too and
  the speedups stay honest; the report records the kernel.
* Losslessness does not depend on the kernel: the loop verifies with the target it is given and
  plain decoding is measured with that same target. The logits differ from ``F.linear``'s by the
  summation order only (|difference| <= 2e-5 on the testbed target's logits).
* Only fp32 Linears on the CPU; a GPU keeps its own kernels and ``on`` there is refused. The original
  weight Parameters stay referenced (``weight``, ``bias``), so anything that reads them (a drafter
  sharing the target's head) reads the same bytes; where gradients flow, ``F.linear`` computes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import native

#: beyond this many rows (a long prompt's prefill) F.linear's blocked GEMM serves, which reads each input
#: row once per block of columns where the panels read it once per 16 (measured up to here: 256 rows of the
#: testbed target's Linears, panels 65.7 ms against oneDNN's 73.5)
PANEL_ROWS = 256
_SOURCE = Path(__file__).with_name("linear_op.cpp")
#: (row indices, rows in all) while :func:`only_rows` is in force
_ONLY: contextvars.ContextVar[tuple[torch.Tensor, int] | None] = contextvars.ContextVar("only_rows", default=None)


@contextlib.contextmanager
def only_rows(rows: torch.Tensor, total: int):
    """Within: the panel kernel computes only rows ``rows`` (int64 indices into the flattened leading
    dimensions) of any input with ``total`` rows, and returns 0 in the others (a batch's padding, whose
    outputs nothing reads: :mod:`serve_eval.session`). Other kernels, and inputs of another size,
    compute every row; either way the listed rows get the same bits."""
    token = _ONLY.set((rows, total))
    try:
        yield
    finally:
        _ONLY.reset(token)


@functools.cache
def panels_available() -> bool:
    """Whether ``draftsmith_fp32`` runs here: an x86 CPU with AVX2 and FMA, and the operator built."""
    return native.avx2_operator(
        _SOURCE, "serve_eval.cpu.prepack: the C++ fp32 operator", "oneDNN's kernel", ("-mf16c",)
    )


def onednn_available() -> bool:
    """Whether this torch has oneDNN's CPU Linear ops."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


#: the kernels in order of preference, with what each needs where it does not serve
_NEEDS = {
    "panels": "an x86 CPU with AVX2 and a C++ compiler (the C++ fp32 operator)",
    "onednn": "a torch build with oneDNN's Linear ops (torch.ops.mkldnn._linear_pointwise)",
}


def _serves(kernel: str) -> bool:
    return panels_available() if kernel == "panels" else onednn_available()


def available() -> bool:
    """Whether either kernel serves here."""
    return any(map(_serves, _NEEDS))


class PrepackedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` from ``weight`` repacked once for ``kernel`` (``panels`` or
    ``onednn``; see the module docstring)."""

    def __init__(self, linear: nn.Linear, kernel: str = "panels", stream: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: nothing that reads them changes
        self.kernel = kernel
        self.stream = stream  # one- and two-row products stream the weight past the caches (linear_op.cpp)
        self._pack()

    def _pack(self) -> None:
        weight = self.weight.detach()
        if self.kernel == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        elif panels_available():  # (loads the operator: a copy unpickled in another process needs it too)
            # fp16 panels where every value is an fp16 one (a checkpoint saved in fp16): the same products from half the bytes
            exact = torch.equal(weight.half().float(), weight)
            self.packed = (torch.ops.draftsmith_fp32.pack_half if exact else torch.ops.draftsmith_fp32.pack)(weight)
        else:
            raise RuntimeError(
                f"serve_eval.cpu.prepack: the panel kernel does not serve here: it needs {_NEEDS['panels']}"
            )

    def __getstate__(self):  # derived from the weight (oneDNN's blocked tensor has no storage to pickle): rebuilt
        return {k: v for k, v in self.__dict__.items() if k != "packed"}

    def __setstate__(self, state):
        super().__setstate__(state)
        self._pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # the packed ops have no backward
        bias = None if self.bias is None else self.bias.detach()
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        if x.numel() > PANEL_ROWS * self.in_features:
            return F.linear(x, self.weight.detach(), bias)
        only = _ONLY.get()
        rows = only[0] if only is not None and x.numel() == only[1] * self.in_features else None
        return torch.ops.draftsmith_fp32.linear(x, self.packed, self.out_features, bias, rows, self.stream)


def resolve(setting: str, device: str) -> str:
    """The kernel ``decoding.cpu.prepack`` names here (``panels``, ``onednn``) or ``off``: ``auto`` is ``on``
    on the CPU and ``off`` elsewhere; ``on`` the first kernel that serves (``off`` under ``auto`` where
    none does). A kernel on a GPU, or one that does not serve here, is a ValueError."""
    if setting == "auto":
        if device != "cpu":
            return "off"
        setting = "on" if available() else "off"
    if setting == "off":
        return "off"
    if device != "cpu":
        raise ValueError(
            f"decoding.cpu.prepack = '{setting}' serves the target's Linears from CPU kernels; on {device} "
            f"the target keeps its own kernels (auto or off)"
        )
    kernels = list(_NEEDS) if setting == "on" else [setting]
    for kernel in kernels:
        if _serves(kernel):
            return kernel
    raise ValueError(
        f"decoding.cpu.prepack = '{setting}': "
        + ("neither kernel serves here: " if setting == "on" else "needs ")
        + " / ".join(_NEEDS[k] for k in kernels)
        + "; use auto or off"
    )


def last_level_cache_bytes() -> int | None:
    """The size of this CPU's last-level cache (Linux's sysfs; None where it does not say)."""
    sizes = {}
    for folder in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((folder / "level").read_text()), (folder / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        if size.rstrip("KMG").isdigit():
            sizes[level] = int(size.rstrip("KMG")) * scale
    return sizes[max(sizes)] if sizes else None


def prepack_linears(model: nn.Module, kernel: str = "on") -> dict:
    """Replace every fp32 CPU ``nn.Linear`` of ``model`` by a :class:`PrepackedLinear`, in place, with
    ``kernel`` (``on``: the first that serves, as :func:`resolve` chooses). Where their weights together
    exceed the last-level cache, one- and two-row products stream them past the caches (``stream``,
    :file:`linear_op.cpp`): each forward would only evict the rest of the step's data for weights that
    cannot stay cached anyway. Weights whose values are all fp16 ones are packed in fp16 (the same
    products from half the bytes). Returns what the report records: the kernel, how many Linears, the
    bytes of their weights (and of the panels, how many in fp16) and whether they stream."""
    kernel = resolve(kernel, "cpu")
    linears = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"
    ]
    nbytes = sum(child.weight.numel() * child.weight.element_size() for *_, child in linears)
    packed = [PrepackedLinear(child, kernel) for *_, child in linears]
    record = {"kernel": kernel, "linears": len(linears), "weight_bytes": nbytes, "streamed": False}
    if kernel == "panels":  # what a forward streams: the panels, fp16 where the values allow
        served, cache = sum(p.packed.numel() * p.packed.element_size() for p in packed), last_level_cache_bytes()
        record.update(
            panel_bytes=served,
            fp16_panels=sum(p.packed.dtype == torch.float16 for p in packed),
            streamed=cache is not None and served > cache,
        )
    for (parent, name, _), linear in zip(linears, packed):
        linear.stream = record["streamed"]
        setattr(parent, name, linear)
    return record
