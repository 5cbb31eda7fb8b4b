"""The command line and the recipe registry it derives from."""

from __future__ import annotations

import typing

import pytest

from distill.config import RecipeBase, RecipeError
from recipes import cli
from recipes.registry import CONFIGS, RECIPES, find_config, load_recipe, recipe_module, shipped_configs


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_registered_recipe_declares_its_schema_and_entry_point(name):
    module = recipe_module(name)
    assert issubclass(module.SCHEMA, RecipeBase)
    assert typing.get_args(module.SCHEMA.model_fields["recipe"].annotation) == (name,)
    assert callable(module.main)


def test_every_shipped_recipe_names_a_registered_recipe_kind():
    import yaml

    kinds = {p.stem: yaml.safe_load(p.read_text())["recipe"] for p in CONFIGS.glob("*.yaml")}
    assert kinds and set(kinds.values()) <= set(RECIPES), kinds


def test_ls_lists_every_shipped_recipe_with_a_summary(capsys):
    assert cli.main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(shipped_configs())
    assert all(len(line.split()) > 2 for line in lines), lines  # a name and a sentence
    assert cli.main(["ls", "--recipes"]) == 0
    assert {line.split()[0] for line in capsys.readouterr().out.splitlines()} == set(RECIPES)


def test_recipes_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config("dflash_testbed") == CONFIGS / "dflash_testbed.yaml"
    assert find_config("dflash_testbed.yaml") == CONFIGS / "dflash_testbed.yaml"
    assert load_recipe("eval_testbed", ["decoding.max_new_tokens=7"]).decoding.max_new_tokens == 7
    with pytest.raises(RecipeError, match="closest shipped recipes: dflash_testbed"):
        find_config("dflash_testbd")
    local = tmp_path / "dflash_testbed.yaml"  # a file of that name here wins over the shipped one
    local.write_text((CONFIGS / "dflash_testbed.yaml").read_text())
    assert find_config("dflash_testbed.yaml").resolve() == local


def test_an_unknown_recipe_name_exits_2_naming_it(capsys):
    assert cli.main(["validate", "no_such_recipe"]) == 2
    assert "no_such_recipe" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["ls", "run", "validate", "eval", "export"])
