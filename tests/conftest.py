"""Shared fixtures and helpers: offline switches, a per-session cache, tiny recipes that run in seconds (a
train_lm, a drafter, a student), a tiny trained target and three drafters trained on it (built once per
process: once per pytest-xdist worker that asks for them), and accelerate's launch environments."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_SILENT": "true",
    "DS_BUILD_OPS": "0",
}
os.environ.update(OFFLINE)

from distill.quiet import quiet_third_party  # noqa: E402  (what the command line does first)

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
        "model": {
            "arch": "llama",
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "intermediate_size": 128,
            "max_position_embeddings": 128,
        },
        "tokenizer": {"vocab_size": 512},
        "data": {"source": "stdlib", "seq_len": 64, "max_documents": 40, "val_fraction": 0.1},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine"},
        "train": {
            "max_steps": 12,
            "micro_batch_size": 4,
            "grad_accum": 1,
            "eval_every": 6,
            "eval_batches": 4,
            "save_every": 4,
            "log_every": 2,
            "torch_threads": 1,
        },
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            recipe.setdefault(section, {}).update(values)
        else:
            recipe[section] = values
    return recipe


#: the drafter kinds trained by ``trained_drafters`` and parametrised over by the tests
KINDS = ["dflash", "dspark", "eagle3"]
#: tokens each decoding test generates from each of ``target_and_prompts``'s prompts
MAX_NEW = 40


def drafter_recipe(out, target_dir, kind, drafter=None, **train):
    """A train_drafter recipe: a one-layer ``kind`` drafter of block 4 on ``target_dir``, 150 steps of the stdlib corpus."""
    from recipes.registry import parse_recipe

    return parse_recipe(
        {
            "recipe": "train_drafter",
            "output_dir": str(out),
            "seed": 0,
            "target": {"path": str(target_dir)},
            "drafter": {
                "kind": kind,
                "num_layers": 1,
                "block_size": 4,
                "num_anchors": 8,
                "markov_rank": 16,
                **(drafter or {}),
            },
            "data": {"source": "stdlib", "seq_len": 64, "max_documents": 40, "val_fraction": 0.1},
            "optim": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.0},
            "train": {
                "max_steps": 150,
                "micro_batch_size": 4,
                "eval_every": 50,
                "eval_batches": 4,
                "save_every": 40,
                "log_every": 5,
                "torch_threads": 1,
                **train,
            },
        }
    )


def student_recipe(out, target_dir, arch="llama", **train):
    """A distill_student recipe: a 2-layer student (3 for Parcae) of ``target_dir``, 60 steps of the stdlib corpus."""
    from recipes.registry import parse_recipe

    student = {
        "arch": arch,
        "hidden_size": 48,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
    }
    if arch == "parcae":
        student["num_layers"] = 3
        student["parcae"] = {
            "prelude_layers": 1,
            "core_layers": 1,
            "coda_layers": 1,
            "mean_recurrence": 2,
            "backprop_depth": 1,
            "eval_recurrences": [1],
        }
    return parse_recipe(
        {
            "recipe": "distill_student",
            "output_dir": str(out),
            "seed": 0,
            "target": {"path": str(target_dir)},
            "student": student,
            "distill": {"divergence": "forward_kl", "ce_weight": 0.1},
            "data": {"source": "stdlib", "seq_len": 64, "max_documents": 40, "val_fraction": 0.05},
            "optim": {"lr": 3e-3, "warmup_steps": 5},
            "train": {
                "max_steps": 60,
                "micro_batch_size": 8,
                "eval_every": 60,
                "eval_batches": 4,
                "save_every": 60,
                "log_every": 10,
                "torch_threads": 1,
                **train,
            },
        }
    )


def tiny_dflash_config(**overrides):
    """A DFlash config of 32 channels over a 32-channel target (4 heads, K = 4, 64 positions); ``overrides``
    change any field."""
    from drafters import DFlashConfig

    fields = dict(
        vocab_size=50,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        target_layer_ids=[0],
        target_hidden_size=32,
        mask_token_id=1,
        block_size=4,
        num_hidden_layers=1,
        max_position_embeddings=64,
    )
    return DFlashConfig(**{**fields, **overrides})


def tiny_dflash(block_attention: str = "causal", num_key_value_heads: int = 4):
    """A one-layer DFlash drafter of 32 channels over a 32-channel target, random, fused for decoding."""
    from drafters import DFlashDrafter

    cfg = tiny_dflash_config(block_attention=block_attention, num_key_value_heads=num_key_value_heads, qk_norm=True)
    return DFlashDrafter(cfg).eval().fuse_projections()


def decode_one(drafter, token, anchor_pos: int, cache, arriving=None):
    """One row's block at ``anchor_pos`` through the drafter's decoding forward
    (:meth:`~drafters.block.BlockDrafter.decode`), as the loop runs it: of the ``arriving`` features
    [1, n, F], all but the last K are appended to ``cache`` first; the cache then holds the block's context."""
    import torch

    K, cfg = drafter.config.block_size, drafter.config
    n = 0 if arriving is None else arriving.shape[1]
    if n > K:
        start = cache.length
        kv = drafter.context_kv(arriving[:, : n - K], torch.arange(start, start + n - K)[None], lean=True)
        cache.append(kv)
        arriving, n = arriving[:, n - K :], K
    assert cache.length + n == anchor_pos, "the block follows the cache and the arriving features directly"
    features = torch.zeros(1, K, drafter.fc.in_features, dtype=drafter.dtype)
    if n:
        features[:, :n] = arriving
    like = features.new_empty(1, cfg.num_key_value_heads, 0, cfg.head_dim)
    cache.ensure(anchor_pos + K + 1, like, len(drafter.layers))
    hidden = drafter.decode(torch.as_tensor(token).view(1), torch.tensor([[cache.length, n]]), features, cache)
    cache.length = anchor_pos
    return hidden


