"""Tiny random-weight models of the architecture families users bring, built from transformers' own
config classes (nothing downloads): each exercises its family's real code paths (RoPE variants,
q/k norms, sliding windows, scaled embeddings, mixtures of experts, attention sinks)."""

from __future__ import annotations

from pathlib import Path

import torch

#: window of the windowed families: prompts in the tests run well past it
WINDOW = 16


def family_config(name: str, vocab_size: int, special: dict | None = None, window: int = WINDOW, **shape):
    """The config of a tiny ``name`` model (4 layers, 64 channels unless ``shape`` says otherwise)."""
    from transformers import Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig, Qwen3Config, Qwen3MoeConfig

    c = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **(special or {}),
    )
    c.update(shape)
    layers = c["num_hidden_layers"]
    alternating = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
    if name == "llama3":  # llama3 RoPE scaling
        return LlamaConfig(
            **c,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if name == "qwen3":  # q/k norms, an untied head, head_dim apart from hidden / heads
        return Qwen3Config(**c, head_dim=32, tie_word_embeddings=False)
    if name == "gemma3":  # sliding + global layers (RoPE per layer type), tied scaled embeddings, head_dim 32 != 64 / 4
        gemma_types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        return Gemma3TextConfig(
            **c, head_dim=32, sliding_window=window, layer_types=gemma_types, query_pre_attn_scalar=32
        )
    if name == "mistral":  # every layer windowed
        return MistralConfig(**c, sliding_window=window, head_dim=16)
    if name == "qwen3_moe":
        return Qwen3MoeConfig(**c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[])
    if name == "gpt_oss":  # experts, attention sinks, alternating windows
        return GptOssConfig(
            **c, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=window, layer_types=alternating
        )
    raise KeyError(name)


FAMILIES = ["llama3", "qwen3", "gemma3", "mistral", "qwen3_moe", "gpt_oss"]
WINDOWED = ["gemma3", "mistral", "gpt_oss"]


def family_model(name: str, vocab_size: int, special: dict | None = None, seed: int = 0, **shape):
    """A randomly initialised model of family ``name`` (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(name, vocab_size, special, **shape)).eval()


def save_family(name: str, folder: Path, tokenizer) -> Path:
    """A tiny ``name`` target saved with ``tokenizer``, the way a hub checkpoint is laid out."""
    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    model = family_model(name, len(tokenizer), special)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_gemma3_multimodal(folder: Path, tokenizer) -> Path:
    """A tiny Gemma 3 checkpoint with a vision tower (``Gemma3ForConditionalGeneration``), as the hub's
    ``gemma-3-*-it`` checkpoints are laid out."""
    from transformers import AutoModelForCausalLM, Gemma3Config, SiglipVisionConfig

    text = family_config(
        "gemma3", len(tokenizer), {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    )
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    ).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
