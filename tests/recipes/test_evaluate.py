"""The eval recipe (recipes.evaluate): its report (tau, speedup, losslessness, kernels and graphs, batches,
draft vocabularies, the quantized KV cache's quality), the records it serves, and the settings it refuses
before any compute."""

from __future__ import annotations

import pytest
import torch

from distill.config import TargetConfig
from distill.models import load_target
from serve_eval.cpu import prepack
from serve_eval.cpu.attention import available as attention_builds
from serve_eval.loop import plain_generate

from ..conftest import drafter_recipe, reset_accelerate


@pytest.mark.parametrize(
    "decoding",
    [
        {"budget": {"adaptive": False}},
        {"mode": "tree", "tree_budgets": [2, 8]},
        {"vocab": {"size": 128, "prompts": 4}, "cpu": {"int8": "head"}},
        {"vocab": {"size": 96, "prompts": 4, "candidates": 8, "rank": 16}},
    ],
)
def test_eval_recipe_reports_tau_speedup_and_losslessness(tmp_path, tiny_target_dir, trained_drafters, decoding):
    from recipes import evaluate
    from recipes.registry import parse_recipe

    recipe = parse_recipe(
        {
            "recipe": "eval",
            "output_dir": str(tmp_path),
            "target": {"path": str(tiny_target_dir)},
            "drafter": str(trained_drafters["dflash"].folder),
            "prompts": {"from_corpus": 3, "split": "val", "prompt_tokens": 16},
            "decoding": {"max_new_tokens": 24, **decoding},
            "peer_assistant": str(tiny_target_dir),  # the target assisting itself: all accepted
            "peer_prompt_lookup": 3,
            "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
        }
    )
    report = evaluate.main(recipe)
    for key in ("peer_transformers_assisted", "peer_prompt_lookup"):
        peer = report[key]
        assert peer["same_as_greedy"] is True and peer["tokens_per_s"] > 0 and peer["speedup"] > 0
        assert peer["ours_over_peer"] == pytest.approx(report["tokens_per_s"] / peer["tokens_per_s"], rel=1e-3)
    if decoding.get("budget", {}).get("adaptive", True):  # the budget's cost table and its choices are reported
        adaptive = report["adaptive"]
        assert set(adaptive["verify_ms"]) >= {"1", "3"} and 1 <= adaptive["mean_verified"] <= 9
        histogram = {int(n): c for n, c in adaptive["verified_histogram"].items()}
        assert sum(n * c for n, c in histogram.items()) / sum(histogram.values()) == pytest.approx(
            adaptive["mean_verified"], abs=1e-3
        )
        for key in ("predicted", "measured"):  # the cost model's tokens/s beside the steps' own
            row = adaptive[key]
            assert 1.0 <= row["tau"] <= 9 and row["step_ms"] > 0
            assert row["tokens_per_s"] == pytest.approx(1e3 * row["tau"] / row["step_ms"], rel=0.01)
    else:
        assert report["adaptive"] is None
    if "mode" in decoding:
        assert [row["tree_budget"] for row in report["by_budget"]] == [2, 8]
        assert (tmp_path / "tau_speedup_by_budget.png").stat().st_size > 1000
    saved = __import__("json").loads((tmp_path / "report.json").read_text())
    assert saved == report and report["lossless"] is True and report["prompts"] == 3
    assert 1.0 <= report["tau"] <= 4.0 and len(report["acceptance_by_position"]) == 3
    assert report["tokens_per_s"] > 0 and report["baseline_tokens_per_s"] > 0
    assert report["speedup"] == pytest.approx(report["tokens_per_s"] / report["baseline_tokens_per_s"], rel=1e-3)
    split = report["time_split"]
    assert 0 < split["draft_fraction"] < 1 and 0 < split["verify_fraction"] < 1 and report["torch_threads"] == 1
    assert (tmp_path / "acceptance_by_position.png").stat().st_size > 1000
    # auto on the CPU: the target's Linears prepacked (AVX2 panels where they build), every Linear of the drafter in int8 on our kernel
    assert report["target_prepack"]["linears"] == 7 * 4 + 1  # the tiny target: 4 layers
    assert report["target_prepack"]["kernel"] == ("panels" if prepack.panels_available() else "onednn")
    assert report["target_attention"]["kernel"] == (
        "draftsmith_fp32" if attention_builds() else "sdpa"
    )  # and its attention,
    assert report["draft_attention"] == report["target_attention"]  # and the block drafter's
    assert report["target_forward"] == "lean"  # a Llama target: serve_eval.cpu.lean's walk
    assert report["drafter_int8"]["which"] == decoding.get("cpu", {}).get("int8", "all") and report["drafter_int8"][
        "kernel"
    ] in ("avx512-vnni", "avx2")
    graph = report[
        "draft_compiled"
    ]  # and the draft compiled as one graph, over caches for 16 + 24 positions and a block
    vocab = decoding.get("vocab", {})
    assert graph["graph"] == "decode" + ("" if "candidates" in vocab else " + propose")
    assert graph["cache_positions"] == 16 + 24 + 4 + 1 and graph["graph_drafts"] > 10
    if "size" in vocab:  # the heads restricted to the 128 tokens the target's answers use most
        record = report["draft_vocab"]
        assert record["size"] == vocab["size"] and record["counted_tokens"] == 4 * 24 and 0.5 < record["coverage"] <= 1
    if "candidates" in vocab:  # 96 static tokens and each row's 8 best by a rank-16 head
        per_step = report["draft_vocab"]["per_step"]
        assert per_step == {"static": 96, "candidates": 8, "rank": 16, "size": 104}
        assert report["drafter_int8"]["which"] == "all"  # every Linear but the per-step head, which keeps its rows
        assert type(trained_drafters["dflash"].lm_head).__name__ != "CandidateHead"  # the eval's own copy changed
    elif "cpu" in decoding:  # the restricted head, served from int8 codes of its 128 rows
        int8 = report["drafter_int8"]
        assert int8["which"] == "head" and int8["linears"] == 1 and int8["int8_bytes"] < int8["weight_bytes"] / 3


