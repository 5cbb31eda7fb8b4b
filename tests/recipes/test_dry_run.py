"""``--dry-run`` memory estimates: every training recipe kind prints the same table from models built on
the meta device; the terms follow their formulas (one real-size case computed by hand); the shipped
real-target recipes dry-run offline from the shipped configs with their published sizes; a student
trains with the KD loss in chunks."""

from __future__ import annotations

import json

import pytest
import torch

from distill.config import RecipeError
from distill.config.targets import SHIPPED_TARGET_CONFIGS, allow_shipped_target_configs, shipped_target_ids
from recipes.dry_run import MEMORY_KEYS, GiB, Launch, estimate_for, training_state
from recipes.registry import load_recipe, parse_recipe, run_recipe

from ..conftest import REPO, reset_accelerate, run_cli, tiny_lm_recipe

#: published parameter counts of the shipped targets (Gemma 3: its language model, the vision tower aside)
PUBLISHED = {
    "Qwen/Qwen3-8B": 8.2e9,
    "meta-llama/Llama-3.1-8B-Instruct": 8.0e9,
    "google/gemma-3-12b-it": 11.8e9,
    "Qwen/Qwen3-30B-A3B": 30.5e9,
}
REAL_TARGET_RECIPES = sorted(
    {p for pattern in ("*_8b.yaml", "*_12b.yaml", "*_30b*.yaml") for p in (REPO / "recipes" / "configs").glob(pattern)}
)
TABLE_KEYS = {
    *MEMORY_KEYS,
    "total",
    "bytes",
    "num_processes",
    "zero_stage",
    "mixed_precision",
    "formulas",
    "loss_positions_held",
    "loss_positions_per_batch",
    "trainable_parameters",
}


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory):
    """A tiny Qwen3-MoE target (4 experts a layer) with the testbed tokenizer (which has a mask token)."""
    from transformers import AutoTokenizer

    from distill.testbed import SHIPPED_TARGET

    from ..families import save_family

    return save_family(
        "qwen3_moe", tmp_path_factory.mktemp("moe-target"), AutoTokenizer.from_pretrained(SHIPPED_TARGET)
    )


def kind_recipe(kind: str, target, out) -> dict:
    """A raw recipe of ``kind`` against ``target``: drafters (dflash, dspark, eagle3), students (plain,
    PARD, Parcae) and train_lm."""
    common = {
        "output_dir": str(out),
        "data": {"source": "stdlib", "seq_len": 64, "max_documents": 4},
        "train": {"micro_batch_size": 2, "mixed_precision": "bf16"},
    }
    if kind in ("dflash", "dspark", "eagle3"):
        return {
            "recipe": "train_drafter",
            **common,
            "target": {"path": str(target)},
            "drafter": {"kind": kind, "block_size": 4, "num_anchors": 8, "loss_chunk": 6},
        }
    if kind == "train_lm":
        return tiny_lm_recipe(out, train={"mixed_precision": "bf16", "micro_batch_size": 2})
    student = {
        "arch": "llama",
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
    }
    raw = {"recipe": "distill_student", **common, "target": {"path": str(target)}, "student": student}
    if kind == "pard":
        raw["pard"] = {"draft_tokens": 4, "anchors": 3}
    if kind == "parcae":
        student.update(
            arch="parcae",
            num_layers=3,
            parcae={"prelude_layers": 1, "core_layers": 1, "coda_layers": 1, "mean_recurrence": 3, "backprop_depth": 2},
        )
    return raw


@pytest.mark.parametrize("kind", ["dflash", "dspark", "eagle3", "student", "pard", "parcae", "train_lm"])
def test_every_training_kind_dry_runs_with_a_memory_table(kind, moe_target, tmp_path):
    """Each kind returns the same table; its bytes add up; the frozen target's term is every parameter of
    the MoE target (all experts); the loss holds what the recipe's positions and vocabulary say."""
    recipe = parse_recipe(kind_recipe(kind, moe_target, tmp_path))
    result = run_recipe(recipe, dry_run=True)
    table = result["memory_gib_per_device"]
    assert set(table) == TABLE_KEYS
    exact = table["bytes"]
    assert exact["total"] == sum(exact[k] for k in MEMORY_KEYS) and all(exact[k] >= 0 for k in MEMORY_KEYS)
    assert exact["trainable_weights"] > 0 and exact["adamw_states"] == 12 * table["trainable_parameters"] // 8
    if kind == "train_lm":
        assert exact["target_weights"] == 0 and exact["loss_logits"] == 3 * 2 * 64 * 512 * 4
        return
    target_params = result["target"]["parameters"]
    from transformers import AutoModelForCausalLM

    assert target_params == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(moe_target).parameters())
    assert exact["target_weights"] == 4 * target_params  # float32, every expert resident
    vocab = 4096
    if kind in ("dflash", "dspark"):  # 8 anchors x 3 drafted positions x 2 rows, chunks of whole blocks >= 6
        assert (table["loss_positions_per_batch"], table["loss_positions_held"]) == (48, 6)
    elif kind == "eagle3":  # every position at each of the 3 training-time-test steps
        assert table["loss_positions_per_batch"] == 2 * 64 * 3
    elif kind == "pard":  # 3 anchors x 3 mask slots appended to each row
        assert table["loss_positions_per_batch"] == 2 * (64 + 9)
    else:
        assert table["loss_positions_per_batch"] == 2 * 64
    assert exact["loss_logits"] == 6 * table["loss_positions_held"] * vocab * 4


