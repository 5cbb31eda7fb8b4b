"""Every shipped recipe validates and dry-runs; every config file the docs mention exists."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from distill.config import HUB_ID, RecipeError
from recipes.registry import load_recipe, run_recipe

from ..conftest import REPO

RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
CONFIG_REF = re.compile(r"\b((?:recipes|accelerate_configs)/[\w./-]+\.ya?ml)\b")


def test_every_recipe_kind_has_a_shipped_config_and_every_config_ships():
    """The tests below run over ``RECIPES``: every kind the registry knows has a config among them (so
    each kind validates and dry-runs here), and each lies in recipes/configs/, the folder the package ships."""
    from recipes import registry

    assert {yaml.safe_load(path.read_text())["recipe"] for path in RECIPES} == set(registry.RECIPES)
    assert {path.parent for path in RECIPES} == {registry.CONFIGS}


def needs_hub_weights(path) -> bool:
    """The recipe names a hub target or tokenizer (GPU-cluster recipes)."""
    raw = yaml.safe_load(path.read_text())
    names = [
        raw[section].get("path") or "" for section in ("target", "tokenizer") if isinstance(raw.get(section), dict)
    ]
    return any(HUB_ID.match(name) and not (REPO / name).exists() for name in names)


@pytest.fixture(scope="module")
def testbed_drafter(tmp_path_factory):
    """An untrained DFlash drafter for the shipped target: what eval recipes point at in a fresh clone."""
    from distill.config import DrafterSection, TargetConfig
    from distill.drafter_eval import build_drafter
    from distill.models import load_target

    target, tok = load_target(TargetConfig(path="testbed"))
    folder = tmp_path_factory.mktemp("drafter")
    build_drafter(DrafterSection(), target, "testbed", tok.mask_token_id).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_recipe_validates_and_dry_runs(path, monkeypatch, testbed_drafter):
    monkeypatch.chdir(REPO)  # recipes name paths relative to the repository root
    if needs_hub_weights(path):
        # GPU-cluster recipes name hub targets this machine cannot download: validate every key
        # (with the offline-cache check off), but the models cannot be built here.
        monkeypatch.delenv("HF_HUB_OFFLINE")
        assert load_recipe(path).output_dir
        with pytest.raises(RecipeError, match="nor in the hub cache"):
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
            load_recipe(path)
        return
    # eval and export recipes name a drafter that a training run makes; here, an untrained one stands in
    overrides = (
        [f"drafter={testbed_drafter}"] if yaml.safe_load(path.read_text())["recipe"] in ("eval", "export") else []
    )
    raw = yaml.safe_load(path.read_text())
    if raw["recipe"] == "quantize" and not (REPO / raw["model"]).exists():  # a drafter a training run makes
        overrides = [f"model={testbed_drafter}"]
    init_from = (raw.get("drafter") or {}).get("init_from") if isinstance(raw.get("drafter"), dict) else None
    if init_from and not (REPO / init_from).exists():  # a second schedule starts from what a first run makes:
        overrides = ["drafter.init_from=distill/assets/testbed_dflash"]  # the shipped one stands in
    files = (raw.get("data") or {}).get("train_files") or []
    if raw["recipe"] == "train_drafter" and any(f.startswith("runs/") and not (REPO / f).exists() for f in files):
        served = testbed_drafter.parent / "served.jsonl"  # what a serving run records (online adaptation)
        served.write_text(json.dumps({"prompt_ids": [5, 6, 7], "response_ids": [8, 9], "eos": True}) + "\n")
        overrides.append(f"data.train_files=[{served}]")
    recipe = load_recipe(path, overrides)
    result = run_recipe(recipe, dry_run=True)
    assert result, f"{path} dry-run returned nothing"


def documents_that_name_configs():
    docs = [REPO / "README.md", *RECIPES, *(REPO / "accelerate_configs").glob("*.yaml"), REPO / "Makefile"]
    docs += sorted((REPO / "recipes").glob("*.py"))
    docs += sorted((REPO / "docs").glob("*.md"))
    return [d for d in docs if d.exists()]


def test_every_config_named_in_docs_and_recipe_headers_exists():
    named = {}
    for doc in documents_that_name_configs():
        for ref in CONFIG_REF.findall(doc.read_text()):
            if "RECIPE" not in ref:
                named.setdefault(ref, doc.relative_to(REPO).as_posix())
    assert len(named) >= 5, named
    missing = {ref: doc for ref, doc in named.items() if not (REPO / ref).exists()}
    assert not missing, f"configs named in docs but absent: {missing}"


def test_every_accelerate_config_is_named_in_the_readme():
    readme = (REPO / "README.md").read_text()
    for cfg in (REPO / "accelerate_configs").glob("*.yaml"):
        assert f"accelerate_configs/{cfg.name}" in readme


def test_the_step_profiler_times_the_loop_pieces(capsys):
    """``python -m recipes.profile_step`` on the shipped target and DFlash drafter, briefly: every piece
    it wraps was timed, and the parts fit inside the step they belong to; ``--attention both`` prints
    both settings' profiles and their ratios; the timers come off afterwards."""
    from recipes.profile_step import main
    from serve_eval.budget import Budget
    from serve_eval.cpu import attention
    from serve_eval.proposers import BlockProposer
    from serve_eval.session import TargetSession

    originals = (TargetSession.step, BlockProposer.propose, Budget.chain_length)
    report = main(
        [
            "--drafter",
            "distill/assets/testbed_dflash",
            "--prompts",
            "2",
            "--max-new-tokens",
            "24",
            "--cpu-compile",
            "off",
            "--attention",
            "both",
        ]
    )
    parts = report["ms_per_step"]  # (eager: a compiled draft is one graph, timed as proposer.propose)
    assert {
        "proposer.propose",
        "proposer.observe",
        "  drafter.decode",
        "budget.chain_length",
        "target.verify",
        "target.keep",
        "target.prefill",
    } <= set(parts)
    assert 0 < parts["  drafter.decode"] < parts["proposer.propose"] < report["spec_step_ms"]
    assert parts["proposer.propose"] + parts["target.verify"] < report["spec_step_ms"]
    out, both = capsys.readouterr().out, attention.available()  # (sdpa alone where the kernel does not build)
    assert out.count("plain steps)") == (2 if both else 1) and "attention sdpa" in out
    assert ("speedup draftsmith_fp32 / sdpa" in out) == both
    assert (TargetSession.step, BlockProposer.propose, Budget.chain_length) == originals  # timers off