def graph_one(graph, token: int, cache, arriving):
    """:func:`decode_one` through a compiled draft's graph (its proposal off): the block after ``cache``
    and the ``arriving`` features [1, n, F], ``n <= K``; the cache then holds them."""
    import torch

    n = arriving.shape[1]
    features = torch.zeros(1, graph.block_size, arriving.shape[2], dtype=arriving.dtype)
    features[:, :n] = arriving
    hidden, _ = graph.run(torch.tensor([token]), torch.tensor([[cache.length, n]]), features, cache, propose=False)
    cache.length += n
    return hidden


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_cli(
    *args: str, env: dict | None = None, timeout: int = 300, launcher: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``draftsmith`` in a fresh process (optionally under a launcher such as torchrun)."""
    full_env = {**os.environ, **OFFLINE, **(env or {})}
    cmd = (launcher or [sys.executable]) + ["-m", "recipes.cli", *args]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout, check=False)


def launch_env(config: Path) -> tuple[object, dict]:
    """Run accelerate's launcher argument handling on ``config`` and return (args, the env it would set)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(config), "-m", "recipes.cli", "run", "r.yaml"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.use_fsdp or args.multi_gpu:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    return args, env


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
    recipe = tiny_lm_recipe(
        out, model={"num_layers": 4}, train={"max_steps": 250, "eval_every": 250, "save_every": 250}
    )
    reset_accelerate()
    train_lm.main(parse_recipe(recipe))
    reset_accelerate()
    return out / "model"


@pytest.fixture(scope="session")
def target_and_prompts(tiny_target_dir):
    """The tiny target, its tokenizer and three 24-token prompts from the held-out stdlib files."""
    import torch

    from distill.config import DataConfig, TargetConfig
    from distill.data import load_text_splits
    from distill.models import load_target

    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    docs = load_text_splits(DataConfig(source="stdlib", max_documents=40, val_fraction=0.1)).val
    prompts = [torch.tensor(tok(doc[i * 300 : i * 300 + 200])["input_ids"][:24]) for i, doc in enumerate(docs[:3])]
    return target, tok, prompts


@pytest.fixture(scope="session")
def trained_drafters(tmp_path_factory, tiny_target_dir):
    """One drafter of each of ``KINDS`` trained 250 steps on the tiny target, in eval mode, each with its
    saved ``folder``. Tests copy a drafter before changing it (they share it for the whole session)."""
    from transformers import AutoModel

    from recipes import train_drafter

    out = {}
    for kind in KINDS:
        reset_accelerate()
        folder = tmp_path_factory.mktemp(kind)
        train_drafter.main(drafter_recipe(folder, tiny_target_dir, kind, max_steps=250, eval_every=250))
        out[kind] = AutoModel.from_pretrained(folder / "model").eval()
        out[kind].folder = folder / "model"
    return out


@pytest.fixture
def deepspeed_env(monkeypatch):
    """``enter(stage)`` puts this process in the environment of a one-process ``accelerate launch`` with
    ``cpu_zero{stage}.yaml`` (a gloo world of one rank on a free port); the world is torn down afterwards."""

    def enter(stage: int) -> None:
        _, env = launch_env(REPO / f"accelerate_configs/cpu_zero{stage}.yaml")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
        )
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    yield enter
    import deepspeed.comm

    if deepspeed.comm.is_initialized():  # DeepSpeed's own teardown also forgets the groups it cached
        deepspeed.comm.destroy_process_group()
    reset_accelerate()
