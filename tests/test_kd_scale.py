"""Distillation at scale: the KD loss in chunks of positions equals the whole-vocabulary loss (value and
gradients) without ever holding a [B, T, V] tensor; held-out evaluation runs the same number of forwards
on every rank; a mixture-of-experts model's FLOPs count the experts a token visits."""

from __future__ import annotations

import pytest

from distill.base.flops import flops_per_token, matmul_params

# ---------------------------------------------------------------------------------------------------
# FLOPs of mixture-of-experts models


def moe_model(kind: str):
    from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3MoeConfig

    common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts_per_tok=2)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(num_experts=8, moe_intermediate_size=32, intermediate_size=128, **common)
    else:
        cfg = GptOssConfig(num_local_experts=8, intermediate_size=32, **common)
    return AutoModelForCausalLM.from_config(cfg)


def active_matmul_params(cfg, experts: int, expert_intermediate: int, visited: int) -> int:
    """Per token: attention q, k, v, o, the router, ``visited`` experts (gate and up [D, 2I], down [I, D])
    a layer, and the untied LM head."""
    D, hd = cfg.hidden_size, cfg.head_dim
    attn = 2 * D * cfg.num_attention_heads * hd + 2 * D * cfg.num_key_value_heads * hd
    router = experts * D
    active = visited * 3 * D * expert_intermediate
    return cfg.num_hidden_layers * (attn + router + active) + cfg.vocab_size * D


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_moe_flops_count_the_experts_a_token_visits(kind):
    model = moe_model(kind)
    cfg = model.config
    experts, inter = (cfg.num_experts, cfg.moe_intermediate_size) if kind == "qwen3_moe" else \
        (cfg.num_local_experts, cfg.intermediate_size)
    assert not cfg.tie_word_embeddings
    assert matmul_params(model) == active_matmul_params(cfg, experts, inter, cfg.num_experts_per_tok)
    every_weight = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "bias" not in n)
    assert every_weight == active_matmul_params(cfg, experts, inter, experts)  # what a dense count would claim
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * 128
    assert flops_per_token(model, 128, training=False) == 2 * matmul_params(model) + attn


def test_moe_flops_need_the_routing_fields():
    from types import SimpleNamespace

    model = moe_model("qwen3_moe")
    model.config = SimpleNamespace(num_experts=8)  # a config that does not say how many experts a token visits
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        matmul_params(model)


def test_dense_flops_count_every_matrix():
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    assert matmul_params(model) == sum(p.numel() for p in model.parameters() if p.dim() >= 2) - 300 * 64
