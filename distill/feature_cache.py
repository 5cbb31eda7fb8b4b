"""Offline target features: written once to disk, read back by training instead of running the target.

Layout of a cache folder (one per split)::

    manifest.json              what produced it (see below); written last
    shard_00000.safetensors    input_ids [n, L+1] int32, aux [n, L+1, F], last [n, L+1, H]
    shard_00001.safetensors    ...

Window ``i`` of the cache is window ``i`` of :class:`~distill.data.PackedWindows` over the same token
stream, so offline training visits exactly the batches online training would, and (with a float32
cache) computes exactly the same losses.

The manifest records the target (path and a fingerprint of its checkpoint's config and weights, read from
its files, and the dtype it runs in), the tokenizer
and data fingerprints, the layer ids *and their index convention*, the dtype and the window length. A
recipe whose values differ is refused before training with the list of differences: silently
training on features of another layer, target or tokenisation is the classic way to get a drafter
that scores well offline and accepts nothing when served.

Shard ``s`` holds windows ``s * per .. (s + 1) * per - 1`` with ``per`` the shard size rounded up to
whole batches, so the layout (and every byte) depends on the windows, the batch size and the shard
size, not on how many ranks wrote it. Writing is divided among the ranks of a launch
(:func:`~distill.checkpoint.run_sharded`): the shards of every cache being built are dealt round-robin,
each rank runs its copy of the target over its own and publishes each shard atomically into
``<folder>.parts-<plan>/`` (``plan``: a digest of everything the manifest records), and the main rank
writes the manifest and renames that folder to ``<folder>``. A killed run keeps the shards it finished
(a plan that changed starts afresh), and no folder that looks like a cache is ever incomplete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .base.features import LAYER_ID_CONVENTION, FeatureCapture
from .checkpoint import Ranks, publish, run_sharded, write_file_atomically
from .checks import check_safetensors
from .config import RecipeError
from .data import Batch, PackedWindows
from .target_files import checkpoint_fingerprint, checkpoint_folder

FORMAT_VERSION = 1
#: manifest fields a recipe must agree with
CHECKED_FIELDS = (
    "target_fingerprint",
    "tokenizer_fingerprint",
    "data_fingerprint",
    "layer_ids",
    "layer_id_convention",
    "seq_len",
    "num_windows",
    "dtype",
    "split",
)


class FeatureCacheMismatch(RecipeError):
    """The cache on disk was produced for something other than this recipe."""


def batch_features(batch: Batch, capture: FeatureCapture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, aux, last) of a batch, on its ``input_ids``' device: read from the cache (a batch that has
    them), or captured from the target now (:class:`FeatureCapture` moves a split target's states there)."""
    if batch.aux is not None:
        return batch.input_ids, batch.aux, batch.last
    feats = capture(batch.input_ids)
    return batch.input_ids, feats.aux, feats.last


def target_fingerprint(target) -> str:
    """A fingerprint of the checkpoint ``target`` was loaded or built from (``target.name_or_path``) and the
    dtype it runs in: its config and every tensor's shape and a strided sample, read from the checkpoint's
    files (:func:`~distill.target_files.checkpoint_fingerprint`), so a target loaded whole, split over
    devices or built on the meta device without its weights has the same one."""
    return checkpoint_fingerprint(checkpoint_folder(target.name_or_path), target.dtype)