def test_every_subcommand_has_help_and_examples(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text and "draftsmith " + command in text
    parser = cli._parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    undocumented = [a.dest for a in sub._actions if a.dest != "help" and not a.help]
    assert not undocumented, f"{command}: flags without help: {undocumented}"


def _decoding_leaves(model, prefix=()):
    """Every leaf of a section, walked here on its own (not with distill.config.flags): (path, field)."""
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        section = next(
            (
                a
                for a in (field.annotation, *typing.get_args(field.annotation))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
        yield from _decoding_leaves(section, (*prefix, name)) if section else [((*prefix, name), field)]


def _eval_options() -> dict:
    parser = cli._parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["eval"]
    return {option: action for action in sub._actions for option in action.option_strings}


def test_every_decoding_option_has_an_eval_flag_named_by_its_key():
    """``decoding.kv.format`` -> ``--kv-format``: one flag per leaf of DecodingSection, its help the
    field's description, its choices the Literal's, and no default of its own (the schema's holds)."""
    from distill.base.decoding import DecodingSection

    options = _eval_options()
    leaves = list(_decoding_leaves(DecodingSection))
    assert len(leaves) >= 30
    for path, field in leaves:
        flag = "--" + "-".join(path).replace("_", "-")
        assert flag in options, f"decoding.{'.'.join(path)} has no flag {flag}"
        action = options[flag]
        assert action.dest == "decoding." + ".".join(path) and action.default is None
        assert field.description and action.help.startswith(field.description.replace("%", "%%"))
        if typing.get_origin(field.annotation) is typing.Literal:
            assert list(action.choices) == list(typing.get_args(field.annotation))
    for flag in (
        "--kv-format",
        "--batches-sizes",
        "--vocab-size",
        "--ssd-enabled",
        "--no-ssd-enabled",
        "--cpu-int8",
        "--lookup-tokens",
        "--no-budget-adaptive",
        "--output-dir",
        "--record-served",
        "--drafter",
    ):
        assert flag in options, flag
    assert options["--drafter"].required  # the one key the eval recipe needs that the command does not supply


def _another_value(field):
    """A value of the field's type other than its default, and the command-line words for it."""
    annotation = next(a for a in (field.annotation, *typing.get_args(field.annotation)) if a is not type(None))
    default = field.get_default(call_default_factory=True)
    if typing.get_origin(annotation) is typing.Literal:
        value = next(v for v in typing.get_args(annotation) if v != default)
        return value, [value]
    if annotation is bool:
        return not default, []
    if typing.get_origin(annotation) is list:
        return [2, 3], ["2", "3"]
    if annotation is float:
        return 0.5, ["0.5"]
    return (default or 1) + 1, [str((default or 1) + 1)]


# what a leaf set alone needs beside it to make a valid recipe (checks across keys)
COMPANIONS = {
    "ssd.enabled": ["--drafter", str(CONFIGS.parent.parent / "distill/assets/testbed_pard"), "--no-budget-adaptive"],
    "budget.verify_drafts": ["--no-budget-adaptive"],
    "kv.rotate": ["--kv-format", "int8"],
}


def test_each_eval_flag_reaches_the_validated_recipe(tmp_path, monkeypatch):
    """Every decoding flag, one at a time, with a value other than its default, and the top-level
    flags and trailing KEY=VALUE overrides: each lands at its key of the recipe that run_recipe gets."""
    import recipes.registry
    from distill.base.decoding import DecodingSection

    got = []
    monkeypatch.setattr(recipes.registry, "run_recipe", lambda recipe, dry_run=False: got.append(recipe))
    drafter = str(CONFIGS.parent.parent / "distill/assets/testbed_dflash")
    for path, field in _decoding_leaves(DecodingSection):
        key = ".".join(path)
        value, words = _another_value(field)
        flag = "--" + ("" if value is not False else "no-") + key.replace(".", "-").replace("_", "-")
        argv = ["eval", "--drafter", drafter, "--output-dir", str(tmp_path), flag, *words, *COMPANIONS.get(key, [])]
        assert cli.main(argv) == 0, argv
        section = got.pop().decoding
        for part in path:
            section = getattr(section, part)
        assert section == value, (key, section, value)
    assert (
        cli.main(
            [
                "eval",
                "--drafter",
                drafter,
                "--output-dir",
                str(tmp_path / "x"),
                "--seed",
                "3",
                "--record-served",
                "--kv-format",
                "int4",
                "decoding.kv.rotate=true",
                "prompts.prompt_tokens=32",
                "--mode",
                "tree",
            ]
        )
        == 0
    )
    recipe = got.pop()
    assert (recipe.output_dir, recipe.seed, recipe.record_served) == (str(tmp_path / "x"), 3, True)
    assert (recipe.decoding.kv.format, recipe.decoding.kv.rotate, recipe.decoding.mode) == ("int4", True, "tree")
    assert recipe.prompts.prompt_tokens == 32 and recipe.prompts.from_corpus == 16 and recipe.target.path == "testbed"
    assert (
        cli.main(["eval", "--drafter", drafter]) == 0
    )  # nothing given: the schema's defaults, the command's output_dir
    recipe = got.pop()
    assert recipe.decoding == DecodingSection() and recipe.output_dir == cli.EVAL_DEFAULTS["output_dir"]
    assert cli.main(["eval", "--drafter", drafter, "--kv-format", "int8", "decoding.kv.format=fp8"]) == 0
    assert got.pop().decoding.kv.format == "fp8"  # the overrides apply after the flags


def test_an_old_eval_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--drafter", "distill/assets/testbed_dflash", "--kv-cache", "int8"])
    assert e.value.code == 2 and "--kv-cache" in capsys.readouterr().err


def test_the_eval_examples_parse():
    """Every ``draftsmith eval`` line of the examples names only flags the command has."""
    import shlex

    options = _eval_options()
    lines = [
        line.split("#")[0] for line in cli.EXAMPLES["eval"].splitlines() if line.strip().startswith("draftsmith eval")
    ]
    assert len(lines) > 5
    for line in lines:
        flags = [w for w in shlex.split(line) if w.startswith("--")]
        assert all(f in options for f in flags), (line, [f for f in flags if f not in options])


@pytest.mark.parametrize(
    "argv",
    [["recipes.cli", "ls"], ["recipes.cli", "validate", "eval_testbed"], ["recipes.profile_step", "--help"]],
)
def test_commands_print_no_third_party_noise(argv):
    """A command's console is its own: torchao's kernels that do not load here, torch's notes on torchao's
    enums and the like are turned off before anything imports them (a fresh process, as a user runs it)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", *argv], check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
