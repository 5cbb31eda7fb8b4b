"""Blocks in a sequence: where anchors are drawn, what each block's queries see, and gathering
values at block positions (notation: :mod:`drafters.block`).

Attention (one mask, queries = all block tokens, keys = [features ; block tokens])
    feature key ``j`` is visible to block ``n``'s queries iff ``j < a_n`` (and ``j >= a_n - W`` in a
    layer with a sliding window ``W``); block keys are visible only
    inside the same block: all of them (``bidirectional``, DFlash's block diffusion) or those at
    ``k' <= k`` (``causal``, JetSpec-style causal drafting). Every query sees at least itself, so no row
    is fully masked. On a GPU the mask is a flex-attention ``BlockMask`` (``mask_implementation``
    ``auto`` / ``flex``): at the 8B recipes' sizes (8,192 block queries x 10,240 keys) most tiles are
    empty and are skipped; on a CPU it is a dense boolean mask for SDPA (the same attention, tested).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def sample_anchors(
    seq_len: int,
    block_size: int,
    count: int,
    batch: int,
    device=None,
    generator: torch.Generator | None = None,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``count`` distinct anchors per sequence in ``[1, seq_len - block_size]``, sorted ([B, N]).

    With a ``loss_mask`` [B, seq_len] (responses scored, prompts and padding not), anchors are drawn
    only where the first label ``x[a + 1]`` is scored, as decoding anchors only on the target's own
    tokens; a sequence with fewer such positions than ``count`` fills up with unscored anchors, whose
    blocks carry no loss. Drawn from torch's global RNG unless a generator is given; training gives one
    seeded by the batch's data position, so the anchors of a step depend on nothing else (not on what
    else drew from the RNG: a DeepSpeed engine's setup, say) and a resumed run draws the same ones."""
    hi = seq_len - block_size  # the last label x[a + K - 1] must exist
    if hi < 1:
        raise ValueError(f"sequences of {seq_len} tokens are too short for blocks of {block_size}")
    count = min(count, hi)
    scores = torch.rand(batch, hi, generator=generator)
    if loss_mask is not None:  # candidate a = 1..hi is useful iff loss_mask[a + 1]
        scores = scores + loss_mask[:, 2 : hi + 2].to(scores.device, scores.dtype)
    anchors = scores.topk(count, dim=1).indices + 1
    return anchors.sort(dim=1).values.to(device)


def block_attention_mask(
    anchors: torch.Tensor, ctx_len: int, block_size: int, causal: bool, window: int | None = None
) -> torch.Tensor:
    """Boolean mask [B, 1, N*K, ctx_len + N*K]: True where a block query may attend (see module doc)."""
    B, N = anchors.shape
    K = block_size
    dev = anchors.device
    positions = torch.arange(ctx_len, device=dev)[None, None, :]
    ctx_visible = positions < anchors[:, :, None]  # [B, N, T]
    if window is not None:
        ctx_visible &= positions >= anchors[:, :, None] - window
    ctx_visible = ctx_visible[:, :, None, :].expand(B, N, K, ctx_len).reshape(B, N * K, ctx_len)
    blk = torch.arange(N * K, device=dev)
    same_block = (blk[:, None] // K) == (blk[None, :] // K)
    if causal:
        same_block &= (blk[None, :] % K) <= (blk[:, None] % K)
    mask = torch.cat([ctx_visible, same_block[None].expand(B, -1, -1)], dim=-1)
    return mask[:, None]


def flex_block_mask(
    anchors: torch.Tensor, ctx_len: int, block_size: int, causal: bool, window: int | None = None
) -> BlockMask:
    """:func:`block_attention_mask` as a flex-attention ``BlockMask``: only the key tiles a block's
    queries can see are computed (the context before its anchor, its own block)."""
    B, N = anchors.shape
    K = block_size

    def visible(b, h, q, kv):
        n = q // K
        block_kv = kv - ctx_len
        same = (kv >= ctx_len) & (block_kv // K == n)
        if causal:
            same = same & (block_kv % K <= q % K)
        before = (kv < ctx_len) & (kv < anchors[b, n])
        if window is not None:
            before = before & (kv >= anchors[b, n] - window)
        return before | same

    return create_block_mask(visible, B, None, N * K, ctx_len + N * K, device=anchors.device)


def gather_positions(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x`` [B, T, ...] gathered at ``positions`` [B, *] -> [B, *, ...]."""
    B = x.shape[0]
    flat = positions.reshape(B, -1)
    idx = flat.view(B, -1, *([1] * (x.dim() - 2))).expand(B, flat.shape[1], *x.shape[2:])
    return x.gather(1, idx).view(*positions.shape, *x.shape[2:])
