"""The quickstart pipeline on the testbed: shipped target and trained-now target both end in a summary."""

from __future__ import annotations

import json

import pytest
import yaml

from distill.testbed import SHIPPED_DRAFTERS, SHIPPED_TARGET
from recipes import quickstart
from recipes.registry import parse_recipe

from ..conftest import tiny_lm_recipe, write_recipe

TARGET_KEYS = {"checkpoint", "val_loss", "val_ppl", "train_seconds", "tokens_per_s", "mfu"}


def test_quickstart_with_the_shipped_target(tmp_path):
    out = tmp_path / "qs"
    tiny_eval = ["prompts.from_corpus=2", "prompts.prompt_tokens=16", "decoding.max_new_tokens=16"]
    summary = quickstart.main(
        parse_recipe(
            {
                "recipe": "quickstart",
                "output_dir": str(out),
                "target": {"eval_batches": 2},
                "shipped_drafter": {"overrides": tiny_eval},
                "drafter": {"enabled": False},
            }
        )
    )
    saved = json.loads((out / "summary.json").read_text())
    target = saved["target"]
    assert target == summary["target"] and target.keys() >= TARGET_KEYS
    seq_len = yaml.safe_load((SHIPPED_TARGET / "recipe.yaml").read_text())["data"]["seq_len"]
    assert target["source"].startswith("shipped") and target["val_tokens"] == 2 * 8 * seq_len
    assert 1 < target["val_ppl"] < 60 and target["tokens_per_s"] > 0 and 0 < target["mfu"] < 1
    shipped = saved["shipped_drafter"]  # the shipped DFlash drafter, measured now as a chain and as a tree
    assert shipped == summary["shipped_drafter"] and shipped["kind"] == "dflash" and shipped["simulated_tau"] > 1
    for mode in ("chain", "tree", "chain_full_draft", "chain_lookup", "tree_lookup"):
        row = shipped[mode]  # a trained drafter's drafts are kept: more than one token a target forward
        assert row["lossless"] is True and row["prompts"] == 2 and shipped[f"{mode}_tau"] == row["tau"] > 1, (mode, row)
        assert (
            shipped[f"{mode}_speedup"]
            == row["speedup"]
            == pytest.approx(row["tokens_per_s"] / row["baseline_tokens_per_s"], rel=1e-3)
        )
    assert shipped["simulated_minus_measured_tau"] == round(
        shipped["simulated_tau"] - shipped["chain_full_draft_tau"], 4
    )
    assert shipped["tree_budget"] == quickstart.best_tree_budget(
        json.loads((SHIPPED_DRAFTERS["dflash"] / "results.json").read_text())
    )


@pytest.mark.slow
def test_quickstart_trains_its_target_when_asked(tmp_path):
    out = tmp_path / "qs"
    train_recipe = write_recipe(
        tmp_path / "tiny.yaml", tiny_lm_recipe(tmp_path / "ignored", model={"num_layers": 4}, train={"max_steps": 4})
    )
    tiny_drafter = [
        "data.max_documents=40",
        "data.val_fraction=0.1",
        "data.seq_len=64",
        "drafter.block_size=4",
        "regenerate.train_prompts=8",
        "regenerate.val_prompts=4",
        "regenerate.prompt_tokens=12",
        "regenerate.max_new_tokens=12",
        "regenerate.batch_size=4",
        f"features.cache_dir={out / 'features'}",
        "train.max_steps=4",
        "train.eval_every=2",
        "train.eval_batches=2",
        "train.micro_batch_size=4",
        "train.torch_threads=1",
    ]
    recipe = parse_recipe(
        {
            "recipe": "quickstart",
            "output_dir": str(out),
            "target": {"source": "train", "train_recipe": str(train_recipe)},
            "drafter": {"overrides": tiny_drafter},
            "eval": {
                "overrides": [
                    "prompts.from_corpus=2",
                    "prompts.prompt_tokens=12",
                    "decoding.max_new_tokens=12",
                    "data.max_documents=40",
                    "data.val_fraction=0.1",
                ]
            },
            "export": {
                "overrides": [
                    "prompts.from_corpus=2",
                    "prompts.prompt_tokens=12",
                    "gate.max_new_tokens=12",
                    "data.max_documents=40",
                    "data.val_fraction=0.1",
                ]
            },
        }
    )
    summary = quickstart.main(recipe)
    target = summary["target"]
    assert target["source"] == "trained in this run" and target["checkpoint"] == str(out / "target" / "model")
    assert target.keys() >= TARGET_KEYS and target["train_seconds"] > 0
    trained = json.loads((out / "target" / "summary.json").read_text())
    assert target["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-4)  # same split, same metric
    drafter = summary["drafter"]
    assert drafter["kind"] == "dflash" and drafter["steps"] == 4 and len(drafter["acceptance_by_position"]) == 3
    assert 1.0 <= drafter["simulated_tau"] <= 4.0 and drafter["tokens_per_s"] > 0
    saved = json.loads((out / "summary.json").read_text())
    assert saved["drafter"] == drafter
    evaluation = saved["eval"]
    assert evaluation["lossless"] is True and evaluation["prompts"] == 2
    assert evaluation["speedup"] == pytest.approx(
        evaluation["tokens_per_s"] / evaluation["baseline_tokens_per_s"], rel=1e-3
    )
    export = saved["export"]  # stage 4: the drafter exported behind the parity gate
    assert export["gate"]["passed"] and export["gate"]["logits_max_abs_diff"] == 0.0
    assert export["formats"]["transformers"] == str(out / "export" / "transformers")
    assert export["formats"]["speculators"] == str(
        out / "export" / "speculators"
    )  # the recipe has qk_norm: vLLM loads it
    assert (out / "export" / "README.md").exists() and (out / "export" / "export.json").exists()


def test_a_shipped_drafter_that_does_not_exist_is_refused_before_any_compute(tmp_path, monkeypatch):
    from distill import testbed
    from distill.config import RecipeError

    for kind in ("dflash", "dspark", "eagle3"):  # every kind shipped now
        parse_recipe({"recipe": "quickstart", "output_dir": "unused", "shipped_drafter": {"kind": kind}})
    monkeypatch.setitem(testbed.SHIPPED_DRAFTERS, "eagle3", tmp_path / "not_shipped")
    with pytest.raises(RecipeError, match="no eagle3 drafter is shipped"):
        parse_recipe({"recipe": "quickstart", "output_dir": "unused", "shipped_drafter": {"kind": "eagle3"}})
    parse_recipe(
        {"recipe": "quickstart", "output_dir": "unused", "shipped_drafter": {"kind": "eagle3", "enabled": False}}
    )
