"""Offline target features: written once to disk, read back by training instead of running the target.

Layout of a cache folder (one per split)::

    manifest.json              what produced it (see below); written last
    shard_00000.safetensors    input_ids [n, L+1] int32, aux [n, L+1, F], last [n, L+1, H]
    shard_00001.safetensors    ...

Window ``i`` of the cache is window ``i`` of :class:`~distill.data.PackedWindows` over the same token
stream, so offline training visits exactly the batches online training would, and (with a float32
cache) computes exactly the same losses.

The manifest records the target (path and a fingerprint of its config and weights), the tokenizer
and data fingerprints, the layer ids *and their index convention*, the dtype and the window length. A
recipe whose values differ is refused before training with the list of differences: silently
training on features of another layer, target or tokenisation is the classic way to get a drafter
that scores well offline and accepts nothing when served.

The whole folder is written under a temporary name and renamed when complete, so a killed writer
leaves no cache that looks valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .base.features import LAYER_ID_CONVENTION, FeatureCapture
from .checks import check_safetensors
from .config import RecipeError
from .data import Batch, PackedWindows

FORMAT_VERSION = 1
#: manifest fields a recipe must agree with
CHECKED_FIELDS = ("target_fingerprint", "tokenizer_fingerprint", "data_fingerprint", "layer_ids",
                  "layer_id_convention", "seq_len", "num_windows", "dtype", "split")


class FeatureCacheMismatch(RecipeError):
    """The cache on disk was produced for something other than this recipe."""


def batch_features(batch: Batch, capture: FeatureCapture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, aux, last) of a batch: read from the cache, or captured from the target now."""
    if batch.aux is not None:
        return batch.input_ids, batch.aux, batch.last
    feats = capture(batch.input_ids)
    return batch.input_ids, feats.aux, feats.last


def target_fingerprint(target) -> str:
    """A fingerprint of the target's config and weights (every tensor's shape and a strided sample)."""
    h = hashlib.sha256(json.dumps(target.config.to_dict(), sort_keys=True, default=str).encode())
    for name, p in target.state_dict().items():
        flat = p.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 64)].float().cpu().numpy().tobytes()
        h.update(name.encode() + str(tuple(p.shape)).encode() + sample)
    return h.hexdigest()[:16]


def write_feature_cache(capture: FeatureCapture, windows: PackedWindows, folder: Path, meta: dict, dtype: torch.dtype,
                        batch_size: int = 8, shard_windows: int = 512, device="cpu") -> Path:
    """Run the target over every window of ``windows`` (in index order) and store the features."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards, buf = [], {"input_ids": [], "loss_mask": [], "aux": [], "last": []}

    def flush():
        if not buf["input_ids"]:
            return
        name = f"shard_{len(shards):05d}.safetensors"
        save_file({k: torch.cat(v).contiguous() for k, v in buf.items() if v}, str(tmp / name))
        shards.append({"file": name, "windows": sum(t.shape[0] for t in buf["input_ids"])})
        for v in buf.values():
            v.clear()

    n = len(windows)
    for start in tqdm(range(0, n, batch_size), desc=f"caching {meta.get('split', '')} features", unit="batch"):
        batch = windows.collate(list(range(start, min(start + batch_size, n))))
        feats = capture(batch.input_ids.to(device))
        buf["input_ids"].append(batch.input_ids.to(torch.int32))
        if batch.loss_mask is not None:
            buf["loss_mask"].append(batch.loss_mask.to(torch.int8))
        buf["aux"].append(feats.aux.to(dtype).cpu())
        buf["last"].append(feats.last.to(dtype).cpu())
        if sum(t.shape[0] for t in buf["input_ids"]) >= shard_windows:
            flush()
    flush()
    manifest = {"format_version": FORMAT_VERSION, **meta, "layer_ids": list(capture.layer_ids),
                "layer_id_convention": LAYER_ID_CONVENTION, "dtype": str(dtype).removeprefix("torch."),
                "seq_len": windows.seq_len, "num_windows": n, "shards": shards}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder} is not a feature cache (no manifest.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"feature cache {folder}: manifest.json is not valid JSON ({e}); delete the folder to rebuild it") from None


def check_manifest(manifest: dict, expected: dict, folder: Path) -> None:
    diffs = [f"{k}: cache has {manifest.get(k)!r}, recipe needs {expected[k]!r}"
             for k in CHECKED_FIELDS if k in expected and manifest.get(k) != expected[k]]
    if manifest.get("format_version") != FORMAT_VERSION:
        diffs.append(f"format_version: cache has {manifest.get('format_version')!r}, this code reads {FORMAT_VERSION}")
    if diffs:
        raise FeatureCacheMismatch(f"feature cache {folder} does not match this recipe:\n  " + "\n  ".join(diffs)
                                   + "\ndelete it or point features.cache_dir elsewhere to rebuild it")


class CachedFeatureWindows(PackedWindows):
    """The windows of a feature cache, in the same seeded order as :class:`PackedWindows`."""

    def __init__(self, folder: Path, expected: dict, seed: int = 0, shuffle: bool = True):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        check_manifest(self.manifest, expected, self.folder)
        self.seq_len = self.manifest["seq_len"]
        self.seed, self.shuffle = seed, shuffle
        self.num_windows = self.manifest["num_windows"]
        self._perm_epoch, self._perm = -1, None
        self._starts, total = [], 0
        for shard in self.manifest["shards"]:
            self._starts.append(total)
            total += shard["windows"]
            check_safetensors(self.folder / shard["file"], f"feature cache {self.folder}",
                              hint="; delete the folder to rebuild it")
        self._handles: dict[int, object] = {}

    def _locate(self, index: int) -> tuple[object, int]:
        s = max(i for i, start in enumerate(self._starts) if start <= index)
        if s not in self._handles:
            self._handles[s] = safe_open(str(self.folder / self.manifest["shards"][s]["file"]), framework="pt")
        return self._handles[s], index - self._starts[s]

    def _row(self, key: str, index: int) -> torch.Tensor:
        handle, row = self._locate(index)
        return handle.get_slice(key)[row:row + 1][0]

    def window(self, index: int) -> torch.Tensor:
        return self._row("input_ids", index).long()

    def collate(self, indices: list[int]) -> Batch:
        rows = lambda key: torch.stack([self._row(key, i) for i in indices])  # noqa: E731
        has_mask = "loss_mask" in self._locate(indices[0])[0].keys()
        return Batch(rows("input_ids").long(), rows("loss_mask") if has_mask else None, rows("aux"), rows("last"))
