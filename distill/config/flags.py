"""Command-line flags derived from a recipe schema: one flag per leaf field, so a command's options,
their types, choices, help and defaults have one source, the schema.

A leaf is a field whose annotation is not itself a section (a pydantic model). Its flag is its dotted
key with the command's ``strip`` prefix removed, ``.`` and ``_`` written ``-``: ``decoding.kv.format``
-> ``--kv-format``, ``decoding.batches.sizes`` -> ``--batches-sizes``, ``output_dir`` -> ``--output-dir``.
The annotation gives the argument: a ``Literal`` its choices, a ``bool`` a ``--flag`` / ``--no-flag``
pair, a ``list`` one or more values, ``Optional[X]`` an X. Every flag defaults to None (the schema's
default holds, and the help says what it is); the values a command line gives are dotted keys
(:func:`given`) that the caller sets in the raw recipe before it is validated, as overrides are.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Flag:
    key: str  # the dotted key in the recipe: decoding.kv.format
    flag: str  # --kv-format
    field: FieldInfo


def section_of(annotation: Any) -> type[BaseModel] | None:
    """The section (pydantic model) an annotation holds, bare or Optional; None for a leaf."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every leaf field of ``model``, depth first in declaration order, as (dotted key, field)."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = section_of(field.annotation)
        if section is None:
            yield key, field
        else:
            yield from leaves(section, key + ".")


def flag_name(key: str, strip: str = "") -> str:
    """``decoding.kv.format`` with ``strip="decoding."`` -> ``--kv-format``."""
    return "--" + key.removeprefix(strip).replace(".", "-").replace("_", "-")


def flags(model: type[BaseModel], prefix: str = "", strip: str = "") -> list[Flag]:
    """One :class:`Flag` per leaf of ``model`` (a section found at ``prefix``, e.g. ``"decoding."``)."""
    return [Flag(key, flag_name(key, strip), field) for key, field in leaves(model, prefix)]


def _bare(annotation: Any) -> Any:
    """``Optional[X]`` -> X."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def argument(field: FieldInfo) -> dict:
    """argparse keyword arguments for a leaf field's annotation (not its help or default)."""
    annotation = _bare(field.annotation)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        values = typing.get_args(annotation)
        return {"type": type(values[0]), "choices": list(values)}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is list:
        (item,) = typing.get_args(annotation)
        return {"type": _bare(item), "nargs": "+"} if _bare(item) in (int, float, str) else _unsupported(field)
    if annotation in (int, float, str):
        return {"type": annotation}
    return _unsupported(field)


def _unsupported(field: FieldInfo) -> dict:
    raise TypeError(f"no command-line flag for a field of type {field.annotation}")


def add_flags(parser: argparse.ArgumentParser, wanted: list[Flag], defaults: dict[str, Any] | None = None) -> None:
    """Add ``wanted`` to ``parser``: dest = the dotted key, default None, help = the field's description
    and the default that holds without the flag (``defaults[key]`` where the command supplies one, else
    the schema's). A required field the command does not supply is a required flag."""
    defaults = defaults or {}
    for f in wanted:
        kwargs = argument(f.field)
        if f.key in defaults:
            default, required = defaults[f.key], False
        else:
            default, required = f.field.get_default(call_default_factory=True), f.field.is_required()
        help_ = (f.field.description or "").replace("%", "%%")
        if not required:
            shown = default if default is not None else "unset"
            help_ += f" (default: {shown})"
        metavar = {} if "choices" in kwargs or "action" in kwargs else {"metavar": f.key.rsplit(".", 1)[-1].upper()}
        parser.add_argument(f.flag, dest=f.key, default=None, required=required, help=help_, **metavar, **kwargs)


def given(args: argparse.Namespace, wanted: list[Flag]) -> dict[str, Any]:
    """The dotted keys a command line set (flags left out are not in it), with their values."""
    return {f.key: getattr(args, f.key) for f in wanted if getattr(args, f.key) is not None}
