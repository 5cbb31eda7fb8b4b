"""Recipes are validated before any compute: clear messages, exit status 2, nothing written."""

from __future__ import annotations

import pytest

from distill.config import RecipeError, apply_overrides
from recipes.cli import main as cli_main
from recipes.registry import load_recipe, parse_recipe

from ..conftest import tiny_lm_recipe, write_recipe


def error_of(raw: dict) -> str:
    with pytest.raises(RecipeError) as e:
        parse_recipe(raw, source="r.yaml")
    return str(e.value)


def test_valid_recipe_parses_with_defaults(tmp_path):
    """Every key the recipe sets keeps its value, and every key it leaves out takes its schema's default."""
    raw = tiny_lm_recipe(tmp_path / "out")
    r = parse_recipe(raw)
    assert r.train.max_steps == 12 and r.optim.schedule == "cosine" and r.model.num_kv_heads is None
    for name, field in type(r).model_fields.items():
        value = getattr(r, name)
        if name not in raw:
            assert value == field.get_default(call_default_factory=True), name
        elif not isinstance(raw[name], dict):
            assert value == raw[name], name
        else:
            assert {key: getattr(value, key) for key in raw[name]} == raw[name], name
            for key, inner in type(value).model_fields.items():
                if key not in raw[name]:
                    assert getattr(value, key) == inner.get_default(call_default_factory=True), f"{name}.{key}"


def test_unknown_key_names_it_and_suggests_the_closest(tmp_path):
    raw = tiny_lm_recipe(tmp_path / "out")
    raw["train"]["max_stpes"] = 5
    msg = error_of(raw)
    assert "unknown key 'train.max_stpes'" in msg and "did you mean 'train.max_steps'?" in msg


def test_unknown_top_level_section(tmp_path):
    raw = tiny_lm_recipe(tmp_path / "out")
    raw["optimizer"] = {}
    assert "unknown key 'optimizer'; did you mean 'optim'?" in error_of(raw)


def test_wrong_type_names_key_value_and_expectation(tmp_path):
    raw = tiny_lm_recipe(tmp_path / "out")
    raw["train"]["max_steps"] = "many"
    msg = error_of(raw)
    assert "key 'train.max_steps' = 'many'" in msg and "integer" in msg


def test_bad_choice_lists_the_valid_ones(tmp_path):
    raw = tiny_lm_recipe(tmp_path / "out")
    raw["optim"]["schedule"] = "linear"
    msg = error_of(raw)
    assert "optim.schedule" in msg and "'cosine'" in msg and "'wsd'" in msg


def test_missing_data_file_is_named(tmp_path):
    raw = tiny_lm_recipe(tmp_path / "out", data={"source": "files", "train_files": [str(tmp_path / "nope.jsonl")]})
    msg = error_of(raw)
    assert "data.train_files" in msg and "nope.jsonl" in msg and "does not exist" in msg


def test_cross_field_check(tmp_path):
    raw = tiny_lm_recipe(tmp_path / "out", data={"seq_len": 4096})
    assert "exceeds model.max_position_embeddings" in error_of(raw)


def test_unknown_recipe_kind():
    assert "did you mean 'train_lm'?" in error_of({"recipe": "train_llm", "output_dir": "x"})


def test_overrides_are_typed_yaml_scalars():
    raw = apply_overrides({"train": {"max_steps": 1}}, ["train.max_steps=20", "optim.lr=1e-3", "wandb.enabled=true"])
    assert raw == {"train": {"max_steps": 20}, "optim": {"lr": 1e-3}, "wandb": {"enabled": True}}
    with pytest.raises(RecipeError, match="section.key=value"):
        apply_overrides({}, ["train.max_steps"])


def test_cli_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    path = write_recipe(tmp_path / "r.yaml", tiny_lm_recipe(out))
    assert cli_main(["run", str(path), "train.lr=0.1"]) == 2  # 'lr' lives in optim
    err = capsys.readouterr().err
    assert "unknown key 'train.lr'; did you mean 'optim.lr'?" in err
    assert not out.exists()
    assert cli_main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not out.exists()


def test_load_recipe_applies_overrides(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", tiny_lm_recipe(tmp_path / "out"))
    assert load_recipe(path, ["train.max_steps=3"]).train.max_steps == 3


def test_lookup_drafts_serve_chains_trees_and_batches_not_ssd():
    from pydantic import ValidationError

    from distill.base.decoding import DecodingSection

    lookup = {"tokens": 8}
    for ok in (
        {"mode": "tree", "lookup": lookup},
        {"lookup": lookup},
        {"lookup": lookup, "temperature": 1.0},
        {"lookup": lookup, "batches": {"sizes": [4]}},
    ):
        assert DecodingSection(**ok).lookup.tokens == 8
    with pytest.raises(ValidationError, match="lookup.tokens: 0"):
        DecodingSection(lookup=lookup, ssd={"enabled": True}, budget={"adaptive": False})


def test_kv_cache_formats_are_checked(tmp_path):
    from pydantic import ValidationError

    from distill.base.decoding import DecodingSection

    assert DecodingSection(kv={"format": "int4", "rotate": True}).kv.rotate
    with pytest.raises(ValidationError, match="decoding.kv.rotate rotates keys and values before quantizing"):
        DecodingSection(kv={"rotate": True})
    with pytest.raises(ValidationError, match="kv.format"):
        DecodingSection(kv={"format": "int3"})