def test_batches_run_every_drafter_and_compiled_drafts_refuse_drafters_they_do_not_run(
    tmp_path, tiny_target_dir, trained_drafters
):
    """Batches need as many prompts as rows, and run any drafter (EAGLE-3 here, each row its own state);
    a compiled draft is a block drafter's: asked for another, refused before any compute."""
    from distill.config import RecipeError
    from recipes import evaluate
    from recipes.registry import parse_recipe

    def recipe(kind, **decoding):
        return parse_recipe(
            {
                "recipe": "eval",
                "output_dir": str(tmp_path / kind),
                "target": {"path": str(tiny_target_dir)},
                "drafter": str(trained_drafters[kind].folder),
                "prompts": {"from_corpus": 2, "split": "val", "prompt_tokens": 16},
                "decoding": {"max_new_tokens": 8, **decoding},
                "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
            }
        )

    with pytest.raises(RecipeError, match="decoding.batches.sizes: 4 rows need at least as many prompts"):
        evaluate.main(recipe("dflash", batches={"sizes": [4]}))
    with pytest.raises(
        RecipeError, match="decoding.cpu.compile = 'on' compiles a block drafter's draft.*Eagle3Drafter"
    ):
        evaluate.main(
            recipe("eagle3", cpu={"compile": "on"})
        )  # a compiled draft is a block drafter's; off / auto: eager
    assert not (tmp_path / "eagle3" / "report.json").exists()  # refused before any compute
    report = evaluate.main(recipe("eagle3", cpu={"compile": False}, batches={"sizes": [2]}))
    assert report["draft_compiled"] == "off"  # a bare YAML off
    assert report["by_batch"][0]["batch"] == 2 and report["by_batch"][0]["lossless"] is True


def test_an_eval_with_batches_reports_each_size_measured_plain_first_and_last(
    tmp_path, tiny_target_dir, trained_drafters
):
    """``decoding.batches.sizes``: each size decodes every prompt plainly, speculatively, speculatively
    again and plainly again (drift cancels), ``batches.rounds`` times; the row's speedup pools every
    pair, each half is reported, and all eight outputs are the same greedy tokens."""
    from recipes import evaluate
    from recipes.registry import parse_recipe

    recipe = parse_recipe(
        {
            "recipe": "eval",
            "output_dir": str(tmp_path),
            "target": {"path": str(tiny_target_dir)},
            "drafter": str(trained_drafters["dflash"].folder),
            "prompts": {"from_corpus": 3, "split": "val", "prompt_tokens": 16},
            "decoding": {"max_new_tokens": 12, "batches": {"sizes": [2], "rounds": 2}},
            "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
        }
    )
    [row] = evaluate.main(recipe)["by_batch"]
    assert row["batch"] == 2 and row["prompts"] == 3 and row["rounds"] == 2 and row["lossless"] is True
    assert len(row["speedup_halves"]) == 4 and min(row["speedup_halves"]) <= row["speedup"] <= max(
        row["speedup_halves"]
    )
    assert 1.0 <= row["tau"] <= 4.0 and row["scheduler"]["predicted_speedup"] > 0
    assert row["scheduler"]["up_front_margin"] == 1.6  # 3 prompts through 2 slots: a run that is mostly its tail


