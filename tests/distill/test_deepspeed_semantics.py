"""The trainer's contracts under DeepSpeed, whose engine steps inside ``accelerator.backward``: a step whose
loss is not finite changes nothing (weights, fp32 master weights, optimizer state) and is counted, and the
recipe's ``optim.grad_clip`` is the clip the engine applies. The engine runs in-process: ZeRO-2 / ZeRO-3 on
a one-rank gloo world, with the environment ``accelerate launch`` sets for ``accelerate_configs/cpu_zero*.yaml``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distill.config import OptimConfig, RecipeError, TrainConfig
from distill.trainer import Trainer

from ..conftest import reset_accelerate

# one pytest-xdist worker runs them all, one after another (with the other DeepSpeed tests). The engine
# tests take seconds, but are ``slow``: DeepSpeed's first process group on a machine compiles its shared-memory
# communication op (minutes; cached under TORCH_EXTENSIONS_DIR afterwards).
pytestmark = pytest.mark.xdist_group("distributed")

TRAIN = TrainConfig(max_steps=8, micro_batch_size=2, eval_every=100, save_every=100, log_every=1)


def make_trainer(tmp_path, optim: OptimConfig, loss_fn=None, deepspeed: bool = True) -> Trainer:
    """A Trainer of a tiny LM on random tokens: built by ``make_accelerator`` as a recipe does (DeepSpeed
    when the environment says so), or on a plain CPU ``Accelerator``."""
    from accelerate import Accelerator

    from distill.data import PackedWindows
    from distill.lm import lm_loss
    from distill.models import build_causal_lm, tiny_target
    from distill.runtime import make_accelerator

    acc = make_accelerator(TRAIN, 0, tmp_path) if deepspeed else Accelerator(cpu=True)
    torch.manual_seed(0)
    model = build_causal_lm(tiny_target(), 300)
    data = PackedWindows(np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16), 32)
    return Trainer(
        accelerator=acc,
        model=model,
        train_cfg=TRAIN,
        optim_cfg=optim,
        output_dir=tmp_path,
        data=data,
        loss_fn=loss_fn or lm_loss,
        flops_per_token=1.0,
        evaluate_fn=lambda m: {"val_loss": 1.0},
    )


def zero_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Copies of everything a step may change under ZeRO: this rank's weights (ZeRO-3: its partitions),
    the fp32 master weights and the inner optimizer's state (moments, step counts)."""
    zero = trainer.model.optimizer
    weights = [getattr(p, "ds_tensor", p) for p in trainer.model.module.parameters()]
    masters = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat
    moments = [(name, t) for state in zero.optimizer.state.values() for name, t in state.items()]
    copies = {f"weight{i}": t for i, t in enumerate(weights)} | {f"master{i}": t for i, t in enumerate(masters)}
    copies |= {f"{name}{i}": torch.as_tensor(t) for i, (name, t) in enumerate(moments)}
    return {k: t.detach().clone() for k, t in copies.items()}


def changed(before: dict, after: dict) -> list[str]:
    """The entries that differ, appeared or went (the optimizer's state appears at its first step)."""
    return sorted(
        k
        for k in before.keys() | after.keys()
        if k not in before or k not in after or not torch.equal(before[k], after[k])
    )


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_step_with_a_non_finite_loss_changes_nothing_under_deepspeed(tmp_path, deepspeed_env, stage):
    """Step 2's loss is NaN with finite gradients (a NaN no parameter reaches), step 3's is NaN with NaN
    gradients: neither changes a bit of the weights, the fp32 master weights or the optimizer state,
    both are counted (by the trainer and by DeepSpeed's engine) and report an infinite gradient norm,
    and the finite steps around them update, each reporting the gradient norm the engine computed."""
    from distill.lm import lm_loss

    poison = {2: lambda loss: loss + float("nan"), 3: lambda loss: loss * float("nan")}
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss, logs = lm_loss(model, batch)
        return poison.get(calls["n"], lambda x: x)(loss), logs

    deepspeed_env(stage)
    trainer = make_trainer(tmp_path, OptimConfig(warmup_steps=0), loss_fn)
    assert trainer.strategy["model_wrapper"] == "DeepSpeedEngine" and trainer.strategy["zero_stage"] == stage
    for step in (1, 2, 3, 4):
        before = zero_state(trainer)
        logs = trainer.train_step()
        diff = changed(before, zero_state(trainer))
        if step in poison:
            assert diff == [], f"step {step} (loss {logs['train/loss']}) changed {diff}"
            assert logs["train/grad_norm"] == math.inf  # the engine's norm of a step it discarded
        else:
            assert {k.rstrip("0123456789") for k in diff} >= {"weight", "master", "exp_avg", "exp_avg_sq", "step"}, diff
            assert math.isfinite(logs["train/grad_norm"]) and logs["train/grad_norm"] > 0, logs
        assert (
            trainer.state.skipped_steps == trainer.model.skipped_steps == sum(s in poison for s in range(1, step + 1))
        )
    assert trainer.state.step == 4


