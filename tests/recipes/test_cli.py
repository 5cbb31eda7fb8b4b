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
