"""Decode-time context cache: per drafter layer, the keys and values of the verified context, in
buffers that :class:`drafters.layers.InjectedLayer`'s decode paths read and write in place."""

from __future__ import annotations

import torch


class ContextCache:
    """Decode-time keys and values of the verified context, per drafter layer, in buffers that grow by
    doubling: appending the newly verified positions writes in place instead of re-copying the whole
    context every step, and one block's own entries fit after the context (``spare`` positions).
    ``capacity``: the buffers' length from the start, for a compiled draft whose graph is built for one
    length (:mod:`serve_eval.compiled`); past it they grow by doubling all the same."""

    def __init__(self, spare: int, capacity: int = 0):
        self.spare = spare
        self.capacity = capacity  # buffers of exactly this many positions while the context fits them
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add per-layer ``(keys, values)`` [B, heads, n, head_dim] of the next ``n`` positions."""
        self.length = self.write(kv)

    def write(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Write per-layer ``(keys, values)`` of ``n`` positions after the context without counting them
        (entries that attention reads once and the next write overwrites: a draft's own, or positions a
        caller counts itself); returns the end, ``length + n``."""
        end = self.length + kv[0][0].shape[2]
        self.ensure(end + self.spare, kv[0][0], len(kv))
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][:, :, self.length:end] = k
            self.values[layer][:, :, self.length:end] = v
        return end

    def check_anchor(self, anchor_pos: int, arriving: torch.Tensor | None) -> None:
        """A block anchored at ``anchor_pos`` must follow the cached positions and the ``arriving``
        features [B, n, F] (or None) directly: a ValueError otherwise."""
        n = 0 if arriving is None else arriving.shape[1]
        if self.length + n != anchor_pos:
            raise ValueError(f"the context cache holds {self.length} positions and {n} arrive, the block is anchored at {anchor_pos}")

    def ensure(self, end: int, like: torch.Tensor, layers: int) -> None:
        """Buffers for ``layers`` layers with room for ``end`` positions, shaped and typed like ``like``
        [B, heads, *, head_dim] (grown by doubling; the context's entries move along). Zeros where nothing
        was written: :meth:`BlockDrafter.decode_static` attends over whole buffers, the unwritten entries
        masked, and a masked NaN would still reach the output (0 * NaN)."""
        if not self.keys or end > self.keys[0].shape[2]:
            shape = (like.shape[0], like.shape[1], self.capacity if end <= self.capacity else max(2 * end, 64), like.shape[3])
            none: list[torch.Tensor | None] = [None] * layers
            self.keys = [self._grown(old, shape, like) for old in self.keys or none]
            self.values = [self._grown(old, shape, like) for old in self.values or none]

    def _grown(self, old: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        new = like.new_zeros(shape)
        if old is not None:
            new[:, :, :self.length] = old[:, :, :self.length]
        return new

