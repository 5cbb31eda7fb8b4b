"""Checks on the files a recipe names, run while the recipe is validated, before any compute.

Each raises ``ValueError`` with what was wrong, which file and what was expected; inside recipe
validation it becomes a :class:`~distill.config.RecipeError` naming the key, which the CLI prints
as one line with exit status 2. The checks read headers and small files only: a checkpoint's
``config.json`` and the safetensors headers (a truncated file fails there: the header promises more
bytes than the file holds), a tokenizer's presence, a prompts file line by line, and whether a
drafter's recorded target shape fits the target's ``config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def read_config(folder: str | Path, what: str) -> dict:
    """A checkpoint folder's ``config.json`` as a dict."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{what} '{folder}' has no config.json (expected a save_pretrained folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} '{folder}': config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what} '{folder}': config.json holds a {type(config).__name__}, expected an object")
    return config


def check_checkpoint(folder: str | Path, what: str) -> dict:
    """A ``save_pretrained`` folder whose config parses and whose weight files are whole. Returns the config."""
    from safetensors import safe_open

    config = read_config(folder, what)
    weights = sorted(Path(folder).glob("*.safetensors"))
    if not weights and not any(Path(folder).glob("pytorch_model*.bin")):
        raise ValueError(f"{what} '{folder}' has no weights (expected model.safetensors or its shards)")
    for file in weights:
        size = file.stat().st_size
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except Exception as e:  # safetensors raises its own error type for a short or garbled header
            raise ValueError(f"{what} '{folder}': {file.name} ({size:,} bytes) is truncated or corrupted: {e}") from None
    return config


def check_tokenizer(folder: str | Path, what: str) -> None:
    if not any((Path(folder) / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(f"{what} '{folder}' has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)}; "
                         f"save it with tokenizer.save_pretrained into the same folder)")


def read_prompts(path: str | Path, field: str = "prompt") -> list[dict]:
    """The rows of a JSONL prompts file, each ``{field: text}`` or ``{"messages": [...]}``."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompts file {path} line {number}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict) or (field not in row and "messages" not in row):
            raise ValueError(f"prompts file {path} line {number}: expected an object with a '{field}' or "
                             f"'messages' key, got {line.strip()[:60]!r}")
        if "messages" not in row and not isinstance(row[field], str):
            raise ValueError(f"prompts file {path} line {number}: '{field}' must be a string")
        rows.append(row)
    if not rows:
        raise ValueError(f"prompts file {path} holds no prompts")
    return rows


def check_drafter_fits(drafter: dict, target: dict, drafter_path: str, target_path: str) -> None:
    """A DFlash / DSpark / EAGLE-3 drafter's config against its target's: the vocabulary, the hidden
    size of the features it reads, the layers it reads them from. (A causal-LM drafter needs the
    vocabulary only.)"""
    where = f"drafter '{drafter_path}' does not fit target '{target_path}'"
    if drafter.get("vocab_size") != target.get("vocab_size"):
        raise ValueError(f"{where}: its vocabulary has {drafter.get('vocab_size')} tokens, the target's "
                         f"{target.get('vocab_size')} (it was trained for another target)")
    if not str(drafter.get("model_type", "")).startswith("draftsmith_"):
        return
    if drafter.get("target_hidden_size") not in (None, target.get("hidden_size")):
        raise ValueError(f"{where}: it reads {drafter['target_hidden_size']}-wide target features, the target's "
                         f"hidden size is {target.get('hidden_size')}")
    layers = target.get("num_hidden_layers")
    wrong = [i for i in drafter.get("target_layer_ids") or [] if layers is not None and not 0 <= i < layers]
    if wrong:
        raise ValueError(f"{where}: it reads target layers {wrong}, the target has {layers} (0..{layers - 1})")