def test_draft_vocabularies_refuse_what_they_cannot_restrict(tmp_path, tiny_target_dir, trained_drafters):
    """A draft vocabulary (static or per step) on a target drafting for itself would change the target;
    a per-step one with an explicit int8 head, or larger than the head, is refused too: each before any
    compute, naming the key."""
    from distill.config import RecipeError
    from recipes import evaluate
    from recipes.registry import parse_recipe

    def recipe(drafter, **decoding):
        return parse_recipe(
            {
                "recipe": "eval",
                "output_dir": str(tmp_path),
                "target": {"path": str(tiny_target_dir)},
                "drafter": str(drafter),
                "prompts": {"from_corpus": 2, "split": "val", "prompt_tokens": 16},
                "decoding": {"max_new_tokens": 8, **decoding},
                "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
            }
        )

    with pytest.raises(RecipeError, match="decoding.vocab.size = 64: .*the drafter .* is the target"):
        recipe(tiny_target_dir, vocab={"size": 64}, cpu={"int8": "off"})  # refused with the recipe
    with pytest.raises(RecipeError, match="decoding.vocab.candidates = 64: .*the drafter .* is the target"):
        recipe(tiny_target_dir, vocab={"candidates": 64}, cpu={"int8": "off"})
    dflash = trained_drafters["dflash"].folder
    with pytest.raises(RecipeError, match="decoding.cpu.int8 = 'head' with decoding.vocab.candidates"):
        recipe(dflash, vocab={"candidates": 64}, cpu={"int8": "head"})
    with pytest.raises(RecipeError, match="decoding.vocab.candidates = 600 .* do not fit the drafter's 512 x"):
        evaluate.main(recipe(dflash, vocab={"candidates": 600}))
    assert not (tmp_path / "report.json").exists()


def test_served_records_feed_the_drafter_recipe_and_kv_quality_is_reported(tmp_path, tiny_target_dir, trained_drafters):
    """Online adaptation: an eval with record_served writes each prompt and the answer served (the
    target's own: equal to plain decoding) in regenerate's record form, and a drafter recipe keeps
    training the drafter on those records. The same eval with an int8 KV cache reports kv_quality."""
    import json

    from recipes import evaluate, train_drafter
    from recipes.registry import parse_recipe

    folder = trained_drafters["dflash"].folder
    recipe = parse_recipe(
        {
            "recipe": "eval",
            "output_dir": str(tmp_path / "serve"),
            "target": {"path": str(tiny_target_dir)},
            "drafter": str(folder),
            "record_served": True,
            "prompts": {"from_corpus": 4, "split": "train", "prompt_tokens": 16},
            "decoding": {"max_new_tokens": 24, "kv": {"format": "int8"}},
            "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
        }
    )
    report = evaluate.main(recipe)
    quality = report["kv_quality"]
    assert (
        quality["format"] == "int8"
        and quality["bytes_per_token"]["quantized"] < 0.3 * quality["bytes_per_token"]["full"]
    )
    assert abs(quality["nll"]["quantized"] - quality["nll"]["full"]) < 0.05 and 0 < quality["same_tokens_share"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "serve" / "served.jsonl").read_text().splitlines()]
    target, _ = load_target(TargetConfig(path=str(tiny_target_dir)))
    from serve_eval.kv import KVQuant

    for row in rows:
        plain, _ = plain_generate(
            target, torch.tensor(row["prompt_ids"]), 24, target.config.eos_token_id, kv=KVQuant("int8")
        )
        assert row["response_ids"] + ([target.config.eos_token_id] if row["eos"] else []) == plain
        assert row["tau"] >= 1.0 and len(row["accepted_by_position"]) == 3
    assert len(rows) == 4
    reset_accelerate()
    adapt = drafter_recipe(
        tmp_path / "adapt", tiny_target_dir, "dflash", {"init_from": str(folder)}, max_steps=6, eval_every=6
    )
    data = adapt.data.model_copy(
        update={
            "source": "files",
            "format": "prompt_response",
            "train_files": [str(tmp_path / "serve" / "served.jsonl")],
            "max_documents": None,
        }
    )
    summary = train_drafter.main(adapt.model_copy(update={"data": data}))
    assert summary["steps"] == 6
