"""The one registry of recipes: each ``recipe:`` name and the module that runs it.

A recipe module declares ``SCHEMA`` (its typed config, a :class:`distill.config.RecipeBase` whose
``recipe`` field is ``Literal[name]``) and ``main(recipe, dry_run=False) -> dict``. Parsing, the
command line (``draftsmith run``, ``validate``, ``ls``) and the schema table
(:func:`schema_table`) all derive from :data:`RECIPES`; a test checks that every entry declares both.

Shipped recipe files live in ``recipes/configs/``; :func:`find_config` resolves a name
(``dflash_testbed``) there from any directory, and a path as given.
"""

from __future__ import annotations

import difflib
import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from distill.config import RecipeBase, RecipeError, apply_overrides, read_yaml_mapping, validate_recipe

RECIPES = {
    "train_lm": "recipes.train_lm",
    "train_drafter": "recipes.train_drafter",
    "distill_student": "recipes.distill_student",
    "regenerate": "recipes.regenerate",
    "eval": "recipes.evaluate",
    "bench": "recipes.bench",
    "quantize": "recipes.quantize",
    "export": "recipes.export",
    "quickstart": "recipes.quickstart",
}

CONFIGS = Path(__file__).resolve().parent / "configs"


def recipe_module(name: str) -> ModuleType:
    return importlib.import_module(RECIPES[name])


def parse_recipe(raw: Any, source: str = "recipe") -> RecipeBase:
    """Validate a raw mapping into the schema its ``recipe:`` key names, or raise :class:`RecipeError`."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: expected a YAML mapping at the top level, got {type(raw).__name__}")
    name = raw.get("recipe")
    if name not in RECIPES:
        close = difflib.get_close_matches(str(name), list(RECIPES), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise RecipeError(f"{source}: key 'recipe' = {name!r} is not a known recipe (one of {sorted(RECIPES)}){hint}")
    return validate_recipe(recipe_module(name).SCHEMA, raw, source)


def shipped_configs() -> dict[str, Path]:
    """Every recipe file shipped in ``recipes/configs/``, by name (the file name without ``.yaml``)."""
    return {p.stem: p for p in sorted(CONFIGS.glob("*.yaml"))}


def find_config(name_or_path: str | os.PathLike) -> Path:
    """A recipe file: ``name_or_path`` itself when it exists, else the shipped config of that name
    (``dflash_testbed`` or ``dflash_testbed.yaml``), else :class:`RecipeError` with the closest names."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_configs()
    stem = path.name.removesuffix(".yaml")
    if path.parent == Path(".") and stem in shipped:
        return shipped[stem]
    close = difflib.get_close_matches(stem, list(shipped), n=3)
    hint = f"; closest shipped recipes: {', '.join(close)}" if close else "; `draftsmith ls` lists the shipped recipes"
    raise RecipeError(f"recipe file '{name_or_path}' does not exist and is not a shipped recipe name{hint}")


def load_recipe(name_or_path: str | os.PathLike, overrides: list[str] | None = None) -> RecipeBase:
    """Read a recipe file (a path, or a shipped recipe's name), apply overrides and validate it."""
    path = find_config(name_or_path)
    return parse_recipe(apply_overrides(read_yaml_mapping(path), overrides or []), source=str(path))


def run_recipe(recipe: RecipeBase, dry_run: bool = False) -> dict:
    return recipe_module(recipe.recipe).main(recipe, dry_run=dry_run)


def describe(path: Path, width: int = 100) -> str:
    """A shipped recipe file's one-line summary: the first sentence of its header comment, cut to ``width``."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text and words:
            break
        words += text.split()
    text = " ".join(words)
    if ". " in text:
        text = text[: text.index(". ") + 1]
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def schema_table() -> list[dict]:
    """Each recipe name, its module and the first line of its schema's docstring (``draftsmith ls --recipes``)."""
    rows = []
    for name, module in RECIPES.items():
        schema = recipe_module(name).SCHEMA
        rows.append(
            {
                "recipe": name,
                "module": module,
                "schema": schema.__name__,
                "summary": (schema.__doc__ or "").strip().split("\n")[0],
            }
        )
    return rows
