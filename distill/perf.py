"""Throughput accounting: the machine's measured matmul peak, and model FLOP utilisation (MFU).

MFU = (tokens/s * FLOPs per token) / (peak FLOP/s * processes). The peak is *measured* on the
machine at hand (best of a few large square matmuls in the training dtype), not taken from a data
sheet: on a 2-core CPU the data-sheet peak is meaningless, and on a GPU a measured bf16 peak is what
a well-tuned kernel can reach. The measurement is cached per (device, dtype, threads) for the
process, since it costs about a second, and the best value ever measured on this machine is kept in
``$DRAFTSMITH_CACHE/matmul_peak.json``: a measurement taken while another job shares the cores reads
low, and would inflate MFU.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time

import torch


@functools.cache
def measured_matmul_peak(device: str = "cpu", dtype: torch.dtype = torch.float32, threads: int | None = None) -> float:
    """Best achieved FLOP/s of an ``n x n @ n x n`` matmul on ``device`` (``threads`` is a cache key), at the
    size :func:`probe_size` settles on."""
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def seconds(n: int) -> float:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        torch.mm(a, b)
        sync()
        best = float("inf")
        for _ in range(3 if device == "cpu" else 10):
            t0 = time.perf_counter()
            torch.mm(a, b)
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    n, best = probe_size(seconds, 2048 if device == "cpu" else 8192)
    return _best_ever(f"{_device_name(device)}|{dtype}|threads={threads}", 2 * n**3 / best)


def probe_size(seconds, largest: int, smallest: int = 256, enough: float = 0.05) -> tuple[int, float]:
    """The matmul size to measure the peak at: doubled from ``smallest`` while one product takes under
    ``enough`` seconds, at most ``largest``. Large enough to run at the kernel's pace, small enough that a
    dtype without fast kernels here (bf16 on a CPU, where timing 2048^3 products would take minutes)
    costs a second. ``seconds(n)`` times one product of size ``n``; returns the size
    and its time."""
    n, took = smallest, seconds(smallest)
    while n < largest and took < enough:
        n *= 2
        took = seconds(n)
    return n, took


def _device_name(device: str) -> str:
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return " ".join(filter(None, [platform.machine(), platform.processor(), f"{os.cpu_count()} cores"]))


def _best_ever(key: str, measured: float) -> float:
    """``max(measured, every earlier measurement under key)``, remembered on disk (atomically)."""
    from .testbed import cache_dir

    path = cache_dir() / "matmul_peak.json"
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        known = {}
    best = max(measured, known.get(key, 0.0))
    if best != known.get(key):
        known[key] = best
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    return best


class Throughput:
    """Tokens/s over a sliding span of steps, and the MFU it implies."""

    def __init__(self, flops_per_token: float, peak_flops: float, processes: int = 1):
        self.flops_per_token = flops_per_token
        self.peak = peak_flops * processes
        self.tokens = 0
        self.seconds = 0.0
        self._t = None

    def start(self) -> None:
        self._t = time.perf_counter()

    def stop(self, tokens: int) -> None:
        self.seconds += time.perf_counter() - self._t
        self.tokens += tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mfu(self) -> float:
        return self.tokens_per_s * self.flops_per_token / self.peak if self.peak else 0.0
