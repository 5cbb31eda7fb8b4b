"""``make gpu-check``: without a GPU it says so and exits 0; its CPU rehearsal runs every step."""

from __future__ import annotations

import json

import pytest
import torch

from recipes import gpu_check

from ..conftest import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "summary.json").exists()


def test_cpu_rehearsal_runs_the_default_steps_and_reports_them(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipes it reads are named relative to the repository root
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0 and summary["passed"], json.dumps(summary, indent=1)[:3000]
    steps = summary["steps"]
    assert set(steps) == {"static_loop", "verify_costs", "train_step", "lossless", "eval"}
    step = steps["train_step"]
    assert step["seconds_per_step"] > 0 and step["dry_run_estimate_gib"] > 0 and step["peak_gib"] is None  # CPU
    assert summary["static_loop"] == {k: steps["static_loop"][k] for k in summary["static_loop"]}
    assert set(summary["static_loop"]) == {"lossless", "tau", "tokens_per_s", "host_syncs_per_step"}
    loop = steps["static_loop"]  # the static step against the eager loop, both lossless, one host read a step
    assert loop["lossless"] is True and loop["tau"] > 1 and loop["tokens_per_s"] > 0
    assert loop["host_syncs_per_step"] <= 1 < loop["eager"]["host_syncs_per_step"]
    assert loop["comparison"]["method"] == "exact" and loop["comparison"]["equal_fraction"] == 1.0
    costs = steps["verify_costs"]
    assert set(costs["ms"]) == {"1", "4"} and all(ms > 0 for row in costs["ms"].values() for ms in row.values())
    assert costs["predicted_speedup"]["dflash"]["1"] > 0
    runs = steps["lossless"]["runs"]
    assert {k.split("/")[0] for k in runs} == {"dflash", "dspark", "eagle3"}
    assert {k.split("/")[1] for k in runs} == {"chain", "tree", "tree_lookup", "batch4", "chain_t1"}
    assert all(r["lossless"] is True for k, r in runs.items() if not k.endswith("_t1"))
    for mode in ("chain", "tree"):  # the shipped DFlash drafter's drafts are kept: more than one token a target forward
        row = steps["eval"][mode]
        assert row["lossless"] is True and row["tau"] > 1, (mode, row)
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / row["baseline_tokens_per_s"], rel=1e-3)


def test_cpu_rehearsal_of_the_training_step(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert gpu_check.main(["--device", "cpu", "--quick", "--steps", "train", "--out", str(tmp_path)]) == 0
    train = json.loads((tmp_path / "summary.json").read_text())["steps"]["train"]
    assert train["steps"] == 3 and train["tokens_per_s"] > 0 and 0 < train["mfu"] < 1
