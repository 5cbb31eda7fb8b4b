"""The training engine shared by every recipe.

A recipe hands the :class:`Trainer` a model, a :class:`~distill.data.PackedWindows` source, a
``loss_fn(model, batch) -> (loss, logs)`` and an ``evaluate_fn(model) -> metrics``; the trainer owns
everything else, on top of ``accelerate`` (so DDP, DeepSpeed and FSDP come from the launch config):

* gradient accumulation (``accelerator.accumulate``), AdamW, warmup + cosine / WSD / constant
  learning rate (``transformers`` schedules), gradient clipping;
* a step whose loss or gradient norm is not finite on *any* process is skipped (no update) and
  counted; the data it consumed stays consumed, so resumes stay aligned. Under DeepSpeed, whose
  engine steps inside ``accelerator.backward``, the skip happens there (:meth:`Trainer.train_step`);
* periodic evaluation, ``best`` chosen by a named metric, ``latest`` every ``save_every`` steps;
* exact resume: model, optimizer, scheduler, every process's RNG state, and the data position
  (samples consumed) are restored, so a killed-and-resumed run ends with the same weights as an
  uninterrupted one;
* a progress bar (loss, tokens/s, MFU, ETA), ``metrics.jsonl``, and any ``accelerate`` tracker
  (wandb) the recipe initialised; loss logs named ``count/<name>`` are summed over processes and the
  run (``perf/<name>_per_s``, ``TrainResult.count_rates``): e.g. the tokens that carry a loss.

Why the data is not ``accelerator.prepare``-d: the sample order is a pure function of the samples
consumed (see :mod:`distill.data`), which gives O(1) exact resume and identical global batches for
any (processes x accumulation) split; a prepared DataLoader would have to replay to resume.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import fault_point, find_resumable, write_atomically
from .config import OptimConfig, TrainConfig
from .data import PackedWindows
from .perf import Throughput, measured_matmul_peak
from .provenance import update_json_atomic
from .runtime import (
    deepspeed_grad_clip,
    log_acceptance,
    log_checkpoint_artifact,
    restore_functional_linear,
    run_strategy,
)


@dataclass
class TrainerState:
    """Counters that a resume restores (registered with ``accelerate`` for checkpointing)."""

    step: int = 0
    samples_consumed: int = 0
    skipped_steps: int = 0
    train_seconds: float = 0.0
    tokens_seen: int = 0
    best_metric: float | None = None
    best_step: int | None = None
    last_eval: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)  # run totals of the loss logs' "count/<name>" entries

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def build_optimizer(model, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms, biases and other 1-D parameters."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def build_scheduler(optimizer, cfg: OptimConfig, max_steps: int):
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_wsd_schedule,
    )

    warmup = min(cfg.warmup_steps, max_steps)
    if cfg.schedule == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, max_steps, min_lr_rate=cfg.min_lr_ratio)
    if cfg.schedule == "wsd":
        decay = max(1, int(cfg.decay_fraction * max_steps))
        return get_wsd_schedule(optimizer, warmup, decay, num_training_steps=max_steps, min_lr_ratio=cfg.min_lr_ratio)
    return get_constant_schedule_with_warmup(optimizer, warmup)


@dataclass
class TrainResult:
    step: int
    skipped_steps: int
    train_seconds: float
    tokens_per_s: float
    mfu: float
    peak_flops: float
    world_size: int
    best_metric: float | None
    best_step: int | None
    final_eval: dict
    count_rates: dict = field(default_factory=dict)  # per second of training, e.g. scored_tokens


def plain_state_dict(acc, model) -> dict:
    """The prepared model's (gathered) state dict under the model's own names: torch.compile
    (``train.compile``) prefixes every key with its wrapper's ``_orig_mod.``."""
    return {k.removeprefix("_orig_mod."): v for k, v in acc.get_state_dict(model).items()}


