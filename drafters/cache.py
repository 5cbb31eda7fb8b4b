"""Decode-time context cache over R rows: per drafter layer, the keys and values of each row's verified
context in buffers [R, heads, S, head_dim], row ``r`` holding its first ``lengths[r]`` positions, which
the block drafter's decoding forward (:meth:`drafters.block.BlockDrafter.decode`) reads and writes in
place.

Buffers grow by doubling (a write in place instead of a copy of the whole context every step), hold
``capacity`` slots from the start where a compiled draft is built for one length, and are zero where
nothing was written: the decoding forward attends over whole buffers with the unwritten slots masked,
and a masked NaN would still reach the output (0 * NaN). A row writes past its length freely (a draft's own
entries, positions not yet counted): those slots are never attended before the row's next write covers
them.
"""

from __future__ import annotations

import torch


class RowLengths:
    """Each row's length, kept as Python ints (one row's are read and written every step): the drafter's
    context cache and the target's session count their rows alike."""

    _lengths: list[int]

    @property
    def lengths(self) -> torch.Tensor:
        """Each row's length [R]."""
        return torch.tensor(self._lengths, dtype=torch.long)

    @lengths.setter
    def lengths(self, value) -> None:
        self._lengths = value.tolist() if isinstance(value, torch.Tensor) else list(value)

    def row_lengths(self) -> list[int]:
        """Each row's length, as Python ints."""
        return list(self._lengths)

    @property
    def length(self) -> int:
        """One row's length (setting it makes the rows that one row)."""
        return self._lengths[0]

    @length.setter
    def length(self, value: int) -> None:
        self._lengths = [int(value)]


class ContextCache(RowLengths):
    """Keys and values of R rows' verified contexts (see the module docstring). ``spare``: slots a
    one-row write keeps free after its end (one block's entries); ``length``: the one row's length."""

    def __init__(self, spare: int, capacity: int = 0):
        self.spare = spare
        self.capacity = capacity  # buffers of exactly this many slots while the contexts fit them
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._lengths = [0]

    # -- one row ---------------------------------------------------------------------------------
    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add per-layer ``(keys, values)`` [1, heads, n, head_dim] of the next ``n`` positions."""
        self.length = self.write(kv)

    def write(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Write per-layer ``(keys, values)`` of ``n`` positions after the context without counting them
        (entries that attention reads once and the next write overwrites, or positions the caller
        counts itself); returns the end, ``length + n``."""
        start = self.length
        end = start + kv[0][0].shape[2]
        self.ensure(end + self.spare, kv[0][0], len(kv))
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][:, :, start:end] = k
            self.values[layer][:, :, start:end] = v
        return end

    # -- buffers -----------------------------------------------------------------------------------
    def ensure(self, end: int, like: torch.Tensor, layers: int) -> None:
        """Buffers for ``layers`` layers with room for ``end`` slots, shaped and typed like ``like``
        [R, heads, *, head_dim] (grown by doubling, the contexts moving along)."""
        if not self.keys or end > self.keys[0].shape[2]:
            filled = max(self._lengths, default=0)
            none: list[torch.Tensor | None] = [None] * layers
            self.keys = [grown(old, like, end, filled, self.capacity) for old in self.keys or none]
            self.values = [grown(old, like, end, filled, self.capacity) for old in self.values or none]

    # -- rows --------------------------------------------------------------------------------------
    def start(self, rows: int) -> None:
        """Begin anew with ``rows`` empty rows."""
        self.keys, self.values = [], []
        self._lengths = [0] * rows

    def append_rows(self, kv: list[tuple[torch.Tensor, torch.Tensor]], counts: torch.Tensor) -> None:
        """Every row writes the ``m`` entries of per-layer ``(keys, values)`` [R, heads, m, head_dim] after
        its length, and counts the first ``counts[r]`` of them."""
        R, m = kv[0][0].shape[0], kv[0][0].shape[2]
        self.ensure(max(self._lengths) + m, kv[0][0], len(kv))
        rows, slots = torch.arange(R)[:, None], self.lengths[:, None] + torch.arange(m)
        for (k, v), keys, values in zip(kv, self.keys, self.values):
            keys[rows, :, slots] = k.transpose(1, 2)
            values[rows, :, slots] = v.transpose(1, 2)
        self.lengths = self.lengths + counts

    def put(self, rows: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], lengths: torch.Tensor) -> None:
        """Rows ``rows`` start over with the first ``lengths[i]`` positions of per-layer ``(keys, values)``
        [len(rows), heads, m, head_dim]."""
        m = kv[0][0].shape[2]
        self.ensure(m, kv[0][0][:1].expand(len(self._lengths), -1, -1, -1), len(kv))
        at = rows.to(kv[0][0].device)
        for (k, v), keys, values in zip(kv, self.keys, self.values):
            keys[at, :, :m] = k
            values[at, :, :m] = v
        self.lengths = self.lengths.index_put((rows,), lengths)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows``."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.lengths = self.lengths[rows]


def grown(old: torch.Tensor | None, like: torch.Tensor, needed: int, filled: int, capacity: int = 0) -> torch.Tensor:
    """A zero buffer shaped like ``like`` [B, H, *, ...] with room for ``needed`` slots (``capacity`` where that
    holds them, else twice ``needed`` and at least 64: amortised O(1) copies a slot) and ``old``'s first
    ``filled`` slots copied in: the one rule by which the loop's caches grow."""
    size = capacity if needed <= capacity else max(2 * needed, 64)
    new = like.new_zeros(*like.shape[:2], size, *like.shape[3:])
    if old is not None:
        new[:, :, :filled] = old[:, :, :filled]
    return new
