"""The training engine: it learns, skips non-finite steps, logs, and resumes exactly after a real kill."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from distill.config import OptimConfig, TrainConfig
from distill.trainer import Trainer, build_scheduler
from recipes import train_lm
from recipes.registry import parse_recipe

from ..conftest import run_cli, tiny_lm_recipe, write_recipe


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_lm_learns_and_writes_a_complete_run(tmp_path):
    out = tmp_path / "run"
    summary = train_lm.main(parse_recipe(tiny_lm_recipe(out, train={"max_steps": 30, "eval_every": 10})))
    metrics = read_metrics(out)
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    evals = [m["val_loss"] for m in metrics if "val_loss" in m]
    assert losses[-1] < losses[0] - 0.5, losses
    assert evals[-1] < evals[0] and summary["val_loss"] < math.log(512) - 0.5
    assert all(m["perf/tokens_per_s"] > 0 and 0 < m["perf/mfu"] < 1 for m in metrics if "perf/mfu" in m)
    assert summary["tokens_per_s"] > 0 and 0 < summary["mfu"] < 1 and summary["skipped_steps"] == 0
    assert summary["train_tokens_seen"] == 30 * 4 * 64
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["seed"] == 0 and prov["data"]["text_fingerprint"] and "torch" in prov["packages"]
    assert "git" in prov and (out / "recipe.yaml").exists()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    for folder in (out / "model", out / "checkpoints" / "best"):
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert len(AutoTokenizer.from_pretrained(folder)) == model.config.vocab_size == 512
    assert json.loads((out / "checkpoints" / "latest" / "trainer_state.json").read_text())["step"] == 30


def test_non_finite_step_is_skipped_and_counted(tmp_path):
    import numpy as np
    from accelerate import Accelerator

    from distill.data import PackedWindows
    from distill.lm import lm_loss
    from distill.models import build_causal_lm, tiny_target

    torch.manual_seed(0)
    model = build_causal_lm(tiny_target(), 300)
    data = PackedWindows(np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16), 32)
    calls = {"n": 0}
    snapshots = []

    def poisoned_loss(m, batch):
        calls["n"] += 1
        loss, logs = lm_loss(m, batch)
        if calls["n"] == 3:  # the third step's loss is NaN
            snapshots.append([p.detach().clone() for p in m.parameters()])
            return loss * float("nan"), logs
        return loss, logs

    cfg = TrainConfig(max_steps=5, micro_batch_size=2, eval_every=100, save_every=100, log_every=1)
    trainer = Trainer(
        accelerator=Accelerator(cpu=True),
        model=model,
        train_cfg=cfg,
        optim_cfg=OptimConfig(warmup_steps=0),
        output_dir=tmp_path,
        data=data,
        loss_fn=poisoned_loss,
        flops_per_token=1.0,
        evaluate_fn=lambda m: {"val_loss": 1.0},
    )
    for _ in range(3):
        trainer.train_step()
    after = list(trainer.model.parameters())
    assert trainer.state.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(after, snapshots[0])), "a skipped step changed the weights"
    assert all(torch.isfinite(p).all() for p in after)
    trainer.train_step()
    assert not all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), snapshots[0]))
    assert trainer.state.step == 4 and trainer.state.samples_consumed == 8


def test_schedules():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(
        opt, OptimConfig(lr=1.0, schedule="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1), 100
    )
    lrs = []
    for _ in range(100):
        lrs.append(sched.get_last_lr()[0])
        opt.step(), sched.step()
    assert lrs[0] < lrs[5] < lrs[10] == pytest.approx(1.0)
    assert lrs[10] == lrs[50] == lrs[79] == pytest.approx(1.0)  # stable phase
    assert lrs[99] == pytest.approx(0.1, abs=0.02)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, OptimConfig(lr=1.0, schedule="cosine", warmup_steps=5, min_lr_ratio=0.1), 50)
    for _ in range(50):
        opt.step(), sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.1, abs=1e-6)


def wandb_records(path, timeout: float = 60.0):
    """Records of an offline ``run-*.wandb`` file (LevelDB log framing: 7-byte header, 32 KiB blocks),
    read once wandb's service has written the run's exit record (it writes asynchronously, so on a busy
    machine the file can still be growing when ``finish`` returns)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        records = _read_wandb_records(path)
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def _read_wandb_records(path):
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf, records = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # the service is still writing this fragment
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = pb.Record()
            try:
                record.ParseFromString(buf)
            except DecodeError:  # a fragment caught mid-write: read again later
                break
            records.append(record)
            buf = b""
    return records


def test_wandb_offline_run_files(tmp_path):
    out = tmp_path / "run"
    recipe = tiny_lm_recipe(
        out,
        train={"max_steps": 4, "eval_every": 2, "save_every": 4, "log_every": 2},
        wandb={"enabled": True, "project": "draftsmith-tests", "name": "tiny"},
    )
    train_lm.main(parse_recipe(recipe))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    assert (out / "wandb_run_id").read_text().strip() in runs[0].name
    records = wandb_records(next(runs[0].glob("run-*.wandb")))
    config = {
        item.key: json.loads(item.value_json) for r in records if r.HasField("config") for item in r.config.update
    }
    assert config["recipe"] == "train_lm" and config["train"]["max_steps"] == 4
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    logged = set().union(*history)
    assert {"train/loss", "perf/tokens_per_s", "perf/mfu", "val_loss", "val_ppl"} <= logged, logged


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill_after_step:7", "kill_during_save:8"])
def test_killed_run_resumes_to_identical_weights(tmp_path, fault):
    """A real SIGKILL mid-run (or mid-checkpoint), then the same command again, gives the same
    final weights as a run that was never interrupted."""
    base = dict(train={"max_steps": 10, "save_every": 4, "eval_every": 5})
    reference = tmp_path / "reference"
    train_lm.main(parse_recipe(tiny_lm_recipe(reference, **base)))

    out = tmp_path / "killed"
    path = write_recipe(tmp_path / "r.yaml", tiny_lm_recipe(out, **base))
    killed = run_cli("run", str(path), env={"DRAFTSMITH_FAULT": fault})
    assert killed.returncode == -9, killed.stderr[-2000:]
    state = json.loads((out / "checkpoints" / "latest" / "trainer_state.json").read_text())
    assert state["step"] == 4  # the checkpoint before the kill is intact
    if fault.startswith("kill_during_save"):
        assert (out / "checkpoints" / "latest.tmp").exists()  # the half-written one was never published
    resumed = run_cli("run", str(path))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    a, b = weights(reference / "model"), weights(out / "model")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    steps = [m["step"] for m in read_metrics(out) if "train/loss" in m]
    assert steps == sorted(set(steps)), "metrics.jsonl repeats steps after resume"


def test_the_matmul_peak_is_probed_at_a_size_the_dtype_can_afford():
    """A dtype without fast kernels (bf16 on a CPU) would spend minutes on a fixed 2048^3 probe before a
    run's first step: the size doubles only while a product stays fast, up to the largest."""
    from distill.perf import probe_size

    def rate(flops_per_s):
        return lambda n: 2 * n**3 / flops_per_s

    assert probe_size(rate(1e11), 2048)[0] == 2048  # fp32 on a CPU: the full size
    assert probe_size(rate(1.3e9), 2048) == (512, 2 * 512**3 / 1.3e9)  # bf16 on a CPU: 0.2 s a product at 512
    assert probe_size(rate(7e14), 8192)[0] == 8192  # a GPU
