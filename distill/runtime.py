"""Process-level setup every recipe shares: threads, seeds, the ``Accelerator`` and its trackers."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import TrainConfig, WandbConfig


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def make_accelerator(train: TrainConfig, seed: int, project_dir: str | Path, wandb: WandbConfig | None = None):
    """An ``Accelerator`` for this launch. On a machine without CUDA it is forced onto the CPU (gloo),
    which is what makes ``torchrun --nproc_per_node N`` give N real ranks there."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    acc = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=train.mixed_precision,
        gradient_accumulation_steps=train.grad_accum,
        log_with="wandb" if wandb and wandb.enabled else None,
        project_dir=str(project_dir),
    )
    set_seed(seed)
    return acc


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
    acc.init_trackers(
        wandb.project,
        config=config,
        init_kwargs={"wandb": {"dir": str(out), "name": wandb.name or default_name, "entity": wandb.entity,
                               "tags": wandb.tags, "id": run_id, "resume": "allow"}},
    )
