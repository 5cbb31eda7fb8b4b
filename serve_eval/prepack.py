"""The target's Linears served from weights prepacked once for oneDNN, on the CPU (``decoding.prepack``).

A Linear ``y = x W^T + b`` computes the same fp32 products either way; what changes is the kernel.
torch's default CPU path (``F.linear`` -> MKL ``sgemm``) reads ``W`` in its stored row-major layout
and, for more than one row of ``x``, repacks it into the kernel's panel layout on every call: the
weight crosses the memory bus about twice. A decode step of the testbed target reads its 45 MB of
weights (more than the 32 MB L3) once per forward, so that repacking is most of what verifying 8
tokens costs beyond verifying 1. oneDNN's weight reorder (``torch.ops.mkldnn._reorder_linear_weight``,
done once here) stores ``W`` in the blocked layout its kernel reads directly
(``torch.ops.mkldnn._linear_pointwise``): a forward over 8 rows then costs what a forward over 1
row does, because both are the time to stream the weights once.

Measured on this CPU (1 thread, the target's 57 Linears in turn, the median of 9 passes):
``F.linear`` 6.2-6.8 ms at 1 row, 10.6-10.7 ms at 8; prepacked 5.1-6.5 ms at 1 row, 6.1-6.7 ms at 8.
Through the whole target (``measure_verify_costs``, three alternated rounds) a forward over 8 new
tokens cost 1.18-1.49 forwards over 1 with ``F.linear`` and 0.93-1.03 prepacked.

Invariants:

* Both loops decode with the same target object, so plain decoding gets the faster kernel too and
  the speedups stay honest; the report records the setting.
* Losslessness does not depend on the kernel: the loop verifies with the target it is given and
  plain decoding is measured with that same target. The logits differ from ``F.linear``'s by the
  summation order only (|difference| <= 2e-5 on the testbed target's logits).
* Only fp32 Linears on the CPU: oneDNN's fp32 CPU kernel is what was measured; a GPU keeps its own
  kernels and ``on`` there is refused. The original weight Parameters stay referenced (``weight``,
  ``bias``), so anything that reads them (a drafter sharing the target's head) reads the same bytes.

These are the private ops torch's own compiler (inductor's CPU freezing pass) emits for a frozen
fp32 Linear; there is no public eager API for them (``torch.utils.mkldnn.to_mkldnn`` converts every
input and output to oneDNN's tensor type at each call). Where a torch build lacks them, ``auto``
leaves the target as it is and the report says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def available() -> bool:
    """Whether this torch has oneDNN's CPU Linear ops."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class PrepackedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` by oneDNN's kernel from ``weight`` reordered once (see the module docstring)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: nothing that reads them changes
        self.packed = _pack(linear.weight)

    def __getstate__(self):  # oneDNN's blocked tensor has no storage to pickle or copy: rebuilt from the weight
        return {k: v for k, v in self.__dict__.items() if k != "packed"}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.packed = _pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # the packed op has no backward
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None if self.bias is None else self.bias.detach(),
                                                  "none", [], "")


def resolve(setting: str, device: str) -> str:
    """What ``decoding.prepack`` means here: ``auto`` is ``on`` on the CPU where this torch has the ops,
    else ``off``; ``on`` on a GPU or without the ops is a ValueError."""
    if setting == "auto":
        return "on" if device == "cpu" and available() else "off"
    if setting == "on" and device != "cpu":
        raise ValueError(f"decoding.prepack = 'on' serves the target's Linears from oneDNN's CPU kernel; on {device} "
                         f"the target keeps its own kernels (auto or off)")
    if setting == "on" and not available():
        raise ValueError("decoding.prepack = 'on': this torch build has no oneDNN Linear ops "
                         "(torch.ops.mkldnn._linear_pointwise); use auto or off")
    return setting


def prepack_linears(model: nn.Module) -> dict:
    """Replace every fp32 ``nn.Linear`` of ``model`` by a :class:`PrepackedLinear`, in place. Returns what
    the report records: how many Linears and the bytes of their weights."""
    converted, nbytes = 0, 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(parent, name, PrepackedLinear(child))
                converted += 1
                nbytes += child.weight.numel() * child.weight.element_size()
    return {"kernel": "onednn", "linears": converted, "weight_bytes": nbytes}