def test_the_step_profiler_compares_the_lean_forward_with_the_models(capsys):
    """``--forward both``: both forwards' profiles and their ratios; sessions made afterwards walk lean
    again; two A/Bs at once are refused."""
    from distill.models import build_causal_lm, tiny_target
    from recipes.profile_step import main
    from serve_eval.cpu.lean import lean_forward

    main(
        [
            "--drafter",
            "distill/assets/testbed_dflash",
            "--prompts",
            "2",
            "--max-new-tokens",
            "16",
            "--cpu-compile",
            "off",
            "--forward",
            "both",
        ]
    )
    out = capsys.readouterr().out
    assert out.count("plain steps)") == 2 and "forward lean" in out and "forward module" in out
    assert "speedup lean / module" in out
    assert lean_forward(build_causal_lm(tiny_target(), 100).eval()) is not None
    with pytest.raises(SystemExit):
        main(["--drafter", "distill/assets/testbed_dflash", "--attention", "both", "--forward", "both"])


def test_the_step_profiler_splits_a_batched_run(capsys):
    """``--batch B``: batched plain and speculative decoding of the recipe's prompts as the eval runs
    them, each loop's prefills and steps, the speculative step's parts, the steps by rows (at most B,
    fewer in the tail); the timers come off; a batch below 1, or with an A/B, is refused."""
    from recipes.profile_step import main
    from serve_eval import measure
    from serve_eval.budget import Budget
    from serve_eval.proposers import BlockProposer
    from serve_eval.session import TargetSession

    originals = (TargetSession.step, BlockProposer.propose, Budget.record_step, measure.generate)
    report = main(
        ["--drafter", "distill/assets/testbed_dflash", "--batch", "2", "--max-new-tokens", "12", "--cpu-compile", "off"]
    )
    assert report["batch"] == 2 and report["prompts"] == 16 and report["speedup"] > 0
    assert (
        0 < report["prefills_s"]["plain"] < report["plain_s"]
        and 0 < report["prefills_s"]["speculative"] < report["spec_s"]
    )
    parts = report["ms_per_spec_step"]
    assert parts["target steps"] > 0 and parts["draft"] > 0 and parts["scheduler.choose"] > 0
    assert set(report["by_rows"]) <= {1, 2} and 2 in report["by_rows"]
    assert "speculative steps of 2 rows" in capsys.readouterr().out
    assert (TargetSession.step, BlockProposer.propose, Budget.record_step, measure.generate) == originals
    for bad in (["--batch", "-1"], ["--batch", "2", "--attention", "both"]):
        with pytest.raises(SystemExit):
            main(["--drafter", "distill/assets/testbed_dflash", *bad])


def test_the_attention_benchmark_times_both_kernels(capsys):
    """``python -m recipes.bench_attention``, briefly: a row per query count and cache state, both
    kernels timed and their ratio printed."""
    from recipes.bench_attention import main
    from serve_eval.cpu import attention

    if not attention.available():
        pytest.skip("no AVX2 or no compiler")
    rows = main(["--queries", "1", "3", "--repeats", "3", "--context", "40", "--layers", "2"])
    assert [(r["queries"], r["cache"]) for r in rows] == [(1, "warm"), (1, "cold"), (3, "warm"), (3, "cold")]
    for r in rows:  # (the ratio of the unrounded times)
        assert r["sdpa"] > 0 and r["ours"] > 0 and r["ours / sdpa"] == pytest.approx(r["ours"] / r["sdpa"], rel=0.1)
    assert capsys.readouterr().out.count("x) for 2 layers") == 4


