"""The scale benchmark (recipes.bench_scale): a target padded wider computes the same function."""

from __future__ import annotations

import pytest


def test_the_scale_benchmark_pads_the_target_into_the_same_function(tmp_path, tiny_target_dir, trained_drafters):
    """``python -m recipes.bench_scale``, briefly, on the tiny target: the padded copy (MLPs twice as wide,
    the new channels zero, made once and reused) gives the original's logits bit for bit, the eval on it
    stays lossless, its weights are larger; a row per factor, the table and plot written; a recipe that is
    not an eval exits 2."""
    import json

    import yaml
    from transformers import AutoModelForCausalLM

    from recipes.bench_scale import main, pad_mlp

    recipe = tmp_path / "eval.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "recipe": "eval",
                "output_dir": str(tmp_path / "unused"),
                "target": {"path": str(tiny_target_dir)},
                "drafter": str(trained_drafters["dflash"].folder),
                "prompts": {"from_corpus": 2, "split": "val", "prompt_tokens": 16},
                "decoding": {"max_new_tokens": 16, "cpu": {"compile": "off"}, "batches": {"sizes": [2]}},
                "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
            }
        )
    )
    out = tmp_path / "out"
    rows = main(["--recipe", str(recipe), "--factors", "2", "1", "--output", str(out)])
    assert [r["factor"] for r in rows] == [1, 2] and all(r["same_logits"] and r["lossless"] for r in rows)
    assert rows[1]["checkpoint_mb"] > rows[0]["checkpoint_mb"] > 0 and rows[1]["verify_over_plain"][1] == 1.0
    for r in rows:
        assert r["speedup_over_tau"] == pytest.approx(r["speedup"] / r["tau"], abs=1e-3) and r["draft_over_plain"] > 0
        assert set(r["batches"]) == {2} and r["batches"][2] > 0
    assert json.loads((out / "scale.json").read_text()) == json.loads(json.dumps(rows))
    assert (out / "scale.png").stat().st_size > 1000
    copy = AutoModelForCausalLM.from_pretrained(out / "targets" / "x2")
    mlp = copy.model.layers[0].mlp
    width = mlp.up_proj.out_features // 2
    assert (
        width == copy.config.intermediate_size // 2
        and not mlp.up_proj.weight[width:].any()
        and not mlp.down_proj.weight[:, width:].any()
    )
    made = (out / "targets" / "x2" / "model.safetensors").stat().st_mtime_ns
    assert pad_mlp(tiny_target_dir, out / "targets" / "x2", 2) == out / "targets" / "x2"  # made once
    assert (out / "targets" / "x2" / "model.safetensors").stat().st_mtime_ns == made
    for bad in (
        ["--recipe", "recipes/configs/dflash_testbed.yaml"],
        ["--recipe", str(recipe), "decoding.budget.adaptive=false"],
    ):
        with pytest.raises(SystemExit) as exit_:
            main([*bad, "--output", str(out)])
        assert exit_.value.code == 2
