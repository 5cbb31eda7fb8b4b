"""Data parallelism: 2 CPU ranks (gloo) train like 1 rank with twice the accumulation, and the
cluster launch configs are accepted by accelerate's own launcher and plugins."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from ..conftest import REPO, launch_env, run_cli, tiny_lm_recipe, write_recipe

# one pytest-xdist worker runs them all, one after another
pytestmark = pytest.mark.xdist_group("distributed")

CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))


def launcher(config: Path) -> list[str]:
    """``accelerate launch`` with ``config`` on a port free now: a killed launch's rendezvous socket
    can outlive it for a moment, and the default port 29500 is then still taken."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(port),
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_accelerate_accepts_launch_config(config):
    args, env = launch_env(config)
    with mock.patch.dict(os.environ, env):
        if args.use_deepspeed:
            from accelerate.utils import DeepSpeedPlugin

            plugin = DeepSpeedPlugin()
            assert plugin.zero_stage in (2, 3)
            assert plugin.deepspeed_config["zero_optimization"]["stage"] == plugin.zero_stage
        elif args.use_fsdp:
            from accelerate.utils import FullyShardedDataParallelPlugin

            gpu_only = {"FSDP_SYNC_MODULE_STATES": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}
            assert all(env[k].lower() == "true" for k in gpu_only)
            with mock.patch.dict(os.environ, gpu_only):  # both broadcast from a GPU at construction
                plugin = FullyShardedDataParallelPlugin()
            assert "FULL_SHARD" in str(plugin.sharding_strategy) and plugin.auto_wrap_policy is not None
        elif config.name == "cpu.yaml":
            assert args.use_cpu and args.num_processes == 1 and env.get("ACCELERATE_USE_CPU") == "True", env
        else:
            assert args.multi_gpu and args.mixed_precision == "bf16"


def final_weights(out: Path) -> dict:
    return load_file(str(out / "model" / "model.safetensors"))


@pytest.mark.slow
def test_two_cpu_ranks_equal_one_rank_with_double_accumulation(tmp_path):
    train = {"max_steps": 6, "micro_batch_size": 4, "eval_every": 6, "save_every": 6}
    one = tmp_path / "one"
    two = tmp_path / "two"
    p1 = write_recipe(tmp_path / "one.yaml", tiny_lm_recipe(one, train={**train, "grad_accum": 2}))
    p2 = write_recipe(tmp_path / "two.yaml", tiny_lm_recipe(two, train={**train, "grad_accum": 1}))

    r1 = run_cli("run", str(p1))
    assert r1.returncode == 0, r1.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517"]
    r2 = run_cli("run", str(p2), launcher=torchrun, env={"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"})
    assert r2.returncode == 0, r2.stderr[-3000:]

    s1, s2 = (json.loads((o / "summary.json").read_text()) for o in (one, two))
    assert s1["world_size"] == 1 and s2["world_size"] == 2, "torchrun did not give 2 real ranks"
    assert s1["train_tokens_seen"] == s2["train_tokens_seen"]
    w1, w2 = final_weights(one), final_weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=2e-5, msg=lambda m: f"{k}: {m}")  # noqa: B023  (called within the iteration)
    assert s1["val_loss"] == pytest.approx(s2["val_loss"], rel=1e-4)


