"""Targets: any local causal LM loads frozen in the requested dtype; the shipped testbed target is
complete (weights, tokenizer, provenance) and is as good as its training record says."""

from __future__ import annotations

import json

import pytest
import torch

from distill.base.flops import flops_per_token, matmul_params
from distill.config import ModelConfig, RecipeError, TargetConfig
from distill.models import build_causal_lm, load_target, special_token_ids, tiny_target
from distill.testbed import SHIPPED_TARGET
from recipes.registry import parse_recipe


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from distill.config import DataConfig, TokenizerConfig
    from distill.data import build_tokenizer, load_text_splits

    folder = tmp_path_factory.mktemp("tiny-target")
    tok = build_tokenizer(
        TokenizerConfig(vocab_size=400), load_text_splits(DataConfig(max_documents=30, val_fraction=0.1))
    )
    model = build_causal_lm(tiny_target().model_copy(update={"arch": "qwen3"}), len(tok), special_token_ids(tok))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_local_target_loads_frozen_in_requested_dtype(tiny_folder, dtype):
    model, tok = load_target(TargetConfig(path=str(tiny_folder), dtype=dtype))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert len(tok) == model.config.vocab_size


def test_missing_local_target_is_a_recipe_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        TargetConfig(path=str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="nor in the hub cache"):  # the tests run with HF_HUB_OFFLINE=1
        TargetConfig(path="no-such-org/no-such-model")
    with pytest.raises(RecipeError, match="target.train_recipe.*does not exist"):
        parse_recipe({"recipe": "quickstart", "output_dir": "x", "target": {"train_recipe": str(tmp_path / "r.yaml")}})


def test_flops_count_tied_head_once():
    tied = build_causal_lm(ModelConfig(hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128), 1000)
    untied = build_causal_lm(
        ModelConfig(hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128, tie_word_embeddings=False), 1000
    )
    assert matmul_params(tied) == matmul_params(untied)  # the head is one matmul either way; lookups are free
    assert flops_per_token(tied, 128) == 3 * flops_per_token(tied, 128, training=False)


def test_shipped_testbed_target_is_complete_and_as_good_as_recorded():
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "recipe.yaml",
        "provenance.json",
        "training_summary.json",
    ):
        assert (SHIPPED_TARGET / name).exists(), f"shipped target lacks {name}"
    record = json.loads((SHIPPED_TARGET / "training_summary.json").read_text())
    prov = json.loads((SHIPPED_TARGET / "provenance.json").read_text())
    assert (
        prov["shipped"]["dtype"] == "float16" and prov["data"]["text_fingerprint"] == record["data"]["text_fingerprint"]
    )
    model, tok = load_target(TargetConfig(path="testbed"))
    assert tok.mask_token == "<|mask|>" and model.config.vocab_size == len(tok)
    # greedy continuation of Python source should look like Python
    ids = tok("def __init__(self", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    assert record["val_loss"] < 4.0, "the shipped target should beat a few minutes of training (5.5)"
