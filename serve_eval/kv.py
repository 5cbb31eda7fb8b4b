"""A target KV cache written in place.

transformers' ``DynamicLayer`` appends each forward's keys and values with ``torch.cat``, which copies
the whole cache every step: at batch 16 and 200 cached positions that is ~65 MB a step on the 11M
testbed target. :class:`InPlaceLayer` keeps each layer's keys and values in a buffer that grows by
doubling (amortised O(1) copies per token), writes new entries in place and hands attention a view
of the filled part; ``crop`` only moves the length. Everything else (masks, ``get_seq_length``, row
selection) is ``DynamicLayer``'s contract, so it drops into any transformers model that builds a
``DynamicCache``.

Invariant: ``keys`` / ``values`` are always ``buffer[:, :, :length]``, so a cache that was appended,
cropped, row-selected and appended again holds exactly what a ``DynamicCache`` given the same calls
holds (tested).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class InPlaceLayer(DynamicLayer):
    """``DynamicLayer`` with preallocated, doubling buffers (see the module docstring)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self._keys = self._values = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:
            self._keys, self._values = self._grown(self._keys, key_states, end), self._grown(self._values, value_states, end)
        self._keys[:, :, self.length:end] = key_states
        self._values[:, :, self.length:end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def _grown(self, old: torch.Tensor | None, like: torch.Tensor, needed: int) -> torch.Tensor:
        B, H, _, D = like.shape
        new = like.new_empty(B, H, max(2 * needed, 64), D)
        if old is not None:
            new[:, :, :self.length] = old[:, :, :self.length]
        return new

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the (negative) number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(0, self.length + tokens_to_remove))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized and self._keys is not None:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._set_length(self.length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self._keys is not None:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)
            self._set_length(self.length)

    def reset(self) -> None:
        super().reset()
        self._keys = self._values = None
        self.length = 0


def inplace_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers write in place (sliding-window
    and other special layers stay transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [InPlaceLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