def write_feature_caches(
    capture: FeatureCapture,
    caches: list[tuple[PackedWindows, Path, dict]],
    dtype: torch.dtype,
    batch_size: int = 8,
    shard_windows: int = 512,
    device="cpu",
    ranks: Ranks | None = None,
) -> list[int]:
    """Build each ``(windows, folder, meta)`` cache whose folder has no manifest yet, the shards of all of
    them divided among ``ranks`` (module doc); every rank must call this with the same caches. Returns
    the number of shards each rank wrote."""
    ranks = ranks or Ranks()
    per = -(-shard_windows // batch_size) * batch_size
    plans = [
        _Plan(capture, windows, Path(folder), meta, dtype, per)
        for windows, folder, meta in caches
        if not (Path(folder) / "manifest.json").exists()
    ]
    units = [(plan, s) for plan in plans for s in range(len(plan.shards))]
    for plan in plans:
        plan.parts.mkdir(parents=True, exist_ok=True)

    def write(i: int) -> None:
        plan, s = units[i]
        write_file_atomically(plan.shard_path(s), lambda tmp: plan.write_shard(s, tmp, batch_size, device))

    def merge() -> None:
        for plan in plans:
            plan.publish()

    counts = run_sharded(
        ranks,
        len(units),
        lambda i: units[i][0].shard_path(units[i][1]).exists(),
        write,
        merge,
        "caching features into " + ", ".join(str(p.folder) for p in plans),
    )
    return [len(c) for c in counts]


class _Plan:
    """One cache folder to build: its manifest (but the shard list's files), its shards' window ranges
    and the work folder named by a digest of both."""

    def __init__(
        self, capture: FeatureCapture, windows: PackedWindows, folder: Path, meta: dict, dtype: torch.dtype, per: int
    ):
        self.capture, self.windows, self.folder, self.dtype = capture, windows, folder, dtype
        n = len(windows)
        self.ranges = [(lo, min(lo + per, n)) for lo in range(0, n, per)]
        self.shards = [
            {"file": f"shard_{s:05d}.safetensors", "windows": hi - lo} for s, (lo, hi) in enumerate(self.ranges)
        ]
        self.manifest = {
            "format_version": FORMAT_VERSION,
            **meta,
            "layer_ids": list(capture.layer_ids),
            "layer_id_convention": LAYER_ID_CONVENTION,
            "dtype": str(dtype).removeprefix("torch."),
            "seq_len": windows.seq_len,
            "num_windows": n,
            "shards": self.shards,
        }
        digest = hashlib.sha256(json.dumps(self.manifest, sort_keys=True, default=str).encode()).hexdigest()[:12]
        self.parts = folder.with_name(f"{folder.name}.parts-{digest}")

    def shard_path(self, s: int) -> Path:
        return self.parts / self.shards[s]["file"]

    def write_shard(self, s: int, tmp: Path, batch_size: int, device) -> None:
        """Shard ``s``: the target's features of its windows, run ``batch_size`` windows at a time."""
        lo, hi = self.ranges[s]
        buf = {"input_ids": [], "loss_mask": [], "aux": [], "last": []}
        for start in tqdm(
            range(lo, hi, batch_size),
            desc=f"caching {self.manifest.get('split', '')} features, shard {s}",
            unit="batch",
            leave=False,
        ):
            batch = self.windows.collate(list(range(start, min(start + batch_size, hi))))
            feats = self.capture(batch.input_ids.to(device))
            buf["input_ids"].append(batch.input_ids.to(torch.int32))
            if batch.loss_mask is not None:
                buf["loss_mask"].append(batch.loss_mask.to(torch.int8))
            buf["aux"].append(feats.aux.to(self.dtype).cpu())
            buf["last"].append(feats.last.to(self.dtype).cpu())
        save_file({k: torch.cat(v).contiguous() for k, v in buf.items() if v}, str(tmp))

    def publish(self) -> None:
        """The manifest written last into the work folder, which then becomes the cache folder; work
        folders of other plans for this folder go."""
        write_file_atomically(
            self.parts / "manifest.json", lambda tmp: tmp.write_text(json.dumps(self.manifest, indent=2))
        )
        if self.folder.exists():
            shutil.rmtree(self.folder)
        publish(self.parts, self.folder)
        for stale in self.folder.parent.glob(f"{self.folder.name}.parts-*"):
            shutil.rmtree(stale, ignore_errors=True)


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder} is not a feature cache (no manifest.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(
            f"feature cache {folder}: manifest.json is not valid JSON ({e}); delete the folder to rebuild it"
        ) from None


def check_manifest(manifest: dict, expected: dict, folder: Path) -> None:
    diffs = [
        f"{k}: cache has {manifest.get(k)!r}, recipe needs {expected[k]!r}"
        for k in CHECKED_FIELDS
        if k in expected and manifest.get(k) != expected[k]
    ]
    if manifest.get("format_version") != FORMAT_VERSION:
        diffs.append(f"format_version: cache has {manifest.get('format_version')!r}, this code reads {FORMAT_VERSION}")
    if diffs:
        raise FeatureCacheMismatch(
            f"feature cache {folder} does not match this recipe:\n  "
            + "\n  ".join(diffs)
            + "\ndelete it or point features.cache_dir elsewhere to rebuild it"
        )


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
            check_safetensors(
                self.folder / shard["file"], f"feature cache {self.folder}", hint="; delete the folder to rebuild it"
            )
        self._handles: dict[int, object] = {}

    def _locate(self, index: int) -> tuple[object, int]:
        s = max(i for i, start in enumerate(self._starts) if start <= index)
        if s not in self._handles:
            self._handles[s] = safe_open(str(self.folder / self.manifest["shards"][s]["file"]), framework="pt")
        return self._handles[s], index - self._starts[s]

    def _row(self, key: str, index: int) -> torch.Tensor:
        handle, row = self._locate(index)
        return handle.get_slice(key)[row : row + 1][0]

    def window(self, index: int) -> torch.Tensor:
        return self._row("input_ids", index).long()

    def collate(self, indices: list[int]) -> Batch:
        rows = lambda key: torch.stack([self._row(key, i) for i in indices])  # noqa: E731
        has_mask = "loss_mask" in self._locate(indices[0])[0].keys()  # noqa: SIM118 safe_open is not iterable
        return Batch(rows("input_ids").long(), rows("loss_mask") if has_mask else None, rows("aux"), rows("last"))


# --------------------------------------------------------------------------------------------------
# vLLM's hidden-states files (the speculators library's offline format)
# --------------------------------------------------------------------------------------------------
#
# A serving engine extracts the target's hidden states as it prefills (vLLM's ``extract_hidden_states``,
# written by ``speculators generate-offline-data``): one ``hs_{i}.safetensors`` per sample, ``token_ids``
# [T] and ``hidden_states`` [T, n + 1, H], the states of ``n + 1`` layer ids in that library's convention
# (id ``i`` is the input of decoder layer ``i``, i.e. the output of layer ``i - 1`` in draftsmith's; the
# last id is the number of layers: the final state *before* the final norm). Sample ``i`` of a split is
# window ``i`` of the recipe's token windows; its tokens must be the window's (a shorter sample is the
# window before its padding).


def vllm_layer_ids(target_layer_ids: list[int], num_layers: int) -> list[int]:
    """The extractor's layer ids (speculators' convention) for a drafter reading ``target_layer_ids``
    (draftsmith's): each shifted by one, then the final state."""
    return [i + 1 for i in target_layer_ids] + [num_layers]


def write_vllm_hidden_states(capture: FeatureCapture, windows: PackedWindows, folder: Path, dtype, device="cpu") -> int:
    """``folder/hs_{i}.safetensors`` for every window ``i`` not written yet, as the extractor writes them,
    from the target running here (each file written atomically: a killed run keeps what it finished).
    Returns the number of files written."""
    from distill.base.features import final_norm

    folder.mkdir(parents=True, exist_ok=True)
    pre_norm: dict = {}
    hook = final_norm(capture.target).register_forward_pre_hook(lambda _m, args: pre_norm.update(state=args[0]))
    written = 0
    try:
        for i in tqdm(range(len(windows)), desc=f"writing vLLM hidden states to {folder}", unit="sample", leave=False):
            path = folder / f"hs_{i}.safetensors"
            if path.exists():
                continue
            ids = windows.window(i)
            feats = capture(ids[None].to(device))
            layers = feats.aux[0].unflatten(-1, (len(capture.layer_ids), -1))  # [T, n, H]
            states = torch.cat([layers, pre_norm["state"][0, :, None].to(layers.device)], dim=1)
            tensors = {"token_ids": ids.to(torch.int64), "hidden_states": states.to(dtype).cpu().contiguous()}
            write_file_atomically(path, lambda tmp, t=tensors: save_file(t, str(tmp)))
            written += 1
    finally:
        hook.remove()
    return written


class VllmFeatureWindows(PackedWindows):
    """The recipe's token ``windows`` with their target features read from vLLM's hidden-states files in
    ``folder`` (module section above): ``layer_ids`` are the ids the files were extracted with
    (speculators' convention), converted here to the drafter's ``target_layer_ids``; the final state is
    normed by the target's ``norm`` (the files hold it before the norm, training reads it after)."""

    def __init__(self, windows: PackedWindows, folder: Path, layer_ids: list[int], target_layer_ids: list[int], norm):
        wanted = vllm_layer_ids(target_layer_ids, layer_ids[-1])
        missing = [i for i in wanted[:-1] if i not in layer_ids[:-1]]
        if missing:
            raise RecipeError(
                f"features.vllm_layer_ids {layer_ids}: the drafter reads target layers {target_layer_ids} (outputs), "
                f"ids {wanted[:-1]} in the extractor's convention (inputs), and {missing} were not extracted"
            )
        self.windows, self.folder, self.norm = windows, Path(folder), norm
        self.rows = [layer_ids.index(i) for i in wanted[:-1]]  # the files' rows, in the drafter's order
        self.seq_len, self.num_windows = windows.seq_len, len(windows)
        self.seed, self.shuffle = windows.seed, windows.shuffle
        self._perm_epoch, self._perm = -1, None
        first = self.folder / "hs_0.safetensors"
        if not first.exists():
            raise RecipeError(f"features.cache_dir: {self.folder} holds no hs_0.safetensors (vLLM hidden states)")

    def window(self, index: int) -> torch.Tensor:
        return self.windows.window(index)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        return self.windows.token_counts(vocab_size)

    def _features(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.folder / f"hs_{index}.safetensors"
        check_safetensors(path, f"vLLM hidden states {self.folder}", hint=f"; re-extract sample {index}")
        from safetensors.torch import load_file

        loaded = load_file(str(path))
        ids, states = loaded["token_ids"], loaded["hidden_states"]
        window = self.windows.window(index)
        T = len(ids)
        if len(window) < T or not torch.equal(ids.long(), window[:T]):
            raise RecipeError(
                f"{path}: its token_ids are not window {index}'s tokens (the extraction ran on other data, another "
                "tokenization or another order); extract the samples of this recipe's windows"
            )
        aux = states[:, self.rows].flatten(1)
        with torch.no_grad():
            last = self.norm(states[:, -1].to(self.norm.weight.dtype))
        pad = len(window) - T  # positions past the sample: the window's padding, never scored
        return torch.nn.functional.pad(aux, (0, 0, 0, pad)), torch.nn.functional.pad(last, (0, 0, 0, pad))

    def collate(self, indices: list[int]) -> Batch:
        batch = self.windows.collate(indices)
        aux, last = zip(*(self._features(i) for i in indices))
        batch.aux, batch.last = torch.stack(aux), torch.stack(last)
        return batch
