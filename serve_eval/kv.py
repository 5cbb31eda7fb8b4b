"""The target's KV cache: written in place, optionally quantized.

transformers' ``DynamicLayer`` appends each forward's keys and values with ``torch.cat``, which copies
the whole cache every step. :class:`InPlaceLayer` keeps each layer's keys and values in a buffer that
grows by doubling (:func:`drafters.cache.grown`: amortised O(1) copies per token), writes new entries in place and hands attention a view
of the filled part; ``crop`` only moves the length. Everything else (masks, ``get_seq_length``, row
selection) is ``DynamicLayer``'s contract, so it drops into any transformers model that builds a
``DynamicCache``.

Invariant: ``keys`` / ``values`` are always ``buffer[:, :, :length]``, so a cache that was appended,
cropped, row-selected and appended again holds exactly what a ``DynamicCache`` given the same calls
holds (tested).

**A batch's rows** (:mod:`serve_eval.session`) drift apart in length. With ``write_at`` set
(:class:`RowWrites`: ``starts``, ``end``), an update writes row ``r``'s entries at its own slots ``starts[r], starts[r] + 1, ...`` and
attention sees the slots up to ``end``: every row keeps its entries contiguous from slot 0, and the
batch's mask hides what lies past them (a rejected draft, a former row's entries, or zeros: buffers
grow zero-filled, because a masked slot's weight is zero and ``0 * NaN`` would not be).

**Quantized** (:class:`QuantizedLayer`, ``KVQuant``): every key and value vector ``x`` (one token, one
head, ``D`` channels) is stored as codes plus one fp16 scale per group of ``G`` channels:

- int8: ``s = max|x_g| / 127``, ``c = round(x / s)``; fp8: ``s = max|x_g| / 448``, ``c = e4m3(x / s)``;
- groups of ``G = gcd(32, D)`` channels;
- int4: ``m = min x_g``, ``s = (max x_g - m) / 15``, ``c = round((x - m) / s)``, two codes a byte;
- ``rotate``: quantize ``x R`` and read ``deQ(Q(x R)) Rᵀ`` for a fixed random orthogonal ``R``. An
  outlier channel (keys have them) is spread over all channels, so the group maxima, and with them
  the rounding steps, shrink (the incoherence trick of QuaRot and TurboQuant).

Attention reads every position, the ones it is writing included, through ``deQ(Q(.))``, one token at a
time: what a position contributes does not depend on which forward wrote it or with which others.
So a quantized target is one fixed model, whether it reads one token a step (plain decoding) or a
block or a tree (speculative decoding): the loop with a quantized cache emits exactly what plain
decoding with the same quantized cache emits (tested), and what quantization costs in quality is
measured against the full-precision target apart (``recipes/evaluate.py``, ``kv_quality``).

This is our own and not transformers' ``QuantizedCache``: its layers cannot be cropped (a speculative
loop rolls back every step), and its KIVI-style residual window re-quantizes tokens in bulk, so what
a position holds would depend on how the tokens were chunked. The cost here: attention reads a
dequantized float copy of the layer's cache every forward (made, used, freed; only the codes stay),
where a GPU kernel would read the codes directly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from drafters.cache import grown

KV_FORMATS = ("full", "int8", "fp8", "int4")


@dataclass(frozen=True)
class KVQuant:
    """How the target stores keys and values (the module docstring gives the math): ``format`` int8,
    fp8 or int4; one scale per ``group`` channels; ``rotate`` by a fixed random orthogonal matrix."""

    format: str = "int8"
    group: int = 32
    rotate: bool = False

    def __post_init__(self):
        if self.format not in KV_FORMATS[1:]:
            raise ValueError(f"KV format {self.format!r}: expected one of {KV_FORMATS[1:]}")


def kv_quant(format: str, rotate: bool = False) -> KVQuant | None:
    """``None`` for ``"full"`` (the model's own dtype), else the quantized format."""
    return None if format == "full" else KVQuant(format, rotate=rotate)


@functools.lru_cache(maxsize=8)
def rotation(dim: int) -> torch.Tensor:
    """A fixed random orthogonal ``dim`` x ``dim`` matrix (QR of a seeded Gaussian, signs fixed): the
    same for every layer, process and machine; computed once per ``dim`` (read-only, shared)."""
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def quantize(x: torch.Tensor, spec: KVQuant) -> list[torch.Tensor]:
    """``x`` [..., D] -> what is stored: codes [..., D] (int4: [..., D / 2]), fp16 scales [..., D / G]
    and, for int4, fp16 minima [..., D / G]."""
    g = x.float().unflatten(-1, (-1, spec.group))  # [..., D / G, G]
    if spec.format == "int4":
        lo = g.amin(-1, keepdim=True).half()
        scale = ((g.amax(-1, keepdim=True) - lo.float()) / 15).clamp_min(1e-8).half()
        codes = ((g - lo.float()) / scale.float()).round_().clamp_(0, 15).to(torch.uint8).flatten(-2)
        return [codes[..., 0::2] | (codes[..., 1::2] << 4), scale[..., 0], lo[..., 0]]
    top = 127.0 if spec.format == "int8" else 448.0
    scale = (g.abs().amax(-1, keepdim=True) / top).clamp_min(1e-8).half()
    scaled = g / scale.float()
    codes = (
        scaled.round_().clamp_(-127, 127).to(torch.int8) if spec.format == "int8" else scaled.to(torch.float8_e4m3fn)
    )
    return [codes.flatten(-2), scale[..., 0]]


def dequantize(stored: list[torch.Tensor], spec: KVQuant) -> torch.Tensor:
    """:func:`quantize`'s inverse up to its rounding: float32 [..., D]."""
    if spec.format == "int4":
        packed, scale, lo = stored
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)
        return (
            codes.float().unflatten(-1, (-1, spec.group)) * scale.float()[..., None] + lo.float()[..., None]
        ).flatten(-2)
    codes, scale = stored
    return (codes.float().unflatten(-1, (-1, spec.group)) * scale.float()[..., None]).flatten(-2)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``, fp8 viewed as bytes: indexed writes and reads have no fp8 CPU kernels, bytes do."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class RowWrites:
    """Where a batch's rows write a step's ``n`` entries: row ``r`` at slots ``starts[r] + j`` of a
    contiguous [R, H, S, ...] buffer, attention reading the slots up to ``end``. The writes are one
    ``index_copy_`` into the buffer seen as [R * H * S, ...] rows, at flat indices
    ``(r * H + h) * S + starts[r] + j``, computed once per buffer shape and shared by every layer of
    the step (an advanced-index write per layer costs three times as much)."""

    def __init__(self, starts: torch.Tensor, end: int):
        self.starts, self.end = starts, end
        self._flat: dict[tuple[int, int, int], torch.Tensor] = {}

    def write(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        """Rows of ``new`` [R, H, n, ...] into ``buffer`` [R, H, S, ...] at the rows' own slots."""
        R, H, S = buffer.shape[:3]
        n = new.shape[2]
        index = self._flat.get((H, S, n))
        if index is None:
            device = self.starts.device
            base = (torch.arange(R, device=device)[:, None] * H + torch.arange(H, device=device)) * S + self.starts[
                :, None
            ]
            index = self._flat[(H, S, n)] = (base[:, :, None] + torch.arange(n, device=device)).flatten()
        buffer.view(R * H * S, *buffer.shape[3:]).index_copy_(0, index, new.reshape(R * H * n, *new.shape[3:]))


class InPlaceLayer(DynamicLayer):
    """``DynamicLayer`` with preallocated, doubling buffers (see the module docstring). The buffers are
    whatever :meth:`_encode` makes of the keys and values (here: themselves), position on dim 2."""

    write_at: RowWrites | None = None  # a batch's rows writing at slots of their own (update)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self._buffers: list[torch.Tensor] | None = None

    def _encode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[torch.Tensor]:
        return [key_states, value_states]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        entries = self._encode(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n if self.write_at is None else self.write_at.end
        if self._buffers is None or end > self._buffers[0].shape[2]:
            self._buffers = [
                grown(old, new, end, self.length) for old, new in zip(self._buffers or [None] * len(entries), entries)
            ]
        for buffer, new in zip(self._buffers, entries):
            if self.write_at is None:
                buffer[:, :, self.length : end] = new
            else:  # row r's entries at its own slots starts[r], starts[r] + 1, ...
                self.write_at.write(_bytes(buffer), _bytes(new))
        self._set_length(end)
        return self.read()

    def filled(self) -> list[torch.Tensor]:
        return [buffer[:, :, : self.length] for buffer in self._buffers]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention sees, [B, H, length, D] each."""
        return self.keys, self.values

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self.filled()

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the (negative) number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(0, self.length + tokens_to_remove))

    def move(self, start: int, source: torch.Tensor) -> None:
        """Entries ``source`` (positions) go to positions ``start, start + 1, ...`` (a tree's accepted
        path moving down over its rejected siblings); the caller crops after them."""
        source = source.to(self.device)
        for buffer in self._buffers:
            buffer[:, :, start : start + len(source)] = buffer.index_select(2, source)

    def move_rows(self, rows: torch.Tensor, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Row ``rows[i]``'s entries at slots ``source[i]`` go to slots ``dest[i]`` (each row's tree path
        moving down over its rejected siblings; ``rows`` [M, 1], ``source`` / ``dest`` [M, W])."""
        rows, source, dest = rows.to(self.device), source.to(self.device), dest.to(self.device)
        for buffer in self._buffers:
            data = _bytes(buffer)
            data[rows, :, dest] = data[rows, :, source]

    def put_rows(self, rows: torch.Tensor, other: InPlaceLayer, which: torch.Tensor) -> None:
        """Rows ``rows`` of this layer start over with the entries of ``other``'s rows ``which`` (prompts
        prefilled apart taking the places of a batch's finished rows, :mod:`serve_eval.session`). What
        the former occupants left past the new entries stays, and is never attended: a batch reads a
        row's own slots only."""
        if other.length > self._buffers[0].shape[2]:
            self._buffers = [grown(mine, mine, other.length, self.length) for mine in self._buffers]
        rows, which = rows.to(self.device), which.to(self.device)
        for mine, theirs in zip(self._buffers, other._buffers):
            _bytes(mine)[rows, :, : other.length] = _bytes(theirs)[which, :, : other.length]
        self._set_length(max(self.length, other.length))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized and self._buffers is not None:
            self._buffers = [buffer[indices.to(self.device)] for buffer in self._buffers]
            self._set_length(self.length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self._buffers is not None:
            self._buffers = [buffer.repeat_interleave(repeats, dim=0) for buffer in self._buffers]
            self._set_length(self.length)

    def reset(self) -> None:
        super().reset()
        self._buffers = None
        self.length = 0

    def nbytes(self) -> int:
        """Bytes the filled part of the cache holds."""
        return sum(t.numel() * t.element_size() for t in self.filled()) if self.is_initialized and self._buffers else 0


class QuantizedLayer(InPlaceLayer):
    """:class:`InPlaceLayer` whose buffers hold :func:`quantize`'s codes and scales; attention reads a
    dequantized copy of the filled part (module docstring)."""

    def __init__(self, spec: KVQuant):
        super().__init__()
        self.spec = spec

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        dim = key_states.shape[-1]
        self.spec = replace(self.spec, group=math.gcd(self.spec.group, dim))  # a head narrower than a group: one group
        if value_states.shape[-1] != dim or (self.spec.format == "int4" and self.spec.group % 2):
            raise ValueError(
                f"KV cache {self.spec.format}: needs keys and values of one even head dimension "
                f"(keys {dim}, values {value_states.shape[-1]})"
            )
        self.dtype = key_states.dtype
        self.rotation = rotation(dim).to(self.device) if self.spec.rotate else None

    def _encode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[torch.Tensor]:
        if self.rotation is not None:
            key_states, value_states = key_states.float() @ self.rotation, value_states.float() @ self.rotation
        return quantize(key_states, self.spec) + quantize(value_states, self.spec)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        stored = self.filled()
        half = len(stored) // 2
        keys, values = dequantize(stored[:half], self.spec), dequantize(stored[half:], self.spec)
        if self.rotation is not None:
            keys, values = keys @ self.rotation.T, values @ self.rotation.T
        return keys.to(self.dtype), values.to(self.dtype)

    def _set_length(self, length: int) -> None:
        self.length = length  # keys / values are read (dequantized) by the forward that needs them


def inplace_cache(config, kv: KVQuant | None = None) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose every attention layer writes in place, quantized as ``kv``
    says (None: in the model's dtype). Sliding-window layers keep their whole history too (a rollback
    may return past the window; the masks apply it, :mod:`distill.base.masks`); other special layers
    stay transformers' own."""
    cache = DynamicCache(config=config)
    cache.layers = [
        (InPlaceLayer() if kv is None else QuantizedLayer(kv))
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)
        else layer
        for layer in cache.layers
    ]
    return cache


def cache_nbytes(cache: DynamicCache) -> int:
    """Bytes the cache's in-place layers hold (the filled part)."""
    return sum(layer.nbytes() for layer in cache.layers if isinstance(layer, InPlaceLayer))


def keep_entries(cache: DynamicCache, prefix: int, source: list[int]) -> None:
    """Keep the first ``prefix`` entries of every layer and, after them, the entries ``source`` (cache
    positions, ascending, all ``>= prefix``); drop the rest. A tree's accepted path, or a speculated
    branch, moves down over what was not taken; the prefix stays where it is."""
    if source != list(range(prefix, prefix + len(source))):  # already in place otherwise
        index = torch.tensor(source)
        for layer in cache.layers:
            if isinstance(layer, InPlaceLayer):
                layer.move(prefix, index)
                continue
            at = index.to(layer.keys.device)
            layer.keys[:, :, prefix : prefix + len(source)] = layer.keys.index_select(2, at)
            layer.values[:, :, prefix : prefix + len(source)] = layer.values.index_select(2, at)
    cache.crop(min(0, prefix + len(source) - cache.get_seq_length()))