@pytest.mark.slow
def test_recipe_runs_under_accelerate_launch(tmp_path):
    out = tmp_path / "run"
    path = write_recipe(
        tmp_path / "r.yaml", tiny_lm_recipe(out, train={"max_steps": 2, "eval_every": 2, "save_every": 2})
    )
    r = run_cli("run", str(path), launcher=launcher(REPO / "accelerate_configs" / "cpu.yaml"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_really_runs_resumes_and_trains_like_one_process(tmp_path, stage):
    """``accelerate launch`` with a DeepSpeed ZeRO config, one CPU process: the run records that a
    DeepSpeed engine at that stage ran, survives a SIGKILL after step 6 (resuming from its step-4
    DeepSpeed checkpoint) and saves a whole model. ZeRO-2 ends with the weights of the same recipe run
    in-process without DeepSpeed (same arithmetic, up to the order of floating-point reductions).
    Under ZeRO-3 transformers builds the model inside ``deepspeed.zero.Init`` (parameters partitioned
    as they are created), which draws another random initialisation; its reference is therefore the
    same ZeRO-3 launch run without the kill."""
    from recipes import train_lm
    from recipes.registry import parse_recipe

    base = dict(train={"max_steps": 8, "save_every": 4, "eval_every": 8})
    config = REPO / f"accelerate_configs/cpu_zero{stage}.yaml"
    reference = tmp_path / "reference"
    if stage == 2:
        train_lm.main(parse_recipe(tiny_lm_recipe(reference, **base)))
    else:
        done = run_cli(
            "run",
            str(write_recipe(tmp_path / "ref.yaml", tiny_lm_recipe(reference, **base))),
            launcher=launcher(config),
        )
        assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / f"zero{stage}"
    path = write_recipe(tmp_path / "r.yaml", tiny_lm_recipe(out, **base))
    killed = run_cli("run", str(path), env={"DRAFTSMITH_FAULT": "kill_after_step:6"}, launcher=launcher(config))
    assert killed.returncode != 0 and not (out / "model").exists(), killed.stderr[-2000:]
    resumed = run_cli("run", str(path), launcher=launcher(config))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    strategy = json.loads((out / "provenance.json").read_text())["strategy"]
    assert strategy == {
        "distributed_type": "DEEPSPEED",
        "num_processes": 1,
        "model_wrapper": "DeepSpeedEngine",
        "mixed_precision": "no",
        "device": "cpu",
        "compiled": False,
        "zero_stage": stage,
    }
    if stage == 2:
        single = json.loads((reference / "provenance.json").read_text())["strategy"]
        assert single["distributed_type"] != "DEEPSPEED" and single["model_wrapper"] != "DeepSpeedEngine"
    a, b = load_file(str(reference / "model/model.safetensors")), load_file(str(out / "model/model.safetensors"))
    if "lm_head.weight" in b.keys() - a.keys():  # DeepSpeed's gathered state dict holds the tied head apart
        assert torch.equal(b.pop("lm_head.weight"), b["model.embed_tokens.weight"])
    assert a.keys() == b.keys()

    def losses(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [round(json.loads(line)["train/loss"], 4) for line in lines if "train/loss" in line]

    assert losses(out) == losses(reference) and losses(out)[-1] < losses(out)[0]
    for k in a:
        assert b[k].dtype == torch.float32 and torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), (
            f"{k}: max difference {(a[k] - b[k]).abs().max():.2e}"
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, FSDP is accelerate's to run")
def test_fsdp_on_cpu_is_a_clear_error_not_unsharded_copies(monkeypatch, tmp_path):
    """accelerate enables FSDP only for GPU-class devices: launched on CPUs, every rank would train
    its own unsharded copy into one folder (tried: the ranks' checkpoints collided). The run refuses,
    naming the CPU alternative, before any compute."""
    from distill.config import RecipeError, TrainConfig
    from distill.runtime import make_accelerator

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RecipeError, match="FSDP needs GPUs here.*cpu_zero3.yaml"):
        make_accelerator(TrainConfig(), 0, tmp_path)


@pytest.mark.parametrize("kind", ["dflash", "dspark", "eagle3"])
def test_fsdp_wraps_every_drafter_layer(kind):
    """FSDP's transformer-based wrap policy wraps the classes ``_no_split_modules`` names: each drafter's
    own decoder layers (EAGLE-3's are ``Eagle3Layer``, not the block drafters' ``InjectedLayer``)."""
    from drafters import DRAFTERS

    config_cls, model_cls = DRAFTERS[kind]
    with torch.device("meta"):
        model = model_cls(
            config_cls(
                vocab_size=64,
                hidden_size=32,
                num_attention_heads=2,
                intermediate_size=64,
                target_layer_ids=[0, 1, 2],
                mask_token_id=0,
                block_size=4,
            )
        )
    wrapped = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
    assert wrapped and all(any(p.requires_grad for p in m.parameters()) for m in wrapped)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_drafter_trains_under_deepspeed_zero_resumes_and_matches_one_process(tmp_path, tiny_target_dir, stage):
    """A DFlash drafter (the frozen target beside it, online features) under ``accelerate launch`` with
    a ZeRO config, one CPU process: a DeepSpeed engine at that stage really ran, and the run ends with
    the weights of the same recipe run in-process without DeepSpeed (the drafter is built directly, not
    by ``from_pretrained``, so ZeRO-3 draws the same initialisation). ZeRO-2 also survives a SIGKILL after
    step 4, resuming from its step-3 checkpoint (ZeRO-3's kill and resume: the LM test above)."""
    import yaml

    from recipes import train_drafter
    from recipes.registry import parse_recipe

    from ..conftest import drafter_recipe

    train = {"max_steps": 6, "save_every": 3, "eval_every": 6, "eval_batches": 2}
    recipe = drafter_recipe(tmp_path / "reference", tiny_target_dir, "dflash", **train).model_dump(mode="json")
    train_drafter.main(parse_recipe(recipe))
    out = tmp_path / f"zero{stage}"
    path = write_recipe(tmp_path / "r.yaml", {**recipe, "output_dir": str(out)})
    config = REPO / f"accelerate_configs/cpu_zero{stage}.yaml"
    if stage == 2:
        killed = run_cli("run", str(path), env={"DRAFTSMITH_FAULT": "kill_after_step:4"}, launcher=launcher(config))
        assert killed.returncode != 0 and not (out / "model").exists(), killed.stderr[-2000:]
    done = run_cli("run", str(path), launcher=launcher(config))
    assert done.returncode == 0, done.stderr[-3000:]
    assert stage != 2 or "resumed from" in done.stdout + done.stderr
    strategy = json.loads((out / "provenance.json").read_text())["strategy"]
    assert strategy["model_wrapper"] == "DeepSpeedEngine" and strategy["zero_stage"] == stage
    a, b = final_weights(tmp_path / "reference"), final_weights(out)
    assert a.keys() == b.keys() and yaml.safe_load((out / "recipe.yaml").read_text())["drafter"]["kind"] == "dflash"
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), f"{k}: max difference {(a[k] - b[k]).abs().max():.2e}"
    assert_same_evaluation(tmp_path / "reference", out)  # the engine-wrapped drafter is evaluated as a DFlash drafter


def assert_same_evaluation(a: Path, b: Path) -> None:
    """The two runs' held-out metrics (what picks ``checkpoints/best``) agree, up to float reduction order."""
    ma, mb = (json.loads((run / "summary.json").read_text()) for run in (a, b))
    keys = sorted(k for k in ma if k.startswith("val_"))
    assert "val_simulated_tau" in keys and keys == sorted(k for k in mb if k.startswith("val_"))
    for k in keys:
        assert mb[k] == pytest.approx(ma[k], rel=1e-4, abs=1e-6), k


@pytest.mark.slow
def test_a_drafter_on_two_cpu_ranks_trains_and_evaluates_like_one_rank(tmp_path, tiny_target_dir):
    """DDP on 2 gloo ranks against 1 rank with twice the accumulation: the same weights and the same
    held-out metrics, with an odd number of evaluation batches (one rank pads its share)."""
    from ..conftest import drafter_recipe

    train = {"max_steps": 4, "save_every": 4, "eval_every": 4, "eval_batches": 3, "micro_batch_size": 2}
    one, two = tmp_path / "one", tmp_path / "two"
    for out, accum in ((one, 2), (two, 1)):
        recipe = drafter_recipe(out, tiny_target_dir, "dflash", **train, grad_accum=accum).model_dump(mode="json")
        write_recipe(tmp_path / f"{out.name}.yaml", recipe)
    r1 = run_cli("run", str(tmp_path / "one.yaml"))
    assert r1.returncode == 0, r1.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29519"]
    r2 = run_cli(
        "run", str(tmp_path / "two.yaml"), launcher=torchrun, env={"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    )
    assert r2.returncode == 0, r2.stderr[-3000:]
    s1, s2 = (json.loads((o / "summary.json").read_text()) for o in (one, two))
    assert s1["world_size"] == 1 and s2["world_size"] == 2, "torchrun did not give 2 real ranks"
    w1, w2 = final_weights(one), final_weights(two)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=2e-5, msg=lambda m: f"{k}: {m}")  # noqa: B023
    assert_same_evaluation(one, two)
