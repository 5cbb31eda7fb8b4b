"""What produced a run: the resolved recipe and a provenance record, written into its output folder.

``recipe.yaml`` is the recipe after overrides and defaults, so re-running it reproduces the run.
``provenance.json`` records the code (git commit, dirty flag), the package versions, the data
fingerprint, the seed, the command line and the machine.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import yaml

PACKAGES = [
    "torch",
    "transformers",
    "accelerate",
    "datasets",
    "tokenizers",
    "safetensors",
    "trl",
    "wandb",
    "torchao",
    "deepspeed",
    "draftsmith",
]
REPO = Path(__file__).resolve().parent.parent


def git_state() -> dict:
    def git(*args):
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit or None, "dirty": dirty}


def package_versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def provenance(seed: int, **extra) -> dict:
    import torch

    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_state(),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)",
        "torch_threads": torch.get_num_threads(),
        "argv": sys.argv,
        "seed": seed,
        **extra,
    }


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def write_jsonl_atomic(path: str | os.PathLike, rows: list) -> None:
    """One JSON object a line (written then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, path)


def update_json_atomic(path: str | os.PathLike, **fields) -> None:
    """Add ``fields`` to the JSON object in ``path`` (write then rename)."""
    write_json_atomic(path, {**json.loads(Path(path).read_text()), **fields})


def write_run_header(output_dir: str | os.PathLike, recipe, **extra) -> dict:
    """Write ``recipe.yaml`` (resolved) and ``provenance.json`` into ``output_dir``; return the record."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    resolved = recipe.model_dump(mode="json")
    tmp = out / f".recipe.yaml.tmp-{os.getpid()}"
    tmp.write_text(yaml.safe_dump(resolved, sort_keys=False))
    os.replace(tmp, out / "recipe.yaml")
    record = provenance(recipe.seed, **extra)
    write_json_atomic(out / "provenance.json", record)
    return record
