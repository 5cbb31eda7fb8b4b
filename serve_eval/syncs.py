"""Counting host synchronisations: every place Python reads a tensor's values.

On a GPU, the host queues kernels and runs ahead of them; reading a value (``.item()``, ``.tolist()``,
``if tensor:``, ``int(tensor)``), or an operation whose output shape depends on the data (``nonzero``,
boolean-mask indexing, ``unique``, ``masked_select``), waits for everything queued before it. A decoding
step that does that several times leaves the GPU idle between kernels it could have queued.

:class:`HostSyncs` counts those reads wherever the code runs, a CPU included (where they cost nothing,
so this is how the CPU tests prove the GPU path's count): a ``TorchFunctionMode`` sees every tensor
method and torch function Python calls. What it cannot see: a synchronisation inside an extension's C++,
and copies to the host (``.cpu()`` and ``.to("cpu")`` from a GPU tensor) where the tensor is on the CPU
already. A compiled graph (``fullgraph``: no Python runs inside it) is called :func:`uncounted`, so that
its guards see the mode stack it was compiled under and counting compiles nothing again.

:func:`syncs_per_step` measures the steady state: the count of a run of ``n`` steps and of ``2n``, their
difference over the steps between them, so that prefills and the final read of the tokens, paid once a
run, are not spread over its steps.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.argwhere,
    torch.argwhere,
    torch.Tensor.masked_select,
    torch.masked_select,
    torch.Tensor.unique,
    torch.unique,
    torch.Tensor.unique_consecutive,
    torch.unique_consecutive,
}
_COPIES = {torch.Tensor.cpu, torch.Tensor.to}


def _reads_data(func, args, kwargs) -> bool:
    """Whether a call of ``func`` waits for the device: a value read, a data-dependent shape, a copy to the host."""
    if func in _READS:
        return True
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):  # boolean-mask indexing: nonzero inside
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    if func in (torch.Tensor.repeat_interleave, torch.repeat_interleave):  # tensor repeats: output size from data
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if func in _COPIES and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
        if func is torch.Tensor.cpu:
            return True
        target = args[1] if len(args) > 1 else kwargs.get("device")
        return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
    return False


class HostSyncs(TorchFunctionMode):
    """Within ``with HostSyncs() as syncs:``, ``syncs.count`` host reads so far and ``syncs.by_call`` the
    count per function name (what to look at when a count is too high)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.by_call: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_data(func, args, kwargs):
            self.count += 1
            self.by_call[getattr(func, "__name__", str(func))] += 1
        return func(*args, **kwargs)


def syncs_per_step(run: Callable[[int], int], tokens: int = 16) -> float:
    """Host reads per decoding step in the steady state: ``run(max_new_tokens)`` decodes and returns how
    many target steps it took (after the prefill); measured at ``tokens`` and ``2 * tokens`` new tokens,
    the difference in reads over the difference in steps (see the module docstring)."""
    counts, steps = [], []
    for n in (tokens, 2 * tokens):
        with HostSyncs() as syncs:
            steps.append(run(n))
        counts.append(syncs.count)
    if steps[1] == steps[0]:
        return float(counts[1] - counts[0])
    return (counts[1] - counts[0]) / (steps[1] - steps[0])


@contextlib.contextmanager
def uncounted():
    """Within: calls are not counted (a whole compiled graph, which reads nothing into Python), and a
    compiled function sees the mode stack without the counter (its guards check that stack)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if stack and isinstance(stack[-1], HostSyncs):
        with torch.overrides._pop_mode_temporarily():
            yield
    else:
        yield