class Trainer:
    def __init__(
        self,
        *,
        accelerator,
        model,
        train_cfg: TrainConfig,
        optim_cfg: OptimConfig,
        output_dir: str | Path,
        data: PackedWindows,
        loss_fn: Callable,
        evaluate_fn: Callable,
        flops_per_token: float,
        best_metric: str = "val_loss",
        greater_is_better: bool = False,
        save_extra: Callable[[Path], None] | None = None,
        before_step: Callable[[int], None] | None = None,
    ):
        self.acc = accelerator
        self.cfg = train_cfg
        self.out = Path(output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.data = data
        self.loss_fn = loss_fn
        self.evaluate_fn = evaluate_fn
        self.best_metric_name = best_metric
        self.greater_is_better = greater_is_better
        self.save_extra = save_extra
        # called with the number of completed steps before every step (and so after a resume):
        # state that is a function of the step, such as QAT's delayed fake quantization
        self.before_step = before_step
        self.state = TrainerState()

        optimizer = build_optimizer(model, optim_cfg)
        self.deepspeed = accelerator.state.deepspeed_plugin is not None
        if self.deepspeed:  # its engine clips inside its step, at its config's value: the recipe's
            deepspeed_grad_clip(accelerator.state.deepspeed_plugin, optim_cfg.grad_clip)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        # The scheduler is built on the prepared optimizer (DeepSpeed ZeRO-3 regroups the parameters)
        # and deliberately not prepared: accelerate would step it once per process.
        self.scheduler = build_scheduler(self.optimizer, optim_cfg, train_cfg.max_steps)
        accelerator.register_for_checkpointing(self.scheduler, self.state)
        self.strategy = run_strategy(accelerator, self.model)
        if accelerator.is_main_process and (self.out / "provenance.json").exists():  # the run records what ran
            update_json_atomic(self.out / "provenance.json", strategy=self.strategy)
        self.grad_clip = optim_cfg.grad_clip

        self.world = accelerator.num_processes
        self.samples_per_step = train_cfg.micro_batch_size * train_cfg.grad_accum * self.world
        self.tokens_per_step = self.samples_per_step * data.seq_len
        peak_dtype = torch.bfloat16 if train_cfg.mixed_precision == "bf16" else torch.float32
        self.peak = measured_matmul_peak(accelerator.device.type, peak_dtype, torch.get_num_threads())
        self.throughput = Throughput(flops_per_token, self.peak, self.world)

    # ----------------------------------------------------------------------------------------------
    def _better(self, value: float) -> bool:
        best = self.state.best_metric
        return best is None or (value > best if self.greater_is_better else value < best)

    def save_model(self, folder: Path) -> None:
        """Save the (unwrapped, gathered) model as a ``transformers`` folder."""
        unwrapped = self.acc.unwrap_model(self.model, keep_torch_compile=False)
        unwrapped.save_pretrained(
            folder,
            is_main_process=self.acc.is_main_process,
            save_function=self.acc.save,
            state_dict=plain_state_dict(self.acc, self.model),
        )
        if self.save_extra and self.acc.is_main_process:
            self.save_extra(folder)

    def _save_latest(self) -> None:
        def write(tmp: Path):
            self.acc.save_state(str(tmp))
            if self.acc.is_main_process:  # written last: marks the folder complete
                (tmp / "trainer_state.json").write_text(json.dumps(self.state.state_dict(), indent=2))

        write_atomically(self.acc, self.ckpt_dir / "latest", write, self.state.step)
        # tracked run: the weights (not optimizer/RNG state) as the model artifact's "latest" version
        log_checkpoint_artifact(
            self.acc,
            self.ckpt_dir / "latest",
            ["latest", f"step-{self.state.step}"],
            {"step": self.state.step, **self.state.last_eval},
            include=lambda f: f.suffix == ".safetensors" or f.name == "trainer_state.json",
        )

    def _save_best(self, metrics: dict) -> None:
        def write(tmp: Path):
            self.save_model(tmp)
            if self.acc.is_main_process:
                (tmp / "trainer_state.json").write_text(json.dumps({"step": self.state.step, **metrics}, indent=2))

        write_atomically(self.acc, self.ckpt_dir / "best", write, self.state.step)
        log_checkpoint_artifact(
            self.acc, self.ckpt_dir / "best", ["best", f"step-{self.state.step}"], {"step": self.state.step, **metrics}
        )
        log_acceptance(self.acc, metrics)

    def maybe_resume(self) -> bool:
        if not self.cfg.resume:
            return False
        folder = find_resumable(self.ckpt_dir / "latest")
        if folder is None:
            return False
        self.acc.load_state(str(folder))
        expected = self.state.step * self.samples_per_step
        if self.state.samples_consumed != expected:
            raise RuntimeError(
                f"checkpoint {folder} consumed {self.state.samples_consumed} samples in {self.state.step} steps, "
                f"but this launch takes {self.samples_per_step} samples per step: resume with the same "
                "micro_batch_size x grad_accum x processes"
            )
        metrics = self.out / "metrics.jsonl"
        if self.acc.is_main_process and metrics.exists():  # drop what the killed run logged past the checkpoint
            kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= self.state.step]
            metrics.write_text("".join(line + "\n" for line in kept))
        self.acc.print(f"resumed from {folder} at step {self.state.step}")
        return True

    def _log(self, record: dict) -> None:
        self.acc.log(record, step=self.state.step)
        if self.acc.is_main_process:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": self.state.step, **record}) + "\n")

    def _evaluate(self) -> dict:
        self.model.eval()
        with torch.no_grad():
            metrics = self.evaluate_fn(self.model)
        self.model.train()
        self.state.last_eval = metrics
        self._log({**metrics, "train_seconds": self.state.train_seconds, "tokens_seen": self.state.tokens_seen})
        value = metrics[self.best_metric_name]
        if math.isfinite(value) and self._better(value):
            self.state.best_metric, self.state.best_step = value, self.state.step
            self._save_best(metrics)
        return metrics

    # ----------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum`` micro-batches per process.

        Skipping: the processes agree, before the backward of the step's last micro-batch, whether every
        loss of the step was finite on every process (one all-reduce). If not, the weights, the optimizer
        state (moments, step count) and DeepSpeed's fp32 master weights stay as they were, and the step is
        counted in ``skipped_steps``; the scheduler, the step counter and the data position still advance.
        The step is also skipped when the gradient norm is not finite (see :meth:`_optimizer_step`)."""
        cfg, acc = self.cfg, self.acc
        finite = all_finite = True
        loss_sum = torch.zeros((), device=acc.device)
        logs_sum: dict[str, float] = {}
        for micro in range(cfg.grad_accum):
            batch = self.data.micro_batch(
                self.state.samples_consumed, micro, acc.process_index, self.world, cfg.micro_batch_size
            ).to(acc.device)
            with acc.accumulate(self.model):
                loss, logs = self.loss_fn(self.model, batch)
                finite &= bool(torch.isfinite(loss))
                if micro == cfg.grad_accum - 1:  # the backward below ends the step (and steps a DeepSpeed engine)
                    all_finite = acc.reduce(torch.tensor(float(finite), device=acc.device), "sum").item() == self.world
                acc.backward(self._backward_loss(loss, all_finite))
            loss_sum += loss.detach()
            for k, v in logs.items():
                logs_sum[k] = logs_sum.get(k, 0.0) + float(v)
        applied, grad_norm = self._deepspeed_outcome(all_finite) if self.deepspeed else self._optimizer_step(all_finite)
        if not applied:
            self.state.skipped_steps += 1
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.state.step += 1
        self.state.samples_consumed += self.samples_per_step
        self.state.tokens_seen += self.tokens_per_step
        loss_mean = acc.reduce(loss_sum / cfg.grad_accum, "mean").item()
        out = {
            "train/loss": loss_mean,
            "train/lr": lr,
            "train/grad_norm": float("nan") if grad_norm is None else grad_norm,
            "train/skipped_steps": self.state.skipped_steps,
        }
        for k in [k for k in logs_sum if k.startswith("count/")]:  # totals (all processes), not means
            total = acc.reduce(torch.tensor(logs_sum.pop(k), device=acc.device), "sum").item()
            name = k.removeprefix("count/")
            self.state.counts[name] = self.state.counts.get(name, 0.0) + total
            out[f"count/{name}"] = total
        out.update({f"train/{k}": v / cfg.grad_accum for k, v in logs_sum.items()})
        return out

    def _backward_loss(self, loss: torch.Tensor, all_finite: bool) -> torch.Tensor:
        """The loss to back-propagate: ``loss`` itself, except under DeepSpeed on a step to skip, where it
        is ``loss * NaN`` so that every gradient this process contributes is NaN.

        DeepSpeed's engine steps inside the last ``accelerator.backward``, before the trainer could decline
        to; the one step it declines itself is one whose gradients are not finite (its overflow check: it
        discards the gradients and leaves the weights, the fp32 master weights, the optimizer state and its
        scheduler untouched). Non-finite gradients on every process are what a non-finite loss on any
        process is turned into here: a loss can be NaN with finite gradients (a NaN that no parameter
        reaches), and a loss that is finite here can belong to a step another process must skip. A loss
        made finite instead (zero) would not do: AdamW would still advance its moments and step count and
        decay the weights. Without DeepSpeed the optimizer is simply not stepped (:meth:`_optimizer_step`)."""
        return loss * float("nan") if self.deepspeed and not all_finite else loss

    def _optimizer_step(self, all_finite: bool) -> tuple[bool, float | None]:
        """Without DeepSpeed: clip (when the recipe says so) and step the optimizer if every loss was
        finite and so is the gradient norm. Returns (whether the weights were updated, the gradient
        norm before clipping, or ``None`` when it was not computed)."""
        grad_norm = None
        if all_finite and self.grad_clip:
            norm = self.acc.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            grad_norm = None if norm is None else float(norm)
        applied = all_finite and (grad_norm is None or math.isfinite(grad_norm))
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return applied, grad_norm

    def _deepspeed_outcome(self, all_finite: bool) -> tuple[bool, float | None]:
        """Under DeepSpeed, after the engine stepped (inside the last ``accelerator.backward``): whether it
        updated the weights, and the gradient norm it computed before clipping (``inf`` for a step it
        discarded; ``None`` where its config turns the norm off). The engine also discards a step whose
        loss was finite but whose gradients were not, as :meth:`_optimizer_step` does.

        Raises if the engine applied a step whose loss was not finite: its config does not check the
        gradients (:meth:`_backward_loss` relies on that check), and the weights are no longer usable."""
        wrapped = self.acc.deepspeed_engine_wrapped
        applied = wrapped.engine.was_step_applied()
        if applied and not all_finite:
            raise RuntimeError(
                f"DeepSpeed applied step {self.state.step + 1} although its loss was not finite: this DeepSpeed config does not "
                "discard steps with non-finite gradients (e.g. ZeRO stage 0 in fp32, zero_optimization.compute_grad_norm: false, "
                "bf16.check_grad_overflow: false). Use ZeRO-2/3 with DeepSpeed's default checks (accelerate_configs/*zero*.yaml)"
            )
        norm = wrapped.get_global_grad_norm()
        return applied, None if norm is None else float(norm)

    def fit(self) -> TrainResult:
        cfg, acc = self.cfg, self.acc
        self.out.mkdir(parents=True, exist_ok=True)
        self.maybe_resume()
        self.model.train()
        bar = tqdm(
            total=cfg.max_steps,
            initial=self.state.step,
            disable=not acc.is_main_process,
            desc="train",
            dynamic_ncols=True,
            mininterval=1.0,
        )
        window = Throughput(self.throughput.flops_per_token, self.peak, self.world)
        while self.state.step < cfg.max_steps:
            t0 = time.perf_counter()
            if self.before_step:
                self.before_step(self.state.step)
            self.throughput.start(), window.start()
            logs = self.train_step()
            self.throughput.stop(self.tokens_per_step), window.stop(self.tokens_per_step)
            self.state.train_seconds += time.perf_counter() - t0
            step = self.state.step
            bar.update(1)
            bar.set_postfix(
                loss=f"{logs['train/loss']:.3f}", tok_s=f"{window.tokens_per_s:.0f}", mfu=f"{window.mfu:.1%}"
            )
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                logs.update(
                    {
                        f"perf/{k.removeprefix('count/')}_per_s": v * window.tokens_per_s / self.tokens_per_step
                        for k, v in logs.items()
                        if k.startswith("count/")
                    }
                )
                logs.update(
                    {
                        "perf/tokens_per_s": window.tokens_per_s,
                        "perf/mfu": window.mfu,
                        "train/epoch": self.data.epoch_of(self.state.samples_consumed),
                    }
                )
                self._log(logs)
                window = Throughput(self.throughput.flops_per_token, self.peak, self.world)
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                metrics = self._evaluate()
                bar.write(f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            if step % cfg.save_every == 0 or step == cfg.max_steps:
                self._save_latest()
            fault_point("kill_after_step", step)
        bar.close()
        restore_functional_linear()  # ZeRO-3's replacement would break what runs after training in this process
        tokens_per_s = self.state.tokens_seen / self.state.train_seconds if self.state.train_seconds else 0.0
        rates = (
            {name: total / self.state.train_seconds for name, total in self.state.counts.items()}
            if self.state.train_seconds
            else {}
        )
        return TrainResult(
            count_rates=rates,
            step=self.state.step,
            skipped_steps=self.state.skipped_steps,
            train_seconds=self.state.train_seconds,
            tokens_per_s=tokens_per_s,
            mfu=tokens_per_s * self.throughput.flops_per_token / (self.peak * self.world),
            peak_flops=self.peak,
            world_size=self.world,
            best_metric=self.state.best_metric,
            best_step=self.state.best_step,
            final_eval=self.state.last_eval,
        )
