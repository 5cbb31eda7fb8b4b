"""Shipped configs of real targets, for dry runs that cannot reach the hub.

``recipes/configs/targets/<owner>/<name>/config.json`` holds the published ``config.json`` of a hub
target (Gemma 3: its text config), laid out as the hub id. A dry run builds the target from it on the
meta device when the hub id is neither a local folder nor in the hub cache: shapes, parameter counts
and the memory estimate need the config only. Only inside :func:`allow_shipped_target_configs` (what
``draftsmith run --dry-run`` enters) does a recipe naming such a hub id validate offline; a real run
still needs the weights and is refused up front as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from .paths import HUB_ID, PROJECT_ROOT

#: where the shipped target configs live, one folder per hub id
SHIPPED_TARGET_CONFIGS = PROJECT_ROOT / "recipes" / "configs" / "targets"

_ALLOWED: ContextVar[bool] = ContextVar("shipped_target_configs_allowed", default=False)


def shipped_target_config(path: str) -> Path | None:
    """The folder holding the shipped ``config.json`` of hub id ``path``, or None when none is shipped."""
    if not HUB_ID.match(path):
        return None
    folder = SHIPPED_TARGET_CONFIGS / path
    return folder if (folder / "config.json").is_file() else None


def in_hub_cache(hub_id: str, *files: str) -> bool:
    """Whether every one of ``files`` of hub repository ``hub_id`` is in the local hub cache."""
    from huggingface_hub import try_to_load_from_cache

    return all(isinstance(try_to_load_from_cache(hub_id, f), str) for f in files)


def shipped_config_for_dry_run(path: str) -> Path | None:
    """The shipped config folder a dry run builds target ``path`` from: inside
    :func:`allow_shipped_target_configs`, for a hub id (not a local folder) with a shipped config whose
    config and tokenizer are not both in the hub cache; else None (load ``path`` itself)."""
    if not shipped_target_configs_allowed() or Path(path).exists():
        return None
    shipped = shipped_target_config(path)
    if shipped is None or in_hub_cache(path, "config.json", "tokenizer_config.json"):
        return None
    return shipped


def shipped_target_ids() -> list[str]:
    """Every hub id with a shipped config, sorted."""
    return sorted(
        p.parent.relative_to(SHIPPED_TARGET_CONFIGS).as_posix() for p in SHIPPED_TARGET_CONFIGS.glob("*/*/config.json")
    )


@contextlib.contextmanager
def allow_shipped_target_configs() -> Iterator[None]:
    """Within the block, a target hub id with a shipped config validates without the hub or its cache,
    and :func:`distill.models.load_target` with ``weights=False`` builds it from that config."""
    token = _ALLOWED.set(True)
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def shipped_target_configs_allowed() -> bool:
    return _ALLOWED.get()