def test_training_state_follows_the_launch():
    """Bytes of a model with 110 trainable and 40 frozen parameters: no DeepSpeed keeps fp32 weights,
    gradients and moments (16 bytes a parameter); DeepSpeed bf16 holds 16-bit weights and gradients plus
    12 bytes of fp32 master and moments, sharded by stage."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Embedding(4, 10).requires_grad_(False))

    def state(mp, gpus, stage):
        return training_state(model, mp, Launch(gpus, stage))

    assert state("bf16", 4, 0) == {
        "frozen_weights": 160,
        "trainable_weights": 440,
        "gradients": 440,
        "adamw_states": 880,
    }
    assert state("bf16", 4, 1) == {
        "frozen_weights": 80,
        "trainable_weights": 220,
        "gradients": 220,
        "adamw_states": 12 * 110 / 4,
    }
    assert state("bf16", 4, 2) == {
        "frozen_weights": 80,
        "trainable_weights": 220,
        "gradients": 55,
        "adamw_states": 12 * 110 / 4,
    }
    assert state("bf16", 4, 3) == {
        "frozen_weights": 20,
        "trainable_weights": 55,
        "gradients": 55,
        "adamw_states": 12 * 110 / 4,
    }
    assert state("no", 2, 2) == {
        "frozen_weights": 160,
        "trainable_weights": 440,
        "gradients": 220,
        "adamw_states": 8 * 110 / 2,
    }
    with pytest.raises(ValueError, match="zero_stage"):
        Launch(8, 4)


def test_the_qwen3_8b_student_estimate_by_hand():
    """student_qwen3_8b at 8 GPUs, ZeRO-2, bf16, every term from the published shapes by hand."""
    V, H, L, heads, kv, hd, inter = 151936, 4096, 36, 32, 8, 128, 12288  # Qwen3-8B
    layer = H * heads * hd * 2 + H * kv * hd * 2 + 3 * H * inter + 2 * H + 2 * hd  # q, o; k, v; MLP; norms; q/k norms
    qwen3_8b = L * layer + 2 * V * H + H  # untied embeddings and head, final norm
    assert qwen3_8b == 8_190_735_360
    h, n, s_heads, s_kv, s_inter = 1024, 16, 16, 8, 3072  # the student, tied embeddings
    student = n * (h * s_heads * hd * 2 + h * s_kv * hd * 2 + 3 * h * s_inter + 2 * h + 2 * hd) + V * h + h
    assert student == 407_278_592
    rows, seq, chunk = 4, 2048, 1024
    by_hand = {
        "target_weights": 2 * qwen3_8b,
        "frozen_weights": 0,
        "trainable_weights": 2 * student,  # bf16 under DeepSpeed
        "gradients": 2 * student / 8,  # ZeRO-2 shards them
        "adamw_states": 12 * student / 8,  # fp32 master + two moments, sharded
        "features": rows * seq * H * 2,  # the teacher's last hidden states, bf16 (chunked loss)
        "activations": 34 * rows * seq * h * n,
        "loss_logits": 6 * chunk * V * 4,
    }
    with allow_shipped_target_configs():
        recipe = load_recipe("student_qwen3_8b")
    assert recipe.distill.loss_chunk == chunk
    with estimate_for(Launch(8, 2)):
        result = run_recipe(recipe, dry_run=True)
    table = result["memory_gib_per_device"]
    assert result["student"]["parameters"] == student and result["target"]["parameters"] == qwen3_8b
    for key, value in by_hand.items():
        assert table[key] == round(value / GiB, 2), key
    assert table["total"] == round(sum(int(v) for v in by_hand.values()) / GiB, 2)
    assert (table["target_weights"], table["loss_logits"], table["activations"]) == (15.26, 3.48, 4.25)


def test_every_real_target_has_a_shipped_config():
    assert shipped_target_ids() == sorted(PUBLISHED)
    assert {path.relative_to(SHIPPED_TARGET_CONFIGS).as_posix() for path in SHIPPED_TARGET_CONFIGS.glob("*/*")} == set(
        PUBLISHED
    )


@pytest.mark.parametrize("path", REAL_TARGET_RECIPES, ids=lambda p: p.stem)
def test_real_target_recipes_dry_run_offline(path):
    """Each shipped real-target recipe validates and dry-runs with the hub unreachable (HF_HUB_OFFLINE, no
    cache): the target is built from its shipped config with the published parameter count (within 5%;
    a mixture of experts with all its experts), and the memory table fits an 80 GiB GPU."""
    with allow_shipped_target_configs():
        recipe = load_recipe(path)
    result = run_recipe(recipe, dry_run=True)
    table = result["memory_gib_per_device"]
    assert set(table) == TABLE_KEYS and (table["num_processes"], table["zero_stage"]) == (8, 2)
    assert result["target"]["parameters"] == pytest.approx(PUBLISHED[recipe.target.path], rel=0.05)
    assert 0 < table["total"] < 80, table
    assert table["target_weights"] == round(2 * result["target"]["parameters"] / GiB, 2)  # bf16


def test_the_command_line_prints_the_table_and_keeps_real_runs_strict():
    """``--dry-run`` prints the JSON summary and the table for the launch asked for; without it the
    same recipe is refused offline before anything runs (exit 2, no traceback), as are bad flags."""
    out = run_cli("run", "dflash_qwen3_30b_a3b", "--dry-run", "--num-processes", "4", "--zero-stage", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    summary, _, table = out.stdout.partition("\nmemory per GPU, GiB")
    memory = json.loads(summary)["memory_gib_per_device"]
    assert (memory["num_processes"], memory["zero_stage"]) == (4, 3) and "4 GPU(s), DeepSpeed ZeRO-3" in table
    rows = dict(line.split() for line in table.splitlines()[1:] if len(line.split()) == 2)
    assert {k: float(v) for k, v in rows.items()} == {k: memory[k] for k in (*MEMORY_KEYS, "total")}
    real = run_cli("run", "dflash_llama31_8b")
    assert real.returncode == 2 and "nor in the hub cache" in real.stderr and "Traceback" not in real.stderr
    bad = run_cli("run", "dflash_llama31_8b", "--dry-run", "--zero-stage", "4")
    assert bad.returncode == 2 and "--zero-stage" in bad.stderr
    flags = run_cli("run", "dflash_llama31_8b", "--num-processes", "2")
    assert flags.returncode == 2 and "--dry-run" in flags.stderr
    no_mask = run_cli(
        "run", "dflash_llama31_8b", "drafter.mask_token_id=null", "--dry-run"
    )  # the config names no mask token
    assert (
        no_mask.returncode == 2
        and "error: drafter.mask_token_id" in no_mask.stderr
        and "Traceback" not in no_mask.stderr
    )


def test_a_student_trains_with_the_kd_loss_in_chunks(tmp_path, monkeypatch):
    """``distill.loss_chunk`` reaches the KD loss, and two steps train with finite losses."""
    from recipes import distill_student

    chunks = []
    real = distill_student.kd_loss_fn
    monkeypatch.setattr(distill_student, "kd_loss_fn", lambda *a, **k: chunks.append(k.get("chunk")) or real(*a, **k))
    raw = kind_recipe("student", "testbed", tmp_path)
    raw["distill"] = {"divergence": "forward_kl", "ce_weight": 0.1, "loss_chunk": 16}
    raw["data"] = {"source": "stdlib", "seq_len": 32, "max_documents": 20, "val_fraction": 0.1}
    raw["train"] = {
        "max_steps": 2,
        "micro_batch_size": 2,
        "eval_every": 2,
        "eval_batches": 1,
        "save_every": 2,
        "log_every": 1,
        "torch_threads": 1,
    }
    reset_accelerate()
    summary = distill_student.main(parse_recipe(raw))
    assert chunks == [16] and summary["steps"] == 2
    logs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in logs if "train/loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    with pytest.raises(RecipeError, match="distill.loss_chunk"):
        parse_recipe({**raw, "distill": {"loss_chunk": 0}})
