"""A target checkpoint's files, read without building the model: tensors by name, and a fingerprint of
its config and weights.

A checkpoint is a folder with ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (whose ``weight_map`` names each tensor's file), as ``save_pretrained``
writes it; a hub id stands for its snapshot in the local hub cache (nothing is downloaded).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from .config import RecipeError

#: the fingerprint samples every ``numel // SAMPLES``-th element of a tensor (every element of a smaller one)
SAMPLES = 64
#: tensors up to this many elements are read whole for their sample; larger ones element by element
WHOLE_UP_TO = 1 << 16
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def checkpoint_folder(path: str | Path) -> Path:
    """The local folder of checkpoint ``path``: the folder itself, else hub id ``path``'s snapshot in the
    local hub cache; :class:`RecipeError` naming ``target.path`` when it is neither."""
    if not str(path):
        raise RecipeError("target.path: the target was not loaded from a checkpoint, and its files are what is read")
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except (OSError, ValueError) as e:
        raise RecipeError(
            f"target.path: '{path}' is neither a local folder nor in the local hub cache ({str(e).splitlines()[0]})"
        ) from None


def tensor_files(folder: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint in ``folder`` and the safetensors file that holds it."""
    index, single = folder / INDEX_FILE, folder / SINGLE_FILE
    if index.exists():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    if single.exists():
        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    raise RecipeError(
        f"target.path: {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; a feature cache and training "
        "without the target's weights read its safetensors files (re-save it with save_pretrained)"
    )


def checkpoint_key(aliases: list[str], keys: set[str]) -> str | None:
    """The checkpoint tensor that holds a parameter known by ``aliases`` (its names in the model, several
    when tied): an alias itself, else the one key ending in the longest trailing part of an alias (at
    least ``module.param``: a checkpoint that nests the model under another prefix); None when no key or
    several keys fit."""
    for alias in aliases:
        if alias in keys:
            return alias
    for alias in aliases:
        parts = alias.split(".")
        for start in range(1, len(parts) - 1):
            tail = ".".join(parts[start:])
            found = [k for k in keys if k == tail or k.endswith("." + tail)]
            if len(found) == 1:
                return found[0]
    return None


def read_tensors(folder: Path, wanted: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """For each ``label: aliases`` of ``wanted``, the tensor :func:`checkpoint_key` finds in the checkpoint
    in ``folder``, read from its file alone; :class:`RecipeError` naming the parameter when none fits."""
    files = tensor_files(folder)
    out = {}
    for label, aliases in wanted.items():
        key = checkpoint_key(aliases, set(files))
        if key is None:
            raise RecipeError(
                f"target.path: {folder} has no tensor for the target's {label} ({', '.join(aliases)}); "
                "train with the target loaded (delete the feature caches' manifests to rebuild them)"
            )
        with safe_open(str(files[key]), framework="pt") as handle:
            out[label] = handle.get_tensor(key)
    return out


def strided_sample(handle, name: str) -> torch.Tensor:
    """Every ``max(1, numel // SAMPLES)``-th element of tensor ``name`` of an open safetensors file, in
    row-major order, as stored; a large tensor is read element by element, never whole."""
    view = handle.get_slice(name)
    shape = view.get_shape()
    numel = math.prod(shape)
    step = max(1, numel // SAMPLES)
    if numel <= WHOLE_UP_TO:
        return handle.get_tensor(name).flatten()[::step]
    coords = torch.stack(torch.unravel_index(torch.arange(0, numel, step), tuple(shape)), dim=1).tolist()
    return torch.cat([view[tuple(slice(i, i + 1) for i in at)].flatten() for at in coords])


def checkpoint_fingerprint(folder: Path, dtype: torch.dtype) -> str:
    """16 hex digits over the checkpoint's ``config.json`` (parsed, keys sorted), the dtype the target runs
    in, and each tensor's name, shape, stored dtype and :func:`strided_sample`, all read from the files:
    the same value whether the target is loaded whole, split over devices or not built at all."""
    h = hashlib.sha256(json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True).encode())
    h.update(str(dtype).encode())
    files = tensor_files(folder)
    handles = {}
    for name in sorted(files):
        if files[name] not in handles:
            handles[files[name]] = safe_open(str(files[name]), framework="pt")
        handle = handles[files[name]]
        view = handle.get_slice(name)
        sample = strided_sample(handle, name)
        h.update(f"{name}{tuple(view.get_shape())}{view.get_dtype()}".encode() + sample.float().numpy().tobytes())
    return h.hexdigest()[:16]
