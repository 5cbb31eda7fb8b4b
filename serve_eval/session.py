"""The target over R rows: one KV cache, each row's tokens at its own first ``lengths[r]`` slots.

A step writes each row's tokens after its own length and keeps nothing until :meth:`TargetSession.keep`
(a chain: each row's first ``counts[r]`` tokens) or :meth:`TargetSession.keep_paths` (a tree: each row's
accepted path, moved down over its rejected siblings); the next step writes over the rest. A row
attends to its own slots only and its positions (RoPE) are its own, so it computes exactly what it
would alone. Rows that read fewer tokens than the step's longest are padded: the padding attends to
its row's first slot only and the target's Linears skip it where the kernel can.

One row is the same contract on a contiguous cache with no mask (the model's own causal mask), which
is what plain decoding of one prompt runs: the session picks that form whenever it holds one row.
"""

from __future__ import annotations

import torch

from distill.base.features import FeatureCapture, TargetFeatures
from drafters.cache import RowLengths

from .backend import TORCH, Backend
from .kv import InPlaceLayer, KVQuant, RowWrites, inplace_cache, keep_entries


class TargetSession(RowLengths):
    """``target`` over R rows with a KV cache (quantized as ``kv`` says, :mod:`serve_eval.kv`), stepped as
    ``backend`` serves it (:mod:`serve_eval.backend`) and, with ``capture``, the features a drafter reads.
    ``lengths`` [R]: each row's verified tokens."""

    def __init__(
        self, target, capture: FeatureCapture | None = None, kv: KVQuant | None = None, backend: Backend = TORCH
    ):
        self.target, self.backend = target, backend
        self.run = backend.target_forward(target, capture)
        self.cache = inplace_cache(target.config, kv)
        self._layers = [layer for layer in self.cache.layers if isinstance(layer, InPlaceLayer)]  # the loop's own
        self._lengths = []
        self._row_writes = False  # whether the cache's layers write per row (several rows, or were)

    @property
    def rows(self) -> int:
        return len(self._lengths)

    # -- one row: a contiguous cache, the model's own causal mask ----------------------------------
    def _contiguous(self) -> None:
        """Make a one-row cache contiguous: slots past the row's length forgotten, writes at its end."""
        if self._row_writes:
            for layer in self._layers:
                layer.write_at = None
            self._row_writes = False
        excess = self.cache.get_seq_length() - self.length
        if excess > 0:
            self.cache.crop(-excess)

    def _forward_one(
        self,
        ids: torch.Tensor,
        last: bool = False,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        keys: torch.Tensor | None = None,
    ):
        start = self.length
        if positions is None:
            positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        logits, feats = self.run(
            ids, positions, mask, self.cache, torch.tensor([ids.shape[1] - 1]) if last else None, keys
        )
        return logits, feats

    # -- several rows: per-row writes and masks ------------------------------------------------------
    def _check_rows(self) -> None:
        if len(self._layers) != len(self.cache.layers):
            raise ValueError(
                "decoding several rows at once needs a target whose every layer keeps its keys and values "
                "in the loop's own cache (serve_eval.kv); this one has layers of another kind"
            )

    def _forward_rows(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, logits_at=None, keys=None):
        """The forward over ``ids`` [R, n] at ``positions``, row ``r`` writing after its own length and
        attending to the slots ``mask`` [R, n, slots] allows."""
        write_at = RowWrites(self.lengths.to(ids.device), mask.shape[-1])
        for layer in self._layers:
            layer.write_at = write_at
        self._row_writes = True
        return self.run(ids, positions, mask[:, None], self.cache, logits_at, keys)

    # -- the session's contract --------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, TargetFeatures | None]:
        """Start over with ``prompts`` as the rows: each row's logits after its last prompt token [R, V]
        and the features of the prompts' positions (aux [R, L, F], row ``r`` valid up to its length)."""
        if len(prompts) == 1:
            self.lengths = torch.zeros(1, dtype=torch.long)
            self._contiguous()
            logits, feats = self._forward_one(prompts[0].view(1, -1), last=True)
            self.lengths = torch.tensor([prompts[0].numel()])
            return logits[:, 0], feats
        self._check_rows()
        lengths = torch.tensor([len(p) for p in prompts])
        L, device = int(lengths.max()), prompts[0].device
        ids = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        mask = (
            torch.ones(L, L, dtype=torch.bool).tril()[None] & (torch.arange(L) < lengths[:, None])[:, None, :]
        )  # causal, real tokens
        self.lengths = torch.zeros(len(prompts), dtype=torch.long)
        logits, feats = self._forward_rows(
            ids, torch.arange(L, device=device)[None].expand(len(prompts), L), mask.to(device), lengths - 1
        )
        self.lengths = lengths
        return logits[:, 0], feats

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, TargetFeatures | None]:
        """Read ``ids`` [R, n] after each row's tokens: logits [R, n, V] and features. With ``counts`` [R],
        row ``r`` reads its first ``counts[r]`` tokens only: the rest is padding, whose logits and
        features mean nothing (the backend may skip it, :meth:`~serve_eval.backend.Backend.skip_rows`; it
        attends to its row's first slot, so every number it leaves is finite)."""
        if self.rows == 1:
            self._contiguous()
            return self._forward_one(ids)
        R, n = ids.shape
        positions = self.lengths[:, None] + torch.arange(n)
        mask = torch.arange(int(self.lengths.max()) + n)[None, None] <= positions[:, :, None]  # its own tokens, causal
        if counts is None or bool((counts >= n).all()):
            return self._forward_rows(ids, positions.to(ids.device), mask.to(ids.device))
        real = torch.arange(n)[None] < counts[:, None]  # [R, n]
        mask &= real[:, :, None]
        mask[:, :, 0] |= ~real
        with self.backend.skip_rows(real.flatten().nonzero().flatten().to(ids.device), R * n):
            return self._forward_rows(ids, positions.to(ids.device), mask.to(ids.device))

    @torch.inference_mode()
    def step_tree(
        self, ids: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, TargetFeatures | None]:
        """Read a tree per row: ``ids`` [R, N] (the root first), node ``i`` of row ``r`` at position
        ``lengths[r] + depths[r, i]``, seeing the row's cached tokens and the nodes ``ancestors[r, i]``
        [R, N, N] marks. ``counts`` [R]: each row's nodes (the rest padding, as in :meth:`step`)."""
        R, n = ids.shape
        device = ids.device
        if R == 1:
            self._contiguous()
            start = self.length
            positions = (start + depths.to(device)).view(1, n)
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool), ancestors.view(n, n)], dim=1)[None, None].to(
                device
            )
            keys = torch.cat([torch.arange(start, device=device), positions[0]])[None]
            return self._forward_one(ids, positions=positions, mask=mask, keys=keys)
        lengths = self.lengths[:, None]
        slots = int(self.lengths.max()) + n
        relative = torch.arange(slots)[None] - lengths  # [R, slots]: a slot's node in its row's tree (< 0: cached)
        node = relative.clamp(0, n - 1)
        inside = (relative >= 0) & (relative < n)
        seen = torch.gather(ancestors, 2, node[:, None, :].expand(R, n, slots))  # [R, n, slots]
        mask = (relative < 0)[:, None, :] | (inside[:, None, :] & seen)
        keys = torch.where(inside, lengths + torch.gather(depths, 1, node), torch.arange(slots)[None])
        positions = lengths + depths
        if counts is not None and not bool((counts >= n).all()):
            real = torch.arange(n)[None] < counts[:, None]
            mask &= real[:, :, None]
            mask[:, :, 0] |= ~real
            with self.backend.skip_rows(real.flatten().nonzero().flatten().to(device), R * n):
                return self._forward_rows(ids, positions.to(device), mask.to(device), keys=keys.to(device))
        return self._forward_rows(ids, positions.to(device), mask.to(device), keys=keys.to(device))

    def keep(self, counts) -> None:
        """After :meth:`step`: row ``r`` keeps the first ``counts[r]`` tokens it read (a tensor or a list)."""
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        self._lengths = [length + count for length, count in zip(self._lengths, counts)]
        if self.rows == 1 and not self._row_writes:
            excess = self.cache.get_seq_length() - self.length
            if excess > 0:
                self.cache.crop(-excess)

    @torch.inference_mode()
    def keep_paths(self, paths: list[list[int]]) -> None:
        """After :meth:`step_tree`: row ``r`` keeps its nodes ``paths[r]`` (indices into its tree, root
        first, ascending), moved down to follow its cached tokens."""
        if self.rows == 1 and not self._row_writes:
            prefix = self.length
            keep_entries(self.cache, prefix, [prefix + i for i in paths[0]])
            self._lengths = [prefix + len(paths[0])]
            return
        moved = [r for r, path in enumerate(paths) if path != list(range(len(path)))]
        if moved:
            width = max(len(paths[r]) for r in moved)
            rows = torch.tensor(moved)[:, None]
            steps = torch.arange(width)
            source = torch.tensor([paths[r] + list(range(len(paths[r]), width)) for r in moved])  # padding: in place
            start = self.lengths[rows]
            for layer in self._layers:
                layer.move_rows(rows, start + source, start + steps)
        self._lengths = [length + len(path) for length, path in zip(self._lengths, paths)]

    @torch.inference_mode()
    def put(self, rows: torch.Tensor, other: TargetSession, which: torch.Tensor) -> None:
        """Rows ``rows`` start over as ``other``'s rows ``which`` (waiting prompts taking the places of rows
        that finished): their entries are copied over those rows' slots, nothing else moves."""
        self._check_rows()
        for layer, theirs in zip(self._layers, other._layers):
            layer.put_rows(rows, theirs, which)
        self.lengths = self.lengths.index_put((rows,), other.lengths[which])

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows``."""
        self._check_rows()
        for layer in self._layers:
            layer.batch_select_indices(rows.to(layer.device))
        self.lengths = self.lengths[rows]
