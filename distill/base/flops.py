"""FLOP counting for MFU.

FLOPs per token follow the PaLM appendix: ``6 * N`` for every weight matrix applied per token
(embedding lookups excluded, a tied LM head counted once) plus ``12 * layers * heads * head_dim *
seq_len`` for attention scores and values, forward + backward (``2 * N`` and a third of the attention
term for a forward alone). A model that loops its layers (Parcae) counts its iterations itself, in
its own ``flops_per_token(seq_len, training)``.
"""

from __future__ import annotations


def matmul_params(model) -> int:
    """Parameters applied as matrix multiplies per token (embedding lookups excluded)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb
    total = 0
    for p in model.parameters():
        if p.dim() < 2:
            continue  # norms, biases
        if p is emb and not tied:
            continue  # a lookup, not a matmul
        total += p.numel()
    return total


def flops_per_token(model, seq_len: int, training: bool = True) -> float:
    if hasattr(model, "flops_per_token"):  # looped models count their iterations themselves
        return model.flops_per_token(seq_len, training)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn = 2 * c.num_hidden_layers * c.num_attention_heads * head_dim * seq_len  # forward, per token
    dense = 2 * matmul_params(model)
    return (dense + attn) * (3 if training else 1)
