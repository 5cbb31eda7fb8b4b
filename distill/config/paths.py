"""Paths a recipe names: local files and folders (shipped ones found from any directory), hub ids."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


PROJECT_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(value: str) -> str:
    """``value`` as given when it exists from here; else, for a relative path that exists under the
    project's root (a shipped asset or recipe named by a shipped recipe), that file; else as given.
    So shipped recipes run from any directory (``draftsmith run dflash_testbed``)."""
    path = Path(os.path.expanduser(value))
    if path.exists() or path.is_absolute() or not (PROJECT_ROOT / path).exists():
        return value
    return str(PROJECT_ROOT / path)


def existing_path(value: str, what: str) -> str:
    value = resolve_path(value)
    if not Path(os.path.expanduser(value)).exists():
        raise ValueError(f"{what} '{value}' does not exist")
    return value


def pretrained_folder(value: str, what: str) -> str:
    """An existing ``save_pretrained`` folder: a config.json that parses and weight files that are whole."""
    from ..checks import check_checkpoint

    value = existing_path(value, what)
    check_checkpoint(value, what)
    return value


def target_folder(path: str) -> Path:
    """The folder a target named by ``path`` ('testbed' or a folder; a hub id names no folder here) would be."""
    from ..testbed import SHIPPED_TARGET

    return SHIPPED_TARGET if path == "testbed" else Path(os.path.expanduser(path))


def local_config(path: str) -> dict | None:
    """The config.json of a target named by ``path`` when it is on disk ('testbed' or a folder), else None."""
    from ..checks import read_config

    folder = target_folder(path)
    return read_config(folder, "target") if (folder / "config.json").exists() else None


def same_folder(path: str, target: str) -> bool:
    """Whether the folder ``path`` is the target named by ``target`` (self-speculation)."""
    return Path(os.path.expanduser(path)).resolve() == target_folder(target).resolve()


def local_or_hub(value: str, what: str, probe_file: str) -> str:
    """A local folder that exists, or a hub id (which, offline, must already be in the local cache)."""
    value = resolve_path(value)
    if Path(os.path.expanduser(value)).exists() or not HUB_ID.match(value):
        return existing_path(value, what)
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(value, probe_file), str):
            raise ValueError(
                f"{what} '{value}' is neither a local folder nor in the hub cache, and HF_HUB_OFFLINE is set"
            )
    return value


RecipePath = Annotated[str, AfterValidator(lambda v: existing_path(v, "recipe file"))]
