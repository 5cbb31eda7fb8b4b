"""Checks on the files a recipe names: what was wrong, which file and what was expected, as one error.

Each raises :class:`~distill.config.RecipeError`, which the CLI prints as one line with exit status
2 (inside recipe validation it is prefixed with the key). Most run while the recipe is validated,
before any compute: a checkpoint's ``config.json`` and safetensors headers (a truncated file fails
there: the header promises more bytes than the file holds), a tokenizer's presence, a prompts file
line by line, whether a drafter's recorded target shape fits the target's ``config.json``. The
caches a run reuses (feature shards, regenerated answers) are checked when they are opened.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .config import RecipeError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def read_config(folder: str | Path, what: str) -> dict:
    """A checkpoint folder's ``config.json`` as a dict."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"{what} '{folder}' has no config.json (expected a save_pretrained folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(f"{what} '{folder}': config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise RecipeError(f"{what} '{folder}': config.json holds a {type(config).__name__}, expected an object")
    return config


def check_checkpoint(folder: str | Path, what: str) -> dict:
    """A ``save_pretrained`` folder whose config parses and whose weight files are whole. Returns the config."""
    config = read_config(folder, what)
    weights = sorted(Path(folder).glob("*.safetensors"))
    if not weights and not any(Path(folder).glob("pytorch_model*.bin")):
        raise RecipeError(f"{what} '{folder}' has no weights (expected model.safetensors or its shards)")
    for file in weights:
        check_safetensors(file, f"{what} '{folder}'")
    return config


def check_tokenizer(folder: str | Path, what: str) -> None:
    if not any((Path(folder) / name).exists() for name in TOKENIZER_FILES):
        raise RecipeError(
            f"{what} '{folder}' has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)}; "
            f"save it with tokenizer.save_pretrained into the same folder)"
        )


def jsonl_records(path: str | Path, what: str, hint: str = "") -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for every non-blank line of a JSONL file; a line that is not a JSON
    object is an error naming the file and the line (``hint``: what to do about it)."""
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecipeError(
                f"{what} {path} line {number}: not valid JSON ({e.msg} at column {e.colno}){hint}"
            ) from None
        if not isinstance(row, dict):
            raise RecipeError(f"{what} {path} line {number}: expected a JSON object, got {line.strip()[:60]!r}{hint}")
        yield number, row


def read_prompts(path: str | Path, field: str = "prompt") -> list[dict]:
    """The rows of a JSONL prompts file, each ``{field: text}`` or ``{"messages": [...]}``."""
    rows = []
    for number, row in jsonl_records(path, "prompts file"):
        if field not in row and "messages" not in row:
            raise RecipeError(
                f"prompts file {path} line {number}: expected an object with a '{field}' or "
                f"'messages' key, got {json.dumps(row)[:60]!r}"
            )
        if "messages" not in row and not isinstance(row[field], str):
            raise RecipeError(f"prompts file {path} line {number}: '{field}' must be a string")
        rows.append(row)
    if not rows:
        raise RecipeError(f"prompts file {path} holds no prompts")
    return rows


def check_safetensors(file: Path, what: str, hint: str = "") -> None:
    """A safetensors file whose header reads and whose tensors the file holds whole."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            handle.keys()
    except Exception as e:  # safetensors raises its own error type for a short or garbled header
        raise RecipeError(
            f"{what}: {file.name} ({file.stat().st_size:,} bytes) is truncated or corrupted: {e}{hint}"
        ) from None


def check_drafter_fits(drafter: dict, target: dict, drafter_path: str, target_path: str) -> None:
    """A DFlash / DSpark / EAGLE-3 drafter's config against its target's: the vocabulary, the hidden
    size of the features it reads, the layers it reads them from. (A causal-LM drafter needs the
    vocabulary only.)"""
    where = f"drafter '{drafter_path}' does not fit target '{target_path}'"
    if "speculators_model_type" in drafter:  # vLLM's speculators format: the same facts under its names
        layer = drafter.get("transformer_layer_config") or {}
        ids = drafter.get("aux_hidden_state_layer_ids") or drafter.get("eagle_aux_hidden_state_layer_ids") or []
        drafter = {
            "vocab_size": layer.get("vocab_size"),
            "model_type": f"draftsmith_{drafter['speculators_model_type']}",
            "target_hidden_size": drafter.get("target_hidden_size"),
            "target_layer_ids": [i - 1 for i in ids],  # its ids are inputs of layers, ours outputs
        }
    if drafter.get("vocab_size") != target.get("vocab_size"):
        raise RecipeError(
            f"{where}: its vocabulary has {drafter.get('vocab_size')} tokens, the target's "
            f"{target.get('vocab_size')} (it was trained for another target)"
        )
    if not str(drafter.get("model_type", "")).startswith("draftsmith_"):
        return
    if drafter.get("target_hidden_size") not in (None, target.get("hidden_size")):
        raise RecipeError(
            f"{where}: it reads {drafter['target_hidden_size']}-wide target features, the target's "
            f"hidden size is {target.get('hidden_size')}"
        )
    layers = target.get("num_hidden_layers")
    wrong = [i for i in drafter.get("target_layer_ids") or [] if layers is not None and not 0 <= i < layers]
    if wrong:
        raise RecipeError(f"{where}: it reads target layers {wrong}, the target has {layers} (0..{layers - 1})")