@pytest.mark.slow
def test_deepspeed_clips_at_the_recipes_grad_clip(tmp_path, deepspeed_env):
    """One step with ``grad_clip`` 1e-3 (the gradient norm is ~2) under ZeRO-2 moves the weights as the
    same step without DeepSpeed does. AdamW with ``eps`` 1 and ``lr`` 1 makes the first update nearly the
    (clipped) gradient itself, so the update's norm is the clip: 1e-3 (an unclipped or 1.0-clipped
    step would move the weights ~1000x further). The reported ``train/grad_norm`` is the norm before
    clipping, as without DeepSpeed."""
    optim = OptimConfig(lr=1.0, eps=1.0, weight_decay=0.0, warmup_steps=0, schedule="constant", grad_clip=1e-3)

    def one_step(trainer: Trainer, module) -> tuple[dict, list[torch.Tensor]]:
        before = [p.detach().clone() for p in module.parameters()]
        logs = trainer.train_step()
        return logs, [p.detach() - b for p, b in zip(module.parameters(), before)]

    reference = make_trainer(tmp_path / "plain", optim, deepspeed=False)
    ref_logs, ref_delta = one_step(reference, reference.model)
    reset_accelerate()
    deepspeed_env(2)
    trainer = make_trainer(tmp_path / "zero2", optim)
    assert trainer.model.gradient_clipping() == 1e-3
    logs, delta = one_step(trainer, trainer.model.module)

    assert ref_logs["train/grad_norm"] > 100 * optim.grad_clip
    assert logs["train/grad_norm"] == pytest.approx(ref_logs["train/grad_norm"], rel=1e-4)
    update = torch.cat([d.flatten() for d in delta]).norm().item()
    assert update == pytest.approx(optim.grad_clip, rel=0.01), "DeepSpeed did not clip at optim.grad_clip"
    for d, r in zip(delta, ref_delta):
        torch.testing.assert_close(d, r, rtol=1e-3, atol=1e-8)


def test_the_recipes_grad_clip_is_written_into_the_deepspeed_config():
    """``"auto"`` or absent: the recipe's value (``None``: 0.0, DeepSpeed's "off"); the same number: kept;
    another number: refused, naming both."""
    from accelerate.utils import DeepSpeedPlugin

    from distill.runtime import deepspeed_grad_clip

    def plugin(**config):
        return DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, **config})

    for config, grad_clip, expected in [
        ({"gradient_clipping": "auto"}, 0.5, 0.5),
        ({}, 0.5, 0.5),
        ({}, None, 0.0),
        ({"gradient_clipping": 1}, 1.0, 1.0),
        ({"gradient_clipping": 0.0}, None, 0.0),
    ]:
        p = plugin(**config)
        deepspeed_grad_clip(p, grad_clip)
        assert p.deepspeed_config["gradient_clipping"] == p.gradient_clipping == expected, (config, grad_clip)
    with pytest.raises(RecipeError, match=r"gradient_clipping=0.5 but the recipe's optim.grad_clip is 1.0"):
        deepspeed_grad_clip(plugin(gradient_clipping=0.5), 1.0)
