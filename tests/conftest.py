"""Shared fixtures: offline switches, a per-session cache, and a tiny train_lm recipe that runs in seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_SILENT": "true", "DS_BUILD_OPS": "0"}
os.environ.update(OFFLINE)

from distill.runtime import quiet_third_party  # noqa: E402  (what the command line does first)

quiet_third_party()


@pytest.fixture(scope="session", autouse=True)
def _session_env(tmp_path_factory):
    import torch

    cache = tmp_path_factory.mktemp("draftsmith-cache")
    os.environ["DRAFTSMITH_CACHE"] = str(cache)
    torch.set_num_threads(1)  # deterministic and polite to whatever else runs on the machine
    yield cache


def tiny_lm_recipe(output_dir: Path, **sections) -> dict:
    """A train_lm recipe on 40 stdlib files, a 512-token BPE and a 2-layer model: seconds on 1 core."""
    recipe = {
        "recipe": "train_lm",
        "output_dir": str(output_dir),
        "seed": 0,
        "model": {"arch": "llama", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128,
                  "max_position_embeddings": 128},
        "tokenizer": {"vocab_size": 512},
        "data": {"source": "stdlib", "seq_len": 64, "max_documents": 40, "val_fraction": 0.1},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine"},
        "train": {"max_steps": 12, "micro_batch_size": 4, "grad_accum": 1, "eval_every": 6, "eval_batches": 4,
                  "save_every": 4, "log_every": 2, "torch_threads": 1},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            recipe.setdefault(section, {}).update(values)
        else:
            recipe[section] = values
    return recipe


def tiny_dflash(block_attention: str = "causal", num_key_value_heads: int = 4):
    """A one-layer DFlash drafter of 32 channels over a 32-channel target, random, fused for decoding."""
    from drafters import DFlashConfig, DFlashDrafter

    cfg = DFlashConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=num_key_value_heads,
                       intermediate_size=64, target_layer_ids=[0], target_hidden_size=32, mask_token_id=1, block_size=4,
                       block_attention=block_attention, num_hidden_layers=1, qk_norm=True, max_position_embeddings=64)
    return DFlashDrafter(cfg).eval().fuse_projections()


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_cli(*args: str, env: dict | None = None, timeout: int = 300, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``draftsmith`` in a fresh process (optionally under a launcher such as torchrun)."""
    full_env = {**os.environ, **OFFLINE, **(env or {})}
    cmd = (launcher or [sys.executable]) + ["-m", "recipes.cli", *args]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def reset_accelerate() -> None:
    """accelerate keeps process-wide singletons; each in-process run builds its own Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    reset_accelerate()
    yield
    from distill.runtime import restore_functional_linear

    restore_functional_linear()  # an in-process ZeRO-3 engine replaces torch's F.linear for the whole process


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, _session_env):
    """A 4-layer target trained for a few seconds, so its predictions carry signal (shared by modules)."""
    from recipes import train_lm
    from recipes.registry import parse_recipe

    out = tmp_path_factory.mktemp("tiny-target")
    recipe = tiny_lm_recipe(out, model={"num_layers": 4}, train={"max_steps": 250, "eval_every": 250, "save_every": 250})
    reset_accelerate()
    train_lm.main(parse_recipe(recipe))
    reset_accelerate()
    return out / "model"
