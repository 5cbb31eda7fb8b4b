"""The target's attention for the few queries of a decode or verify step, on the CPU (``decoding.cpu.prepack``).

A step of ``n`` queries (1 decoding, a handful verifying) attends over the ``L`` cached positions:
``softmax(q k^T / sqrt(D) + mask) v``, a few hundred thousand multiply-adds a layer, so its time is
reading the keys and values (0.5 MB a layer on the testbed target at 205 positions, evicted from the
cache by the weights' stream in between) and the kernel's own overhead. torch's flash kernel for the
CPU is built for long query blocks; :file:`attention_op.cpp` (``draftsmith_attn::attention``) reads
each key and value row once per head (the values prefetched while the scores are computed), eight
keys' scores at a time. ``python -m recipes.bench_attention`` times both on the testbed target's
shapes (numbers: docs/benchmarks.md).

Invariants:

* Every number in a query's output is computed by the same operations in the same order whatever the
  other queries of the call are: a token verified among eight gets the bits it gets decoded alone
  (the prepacked Linears have the same property, :mod:`serve_eval.cpu.prepack`). A masked position adds
  exactly zero, and positions past the last one a query's mask shows are not read for that query (a
  batch's padding, which sees one slot, costs next to nothing).
* Outputs differ from torch's kernel by rounding only (its exp is coarser; within 1e-5 relative and
  2e-6 absolute on unit-scale inputs, tested; the testbed target's logits within 2e-5).
* Registered with transformers' ``AttentionInterface`` as ``draftsmith_fp32`` (masks built as for
  ``sdpa``), so any model that follows transformers' attention interface takes it with
  ``set_attn_implementation``; more than ``MAX_QUERIES`` queries (a long prompt's prefill), a head
  size that is not a multiple of 8, anything but fp32 on the CPU, or a call that needs gradients goes
  to transformers' ``sdpa`` function. Both loops decode with the same target, so plain decoding gets
  the kernel too and speedups stay honest.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import native

NAME = "draftsmith_fp32"
#: more queries than this (a prefill) go to torch's flash kernel, which blocks long query runs
MAX_QUERIES = 64
_SOURCE = Path(__file__).with_name("attention_op.cpp")


@functools.cache
def available() -> bool:
    """Whether ``draftsmith_attn`` runs here: an x86 CPU with AVX2 and FMA, and the operator built
    (with its shape function, so that a compiled graph can hold it: a drafter's draft)."""
    if not native.avx2_operator(_SOURCE, "serve_eval.cpu.attention: the C++ attention operator", "sdpa"):
        return False
    torch.library.register_fake("draftsmith_attn::attention", _fake)
    return True


def _fake(q, k, v, mask, scale, causal=False):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])


def _serves(query: torch.Tensor, key: torch.Tensor, dropout: float) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype == key.dtype == torch.float32
        and query.shape[2] <= MAX_QUERIES
        and query.shape[-1] % 8 == 0
        and dropout == 0.0
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
    )


def attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention-function signature: ``query`` [B, H, n, D], ``key`` / ``value``
    [B, Hk, L, D], the mask as ``sdpa_mask`` builds it (None where causal order alone applies);
    returns [B, n, H, D] and no weights."""
    if not _serves(query, key, dropout):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    n = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None and attention_mask.dim() < 4:  # [n, L] (or [H, n, L]): broadcast as sdpa does
        attention_mask = attention_mask.view((1,) * (4 - attention_mask.dim()) + tuple(attention_mask.shape))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # no mask and causal order (a verify's chain): query i sits at position L - n + i, no mask built
    return torch.ops.draftsmith_attn.attention(
        query, key, value, attention_mask, scale, attention_mask is None and n > 1 and causal
    ), None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_attention(model) -> dict:
    """Serve ``model``'s attention from :func:`attention` (in place; a model whose attention does not
    follow transformers' interface keeps its own): the target, or a block drafter (whose layers
    read ``config._attn_implementation``, :class:`drafters.layers.DraftAttention`; before its draft is
    compiled, which traces what it calls). Returns what the report records."""
    if not available():
        return {"kernel": "sdpa", "why": "the C++ attention operator does not serve here"}
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation(NAME)
    except (AttributeError, ValueError) as error:  # not a transformers model, or one that refuses the name
        return {"kernel": before, "why": f"{type(model).__name__}: {error}"}
    if model.config._attn_implementation != NAME:
        return {"kernel": before, "why": f"{type(model).__name__} does not take an attention function"}
    return {"kernel": NAME, "max_queries": MAX_QUERIES}


def top_tokens(logits: torch.Tensor, with_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`serve_eval.sampling.top_tokens` from ``draftsmith_attn::top`` where it serves (float32 on the
    CPU): the same tokens as ``torch.argmax`` (ties to the first maximum, a NaN counting as the maximum),
    the probability within ~1e-6 of torch's softmax, in one pass over each row."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.numel() and available():
        tokens, probs = torch.ops.draftsmith_attn.top(logits, with_prob)
        return tokens, probs if with_prob else None
    return logits.argmax(-1), logits.float().softmax(-1).amax(-1) if with_prob else None