def test_the_linear_benchmark_frames_the_kernel_by_both_limits(capsys):
    """``python -m recipes.bench_linears``, briefly, on the shipped target: a row per row count, its
    FLOP/s and weight bytes/s each consistent with the time and with its fraction of the limit; bad
    arguments exit."""
    from recipes.bench_linears import main
    from serve_eval.cpu import prepack

    if not prepack.panels_available():
        pytest.skip("no AVX2 or no compiler")
    rows = main(["--rows", "1", "3", "--repeats", "2"])
    assert [r["rows"] for r in rows] == [1, 3]
    one, three = rows
    assert three["gflops"] == pytest.approx(3 * one["gflops"] * one["ms"] / three["ms"], rel=0.02)  # 3x the FLOPs
    assert one["gbytes_s"] == pytest.approx(three["gbytes_s"] * three["ms"] / one["ms"], rel=0.02)  # the same bytes
    for r in rows:
        assert r["ms"] > 0 and r["of_peak"] == pytest.approx(
            rows[0]["of_peak"] * r["gflops"] / rows[0]["gflops"], rel=0.02
        )
    out = capsys.readouterr().out
    assert out.count("of the peak") == 2 and "57 Linears" in out and "in fp16" in out
    for bad in (["--rows", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            main(bad)


def test_the_vocabulary_sweep_reports_tau_per_setting(capsys):
    """``python -m recipes.vocab_tau``, briefly, on the shipped target and DFlash drafter at T = 1: one
    row per setting, its share of the first's tau, the per-step head's size; a malformed entry exits 2."""
    from recipes.vocab_tau import main, parse_vocab

    rows = main(
        [
            "--drafter",
            "distill/assets/testbed_dflash",
            "--prompts",
            "2",
            "--max-new-tokens",
            "16",
            "--seeds",
            "2",
            "--vocab",
            "full",
            "0:256:16",
        ]
    )
    assert [r["vocab"] for r in rows] == ["full", "0:256:16"] and rows[0]["share"] == 1.0
    assert all(1.0 <= r["tau"] <= 8 for r in rows) and rows[1]["share"] == pytest.approx(
        rows[1]["tau"] / rows[0]["tau"], abs=1e-3
    )
    assert rows[1]["per_step"] == {"static": 0, "candidates": 256, "rank": 16, "size": 256}
    assert "of full" in capsys.readouterr().out
    assert parse_vocab("full") is None and parse_vocab("1024") == (1024, 0, 64) and parse_vocab("8:4") == (8, 4, 64)
    with pytest.raises(SystemExit) as exit_:
        main(["--drafter", "distill/assets/testbed_dflash", "--vocab", "1:2:3:4"])
    assert exit_.value.code == 2


@pytest.mark.parametrize("name", ["dflash_qwen3_8b", "dspark_qwen3_8b", "eagle3_qwen3_8b"])
def test_gpu_drafter_recipes_fit_an_80_gb_device(name, monkeypatch):
    """The memory estimate ``--dry-run`` prints, for the Qwen3-8B drafter recipes (models built on the
    meta device from Qwen3-8B's published shapes): each fits an 80 GB device with its ``loss_chunk``,
    and the loss would not fit without it."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from distill.drafter_eval import build_drafter
    from recipes.dry_run import GiB
    from recipes.gpu_check import QWEN3_8B
    from recipes.train_drafter import memory_estimate

    monkeypatch.delenv("HF_HUB_OFFLINE")  # validate the hub id's form; nothing is fetched
    recipe = load_recipe(REPO / "recipes" / "configs" / f"{name}.yaml")
    qwen3_8b = Qwen3Config(**QWEN3_8B)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(qwen3_8b, dtype=torch.bfloat16)
        estimates = [
            memory_estimate(
                recipe,
                target,
                build_drafter(recipe.drafter.model_copy(update={"loss_chunk": c}), target, "Qwen/Qwen3-8B", 151669),
            )
            for c in (recipe.drafter.loss_chunk, None)
        ]
    chunked, whole = estimates
    assert recipe.drafter.loss_chunk and chunked["total"] < 80 < whole["total"], (chunked, whole)
    assert chunked["loss_positions_held"] == recipe.drafter.loss_chunk < whole["loss_positions_held"]
    assert chunked["loss_logits"] == round(6 * recipe.drafter.loss_chunk * 151936 * 4 / GiB, 2)
    assert chunked["target_weights"] == round(sum(p.numel() for p in target.parameters()) * 2 / GiB, 2)
