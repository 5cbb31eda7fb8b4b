"""Process-level setup every recipe shares: threads, seeds, the ``Accelerator`` and its trackers."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import RecipeError, TrainConfig, WandbConfig


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def make_accelerator(train: TrainConfig, seed: int, project_dir: str | Path, wandb: WandbConfig | None = None):
    """An ``Accelerator`` for this launch. On a machine without CUDA it is forced onto the CPU (gloo),
    which is what makes ``torchrun --nproc_per_node N`` give N real ranks there."""
    from accelerate import Accelerator
    from accelerate.utils import TorchDynamoPlugin, set_seed

    # set by accelerate launch: cpu=True would silently drop DeepSpeed for plain data parallelism
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not torch.cuda.is_available():
        raise RecipeError(
            "FSDP needs GPUs here: accelerate turns FSDP on only for GPU-class devices (its AcceleratorState sets "
            "DistributedType.FSDP for MULTI_GPU / NPU / XPU ..., never MULTI_CPU), so on a CPU this launch would run "
            "unsharded copies of the job writing one output folder. (torch's own FSDP2 does run on CPU ranks over gloo, "
            "but accelerate's save_state then writes its DTensor shards as plain tensors and fails.) To shard on CPUs "
            "use accelerate_configs/cpu_zero3.yaml (DeepSpeed ZeRO-3); FSDP on GPUs: accelerate_configs/fsdp.yaml"
        )
    acc = Accelerator(
        cpu=not torch.cuda.is_available() and not deepspeed,
        mixed_precision=train.mixed_precision,
        gradient_accumulation_steps=train.grad_accum,
        log_with="wandb" if wandb and wandb.enabled else None,
        project_dir=str(project_dir),
        dynamo_plugin=TorchDynamoPlugin(backend="inductor" if train.compile else "no"),
    )
    if acc.state.deepspeed_plugin is not None:  # no dataloader is prepared (see distill.trainer): say the batch sizes
        ds = acc.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = train.micro_batch_size
        ds["train_batch_size"] = train.micro_batch_size * train.grad_accum * acc.num_processes
    set_seed(seed)
    return acc


def deepspeed_grad_clip(plugin, grad_clip: float | None) -> None:
    """Make the DeepSpeed engine clip gradients at the recipe's ``optim.grad_clip`` (``None``: no clipping,
    DeepSpeed's ``0.0``). Called with the accelerator's ``DeepSpeedPlugin`` before ``accelerator.prepare``,
    which is when DeepSpeed reads its config.

    Under DeepSpeed the engine clips inside its own step (accelerate's ``clip_grad_norm_`` only reads the
    norm afterwards), at its config's ``gradient_clipping``. Left to accelerate, that value is not the
    recipe's: ``"auto"`` (what the shipped launch configs give) becomes 1.0 at ``prepare``, and an absent
    key is DeepSpeed's 0.0, no clipping. Both become the recipe's value here. A number the launch sets
    itself (a DeepSpeed config file, ``accelerate launch --gradient_clipping``) must equal it: a different
    one raises :class:`RecipeError` rather than training with a clip the recipe does not record."""
    want = float(grad_clip or 0.0)
    config = plugin.deepspeed_config
    have = config.get("gradient_clipping")
    if have not in (None, "auto") and float(have) != want:
        raise RecipeError(
            f"the DeepSpeed config sets gradient_clipping={have} but the recipe's optim.grad_clip is {grad_clip}: "
            'the recipe decides the clip under DeepSpeed too; set gradient_clipping to "auto" (or remove it) in the '
            "DeepSpeed config, or set optim.grad_clip to the same value"
        )
    config["gradient_clipping"] = want
    plugin.gradient_clipping = want


def run_strategy(acc, model) -> dict:
    """How this run is parallelised, read from what really ran: accelerate's distributed type, the
    world size, the class ``prepare`` wrapped the model in (``DeepSpeedEngine``, ``FullyShardedDataParallel``,
    ``DistributedDataParallel``, or the model itself) and, under DeepSpeed, the ZeRO stage."""
    record = {
        "distributed_type": acc.distributed_type.value,
        "num_processes": acc.num_processes,
        "model_wrapper": type(model).__name__,
        "mixed_precision": acc.mixed_precision,
        "device": acc.device.type,
        "compiled": hasattr(model, "_orig_mod"),
    }
    if acc.state.deepspeed_plugin is not None:
        record["zero_stage"] = acc.state.deepspeed_plugin.zero_stage
    return record


def init_tracking(acc, wandb: WandbConfig, output_dir: str | Path, config: dict, default_name: str) -> None:
    """Start (or, on resume, continue) the wandb run of ``output_dir``; its id lives in the folder."""
    if not wandb.enabled:
        return
    out = Path(output_dir)
    id_file = out / "wandb_run_id"
    if acc.is_main_process and not id_file.exists():
        import secrets

        out.mkdir(parents=True, exist_ok=True)
        id_file.write_text(secrets.token_hex(4))
    acc.wait_for_everyone()
    run_id = id_file.read_text().strip()
    upstream = upstream_runs(config)
    acc.init_trackers(
        wandb.project,
        config={**config, "upstream_runs": upstream} if upstream else config,
        init_kwargs={
            "wandb": {
                "dir": str(out),
                "name": wandb.name or default_name,
                "entity": wandb.entity,
                "tags": wandb.tags,
                "id": run_id,
                "resume": "allow",
            }
        },
    )
    if acc.is_main_process:
        run = acc.get_tracker("wandb", unwrap=True)
        record = {
            "id": run.id,
            "project": run.project,
            "entity": run.entity,
            "name": run.name,
            "url": getattr(run, "url", None),
            "model_artifact": model_artifact_name(run.name),
        }
        from .provenance import write_json_atomic

        write_json_atomic(out / RUN_RECORD, record)
        for role, link in upstream.items():  # also in the run's summary, where the UI lists it
            run.summary[f"upstream/{role}"] = link.get("url") or link["id"]


# --------------------------------------------------------------------------------------------------
# Tracked runs: checkpoints as artifacts, links between target, drafter and evaluation runs
# --------------------------------------------------------------------------------------------------

RUN_RECORD = "wandb_run.json"  # written into a run folder: how downstream runs find and cite it


def restore_functional_linear() -> None:
    """Undo DeepSpeed ZeRO-3's process-wide replacement of ``torch.nn.functional.linear`` (its
    memory-efficient linear, installed when a ZeRO-3 engine partitions a model and documented to "persist
    unless manually reset"). What runs after training in the same process (torchao's converted models,
    whose weights are tensor subclasses the replacement cannot transpose; the next recipe stage) then gets
    torch's own. A no-op where DeepSpeed never replaced it."""
    import sys

    import torch

    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(zero, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def end_run(acc) -> None:
    """The end of a run on every rank: the ranks wait for each other, then the trackers finish and the
    process group goes (``end_training``; under DeepSpeed through ``deepspeed.comm``, so that a later
    DeepSpeed run in the same process does not find groups it cached of a destroyed world). A rank that tore its group down while another still wrote
    its files could take the run down with it (two CPU ranks on gloo: one aborted, SIGABRT, at exit)."""
    acc.wait_for_everyone()
    if acc.state.deepspeed_plugin is not None:  # through DeepSpeed, which then forgets the groups it cached too
        import deepspeed.comm

        if deepspeed.comm.is_initialized():
            deepspeed.comm.destroy_process_group()
    acc.end_training()


def model_artifact_name(run_name: str) -> str:
    import re

    return "model-" + re.sub(r"[^\w.-]", "-", run_name)


def find_run_record(path: str | Path | None) -> dict | None:
    """The wandb run that produced ``path`` (a model folder, a checkpoint or a run folder), found in
    it or up to three folders above it (``run/checkpoints/best`` -> ``run``)."""
    if not path:
        return None
    from .models import resolve_target_path

    folder = Path(resolve_target_path(str(path)))
    for parent in [folder, *list(folder.parents)[:3]]:
        record = parent / RUN_RECORD
        if record.is_file():
            import json

            return json.loads(record.read_text())
    return None


def upstream_runs(config: dict) -> dict:
    """The runs whose outputs this run reads (its target, its drafter), by the folders its recipe names."""
    links = {}
    target = config.get("target")
    for role, path in (
        ("target", target.get("path") if isinstance(target, dict) else None),
        ("drafter", config.get("drafter") if isinstance(config.get("drafter"), str) else None),
    ):
        record = find_run_record(path)
        if record:
            links[role] = record
    return links


def log_checkpoint_artifact(
    acc, folder: str | Path, aliases: list[str], metadata: dict | None = None, include=None
) -> None:
    """Log ``folder`` as a version of the run's model artifact with ``aliases`` (``best``, ``latest``);
    ``include(path) -> bool`` picks the files (e.g. weights without optimizer state). No-op without wandb."""
    if not acc.is_main_process or not any(getattr(t, "name", "") == "wandb" for t in getattr(acc, "trackers", [])):
        return
    import wandb

    run = acc.get_tracker("wandb", unwrap=True)
    artifact = wandb.Artifact(model_artifact_name(run.name), type="model", metadata=metadata or {})
    for f in sorted(Path(folder).rglob("*")):
        if f.is_file() and (include is None or include(f)):
            artifact.add_file(str(f), name=f.relative_to(folder).as_posix())
    run.log_artifact(artifact, aliases=aliases)


def log_acceptance(acc, metrics: dict, prefix: str = "val", key: str = "best") -> None:
    """Per-position acceptance (``{prefix}_acc_k``) as a wandb table and bar plot. No-op without wandb."""
    if not acc.is_main_process or not any(getattr(t, "name", "") == "wandb" for t in getattr(acc, "trackers", [])):
        return
    import wandb

    rows = [[k, float(metrics[f"{prefix}_acc_{k}"])] for k in range(1, 1000) if f"{prefix}_acc_{k}" in metrics]
    if not rows:
        return
    run = acc.get_tracker("wandb", unwrap=True)
    table = wandb.Table(columns=["position", "acceptance"], data=rows)
    run.log(
        {
            f"{key}/acceptance_by_position": table,
            f"{key}/acceptance_plot": wandb.plot.bar(
                table, "position", "acceptance", title="P(accept k | 1..k-1 accepted)"
            ),
        }
    )
