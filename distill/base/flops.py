"""FLOP counting for MFU.

FLOPs per token follow the PaLM appendix: ``6 * N`` for every weight matrix applied per token
(embedding lookups excluded, a tied LM head counted once) plus ``12 * layers * heads * head_dim *
seq_len`` for attention scores and values, forward + backward (``2 * N`` and a third of the attention
term for a forward alone). A model that loops its layers (Parcae) counts its iterations itself, in
its own ``flops_per_token(seq_len, training)``.

A mixture-of-experts layer applies ``top_k`` of its ``E`` routed experts to a token, so the routed
experts' weights count ``top_k / E`` of their size; the router and shared experts count in full.
"""

from __future__ import annotations

EXPERTS = "experts"  # the name of the module holding the routed experts (transformers' MoE layers)
NUM_EXPERTS_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen3-MoE; Mixtral, gpt-oss; DeepSeek


def matmul_params(model) -> int:
    """Parameters applied as matrix multiplies per token (embedding lookups excluded); the routed
    experts' weights count ``top_k / E`` of their size (:func:`routed_experts`), rounded down."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb
    dense = routed = 0
    for name, p in model.named_parameters():
        if p is emb and not tied:
            continue  # a lookup, not a matmul
        is_routed, stacked = expert_param(name)
        if p.dim() - stacked < 2:
            continue  # norms, biases (an expert's bias, too)
        if is_routed:
            routed += p.numel()
        else:
            dense += p.numel()
    if not routed:
        return dense
    top_k, experts = routed_experts(model.config)
    return dense + routed * top_k // experts


def expert_param(name: str) -> tuple[bool, int]:
    """``(routed, stacked_dims)`` for a parameter's qualified name: ``routed`` when it belongs to a
    routed expert, i.e. sits under a module called ``experts`` (``shared_expert(s)`` are not: they see
    every token); ``stacked_dims`` is 1 when it is the experts module's own, fused parameter whose
    leading dimension indexes the experts (``mlp.experts.gate_up_proj`` [E, ...]), else 0 (a module
    per expert: ``mlp.experts.3.down_proj.weight``)."""
    parts = name.split(".")
    if EXPERTS not in parts[:-1]:
        return False, 0
    return True, int(parts.index(EXPERTS) == len(parts) - 2)


def routed_experts(config) -> tuple[int, int]:
    """``(num_experts_per_tok, num_experts)`` of a MoE config (its text config for a multimodal one); a
    ValueError when either is missing, rather than a silently wrong FLOP count."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = next((getattr(c, f) for f in NUM_EXPERTS_FIELDS if getattr(c, f, None)), None)
    top_k = getattr(c, "num_experts_per_tok", None)
    if not experts or not top_k:
        raise ValueError(
            f"{type(c).__name__} has routed experts but no {' / '.join(NUM_EXPERTS_FIELDS)} "
            "and num_experts_per_tok: cannot count the FLOPs a token spends in them"
        )
    return int(top_k), int(experts)


def flops_per_token(model, seq_len: int, training: bool = True) -> float:
    if hasattr(model, "flops_per_token"):  # looped models count their iterations themselves
        return model.flops_per_token(seq_len, training)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn = 2 * c.num_hidden_layers * c.num_attention_heads * head_dim * seq_len  # forward, per token
    dense = 2 * matmul_params(model)
    return (dense + attn) * (3 if training else 1)
