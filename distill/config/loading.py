"""Recipe files, command-line overrides and validation errors that name the key, the value and what was expected."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .errors import RecipeError
from .recipes import RecipeBase


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (values parsed as YAML scalars)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"override '{item}' is not of the form section.key=value")
        set_key(raw, key, _scalar(value), f"override '{item}'")
    return raw


def set_key(raw: dict[str, Any], key: str, value: Any, what: str = "") -> dict[str, Any]:
    """Set the dotted ``key`` (``decoding.kv.format``) of a nested dict to ``value``, making the sections
    on its way; ``what`` (the override or flag) names it in the :class:`RecipeError` where a section on
    the way is a value."""
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"{what or key}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value
    return raw


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _scalar(text: str) -> Any:
    """A YAML scalar, except that ``1e-3`` is a float (YAML 1.1 would read it as a string)."""
    if text == "":
        return None
    value = yaml.safe_load(text)
    return float(value) if isinstance(value, str) and _FLOAT.match(value) else value


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (for key suggestions)."""
    model: Any = root
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return model if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = model.model_fields[part].annotation
        # Optional[Section] -> Section
        for arg in getattr(model, "__args__", ()):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                model = arg
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _format_error(cls: type[BaseModel], err: dict, source: str) -> str:
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        owner = _model_at(cls, loc[:-1])
        valid = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        elsewhere = [
            f"{name}.{loc[-1]}"
            for name, f in cls.model_fields.items()
            if isinstance(f.annotation, type)
            and issubclass(f.annotation, BaseModel)
            and loc[-1] in f.annotation.model_fields
        ]
        if close:
            hint = f"did you mean '{'.'.join(loc[:-1] + (close[0],))}'?"
        elif elsewhere:
            hint = f"did you mean '{elsewhere[0]}'?"
        else:
            hint = f"valid keys here: {', '.join(valid)}"
        return f"{source}: unknown key '{key}'; {hint}"
    if err["type"] == "missing":
        return f"{source}: missing required key '{key}'"
    if err["type"] == "moved_key":  # the message names the old key and the new one
        return f"{source}: {err['msg']}"
    msg = err["msg"].removeprefix("Value error, ")
    where = f"key '{key}'" if key else "recipe"
    if isinstance(err.get("input"), dict):  # a section's own check
        return f"{source}: {msg}" if msg.startswith(f"{key}.") or not key else f"{source}: {where}: {msg}"
    return f"{source}: {where} = {err.get('input')!r}: {msg}"


def validate_recipe(schema: type[RecipeBase], raw: dict, source: str = "recipe") -> RecipeBase:
    """``raw`` validated into ``schema`` (a recipe's typed config), or :class:`RecipeError` naming every
    bad key. Which schema a ``recipe:`` name has is :mod:`recipes.registry`'s to say."""
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        raise RecipeError("\n".join(_format_error(schema, err, source) for err in e.errors())) from None


def read_yaml_mapping(path: str | os.PathLike) -> dict:
    """A recipe file's top-level mapping, or :class:`RecipeError` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file '{path}' does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: expected a YAML mapping at the top level")
    return raw
