"""The block-drafter core shared by DFlash, DSpark (and, for its layers, EAGLE-3).

Notation: a sequence ``x[0..T-1]``; target features ``f[t]`` (hidden states of the configured target
layers after the target read ``x[0..t]``, see :mod:`distill.base.features`); block size ``K``.

Blocks
    An *anchor* position ``a`` starts a block ``[x[a], MASK, ..., MASK]`` of ``K`` tokens at positions
    ``a .. a+K-1``. Block position ``k >= 1`` predicts ``x[a+k]``; position 0 (the anchor, the token
    the target just emitted) carries no loss. In decoding the anchor is the target's bonus token, which
    the target has not read yet, so block queries see target features **strictly before** the anchor:
    ``f[j]`` for ``j < a``. Training samples many anchors per sequence at once; each block sees its own
    prefix of features, so one forward trains them all.

Attention (one mask, queries = all block tokens, keys = [features ; block tokens])
    feature key ``j`` is visible to block ``n``'s queries iff ``j < a_n``; block keys are visible only
    inside the same block: all of them (``bidirectional``, DFlash's block diffusion) or those at
    ``k' <= k`` (``causal``, JetSpec-style causal drafting). Every query sees at least itself, so no row
    is fully masked. On a GPU the mask is a flex-attention ``BlockMask`` (``mask_implementation``
    ``auto`` / ``flex``): at the 8B recipes' sizes (8,192 block queries x 10,240 keys) most tiles are
    empty and are skipped; on a CPU it is a dense boolean mask for SDPA (the same attention, tested).

Features enter through ``fc`` (concatenated target layers -> hidden) and ``hidden_norm``; in every
drafter layer they are *prepended* to the block's keys and values (KV injection). Token embeddings and
the LM head are the target's, copied in and frozen, so the drafter speaks the target's vocabulary.

Acceptance (:func:`acceptance_stats`)
    For greedy verification a drafted token at block position ``k`` is kept iff it and every earlier
    one equal the target's argmax. With ``m_k`` that indicator, the per-position acceptance is the
    conditional rate ``acc_k = E[m_1..m_k] / E[m_1..m_{k-1}]`` and the mean accepted length of a block
    drawn uniformly is ``block_tau = 1 + sum_k prod_{j<=k} acc_j = 1 + sum_k E[m_1 ... m_k]`` (the
    bonus token counts one). The probabilistic variant (sampling at temperature 1) uses ``1 - TV(p, q)``
    in place of ``m_k``. Serving does not draw blocks uniformly: it visits the anchors where the last
    step ended, so it spends many steps where acceptance is low and few where it is high, and its
    tokens per step are lower than ``block_tau`` whenever acceptance varies along the text.
    :func:`decode_walk` replays serving over the target's greedy answers: the *simulated tau*.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, eager_attention_forward, rotate_half
from transformers.utils import ModelOutput

from distill.base.features import LAYER_ID_CONVENTION

from .losses import BlockScores, block_scores
from .vocab import restrict_vocab

# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


# Norms, the MLP and rotary embeddings are transformers' own Llama modules (Qwen3's are the same
# classes), so RoPE scaling (``rope_parameters``: YaRN, llama3, ...) and the attention kernels
# transformers registers come with them; only the KV injection is the drafter's.

RMSNorm = LlamaRMSNorm


class RotaryEmbedding(LlamaRotaryEmbedding):
    """transformers' Llama rotary embedding whose inverse frequencies stay fp32 when the module is cast to
    another floating dtype (``.to(torch.bfloat16)``, ``.half()``; only moved to the new device). cos and
    sin are computed in fp32 from ``inv_freq`` either way; a bf16 ``inv_freq`` (8 significant bits) would
    put the angle ``position * inv_freq`` off by up to ``position * 2^-9`` radians (cosines off by 0.9 at
    position 1,000). So a drafter cast whole to bf16 rotates by the fp32 module's angles, rounded only
    where cos and sin are cast to the input's dtype."""

    def _apply(self, fn, recurse=True):
        fp32 = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, buf in fp32.items():
            moved = self._buffers[name]
            if moved is not None and moved.dtype != torch.float32:
                self._buffers[name] = buf.to(moved.device)
        return self


def same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values in one dtype, as attention kernels take them: autocast's where it is on
    for their device (what autocast gives SDPA; flex attention, which it does not cover, gets the same),
    else the widest of theirs where they differ. Under autocast they do differ: ``q_norm`` / ``k_norm``
    return fp32 (transformers' RMSNorm scales its input, cast back to bf16, by its fp32 weight) while
    ``v_proj`` returns bf16. Tensors that already agree, with autocast off, are returned as they are."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    elif q.dtype == k.dtype == v.dtype:
        return q, k, v
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def rms(norm: LlamaRMSNorm | None, x: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """``norm(x)`` (``x`` itself for no norm), with ``fused`` in one operation where that is the same
    arithmetic (fp32: transformers' module computes in fp32, then scales by its weight). Decoding fuses;
    training calls the module (DeepSpeed ZeRO-3 gathers a partitioned weight in the module's hooks)."""
    if norm is None:
        return x
    if not fused or x.dtype != torch.float32 or norm.weight.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


class DraftAttention(nn.Module):
    """Multi-head attention whose queries and keys/values may come from different inputs (the context's
    keys and values are projected once, :meth:`project_kv`, and cached by decoding).

    The attention itself is the kernel the model was loaded with, the transformers way
    (``config._attn_implementation``: ``sdpa`` by default, ``eager``, or one registered with
    transformers' ``AttentionInterface``), over a dense boolean mask (None: every key visible); a
    flex-attention ``BlockMask`` (training-sized batches of blocks on a GPU, see :func:`flex_block_mask`)
    goes to flex attention."""

    is_causal = False  # block drafters attend bidirectionally within a block, or by the mask they are given

    def __init__(self, cfg, in_dim: int):
        super().__init__()
        self.config = cfg
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_key_value_groups = self.heads // self.kv_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(in_dim, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        # Qwen3-style per-head RMSNorm on queries and keys (before RoPE); vLLM's DFlash layers have it
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if getattr(cfg, "qk_norm", False) else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if getattr(cfg, "qk_norm", False) else None
        self.rotary = RotaryEmbedding(llama_view(cfg))
        self.qkv_proj: nn.Linear | None = None  # decoding's one product for q, k and v (fuse_projections)
        self.qk_norm_weight: torch.Tensor | None = None  # [heads + kv_heads, D]: q_norm's weight, then k_norm's

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, table: bool = False) -> torch.Tensor:
        """``x`` [B, heads, L, D] rotated to ``positions`` [B, L]; ``table``: cos/sin read from
        :meth:`rope_table` (decoding) instead of computed for these positions."""
        cos, sin = self.rope_table(positions, x.dtype) if table and self.static_rope else self.rotary(x, positions)
        return x * cos[:, None] + rotate_half(x) * sin[:, None]

    @property
    def static_rope(self) -> bool:
        """Whether cos/sin depend on the position alone; dynamic NTK and LongRoPE rescale with the length seen."""
        kind = self.rotary.rope_type
        return "dynamic" not in kind and kind != "longrope"

    def rope_table(self, positions: torch.Tensor, dtype: torch.dtype, end: int | None = None,
                   signed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, L, D] at ``positions`` [B, L] (all below ``end`` when the caller knows it), read
        from a table the rotary embedding computed once (the same values: each entry is one product
        ``position * inv_freq``), grown by doubling. Decoding rotates a few positions a call, where
        computing them costs more than the rotation. ``signed``: sin with its first half negated, so that
        ``rotate_half(x) * sin == x.roll(D / 2, -1) * signed_sin`` (:meth:`rotate`)."""
        need = int(positions.max()) + 1 if end is None else end
        table = getattr(self, "_rope_cache", None)
        if table is None or table[0].shape[0] < need or table[0].device != positions.device:
            size = max(2 * need, 256)
            probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
            cos, sin = self.rotary(probe, torch.arange(size, device=positions.device)[None])
            half = sin.shape[-1] // 2
            table = self._rope_cache = (cos[0], sin[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1))
        return table[0][positions].to(dtype), table[2 if signed else 1][positions].to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """RoPE ``x * cos + rotate_half(x) * sin`` in three operations: ``rotate_half(x) = [-x2, x1]`` is
        ``x.roll(D / 2)`` = ``[x2, x1]`` with the sign moved into ``signed_sin`` (:meth:`rope_table`)."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)

    def project_kv(self, kv_in: torch.Tensor, kv_pos: torch.Tensor, lean: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [B, kv_heads, L, D] of ``kv_in`` [B, L, in] at ``kv_pos``;
        ``lean`` (decoding): the same values by fewer operations (:func:`rms`, :meth:`rope_table`)."""
        B, L, _ = kv_in.shape
        k = self.k_proj(kv_in).view(B, L, self.kv_heads, self.head_dim)
        k = rms(self.k_norm, k, lean).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        return self._rope(k, kv_pos, table=lean), v

    def fuse_projections(self) -> None:
        """Give decoding one product for queries, keys and values: ``qkv_proj`` holds ``[W_q; W_k; W_v]``,
        a copy (training and batched drafting read the separate Linears; call again after they change)."""
        self.qkv_proj = fused_linear(self.q_proj, self.k_proj, self.v_proj)
        if self.q_norm is not None and self.q_norm.variance_epsilon == self.k_norm.variance_epsilon:
            self.qk_norm_weight = torch.cat([self.q_norm.weight.detach().expand(self.heads, -1),
                                             self.k_norm.weight.detach().expand(self.kv_heads, -1)])

    def project_qkv(self, x: torch.Tensor, pos: torch.Tensor, queries: int, end: int | None = None) -> tuple[torch.Tensor, ...]:
        """Decoding through ``qkv_proj``: queries [B, heads, queries, D] of the last ``queries`` rows of
        ``x`` [B, L, in] and keys and values [B, kv_heads, L, D] of all of them, at ``pos`` [B, L] (below
        ``end``): what :meth:`project_kv` and :meth:`attend` compute, from one product, one norm and
        one rotation for queries and keys together."""
        B, L, _ = x.shape
        H, D = self.heads, self.head_dim
        k_end = (H + self.kv_heads) * D
        qkv = self.qkv_proj(x)
        qk = qkv[..., :k_end].view(B, L, H + self.kv_heads, D)  # queries of every row (the context's: unused)
        if self.q_norm is not None:  # both norms in one: normalised, then each head scaled by its norm's weight
            if self.qk_norm_weight is None or qk.dtype != torch.float32:  # (transformers' norm computes in fp32)
                qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
            else:
                qk = F.rms_norm(qk, (D,), None, self.q_norm.variance_epsilon) * self.qk_norm_weight
        if self.static_rope:
            cos, sin = self.rope_table(pos, x.dtype, end=end, signed=True)
            qk = self.rotate(qk, cos[:, :, None], sin[:, :, None])  # [B, L, 1, D]: every head
        else:
            cos, sin = self.rotary(x, pos)
            qk = qk * cos[:, :, None] + rotate_half(qk) * sin[:, :, None]
        v = qkv[..., k_end:].view(B, L, self.kv_heads, D).transpose(1, 2)
        return qk[:, L - queries:, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v

    def attend(self, q_in: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | BlockMask | None, lean: bool = False) -> torch.Tensor:
        """Attention of ``q_in`` [B, Q, in] at ``q_pos`` over keys/values [B, kv_heads, S, D], through
        ``o_proj``. ``lean`` (decoding): :func:`rms`, :meth:`rope_table` and, with SDPA, the kernel called
        directly (the same math as transformers' wrapper, without its per-call work)."""
        B, Q, _ = q_in.shape
        q = self.q_proj(q_in).view(B, Q, self.heads, self.head_dim)
        return self.attend_queries(self._rope(rms(self.q_norm, q, lean).transpose(1, 2), q_pos, lean), k, v, mask, lean)

    def attend_queries(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None,
                       lean: bool = False) -> torch.Tensor:
        """:meth:`attend` from queries already projected, normed and rotated, [B, heads, Q, D]. The kernel,
        whichever it is, gets queries, keys and values of one dtype (:func:`same_dtype`)."""
        B, Q = q.shape[0], q.shape[2]
        q, k, v = same_dtype(q, k, v)
        impl = self.config._attn_implementation or "sdpa"
        if isinstance(mask, BlockMask):
            out = _flex_attention(q.device.type)(q, k, v, block_mask=mask, enable_gqa=self.heads != self.kv_heads).transpose(1, 2)
        elif lean and impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads).transpose(1, 2)
        else:
            if impl == "eager" and mask is not None and mask.dtype == torch.bool:  # eager adds its mask to the scores
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
            attention = eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
            scaling = None if impl == "sdpa" else self.scaling  # SDPA's own default scale: the same, computed by it
            out, _ = attention(self, q, k, v, mask, dropout=0.0, scaling=scaling, is_causal=False)
        return self.o_proj(out.reshape(B, Q, -1))


def llama_view(cfg) -> LlamaConfig:
    """The drafter's shape as a ``LlamaConfig``: what transformers' rotary embedding and MLP read."""
    return LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, hidden_act=cfg.hidden_act,
                       mlp_bias=False, num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                       rope_parameters=dict(cfg.rope_parameters))


def fused_linear(*linears: nn.Linear) -> nn.Linear:
    """One bias-free Linear whose output is the given Linears' outputs side by side (their weights stacked,
    copied): decoding's fused projections, one product where there were several over the same input."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


@functools.lru_cache(maxsize=None)
def _flex_attention(device_type: str):
    """flex_attention compiled (its fused kernel) on a GPU; eager elsewhere (the reference math: what the
    tests compare against SDPA with the dense mask)."""
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)
    import warnings

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return flex_attention(*args, **kwargs)
    return eager


def MLP(cfg) -> LlamaMLP:  # noqa: N802  (a builder named like the class it builds)
    """transformers' gated MLP (``down(act(gate(x)) * up(x))``) with the drafter's sizes and activation."""
    return LlamaMLP(llama_view(cfg))


class InjectedLayer(nn.Module):
    """Pre-norm decoder layer whose keys/values are ``[context features ; own normalised input]``."""

    def __init__(self, cfg):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DraftAttention(cfg, cfg.hidden_size)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.gate_up_proj: nn.Linear | None = None  # decoding's one product for gate and up (fuse_projections)

    def fuse_projections(self) -> None:
        """Decoding's fused products (a copy of the weights): ``[W_q; W_k; W_v]`` and ``[W_gate; W_up]``."""
        self.attn.fuse_projections()
        self.gate_up_proj = fused_linear(self.mlp.gate_proj, self.mlp.up_proj)

    def forward(self, x, x_pos, ctx_kv: tuple[torch.Tensor, torch.Tensor], mask):
        """``ctx_kv``: this layer's keys and values of the context features (``attn.project_kv(ctx, pos)``),
        computed once per context position; decoding caches them."""
        h = self.input_norm(x)
        k, v = self.attn.project_kv(h, x_pos)
        return self._attend_and_mlp(x, h, x_pos, torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2), mask)

    def decode(self, x, kv_pos, keys: torch.Tensor, values: torch.Tensor, length: int, mask, ctx=None,
               slots: torch.Tensor | None = None):
        """:meth:`forward` for one block after a cached context of ``length`` positions, without
        copying the context: ``keys`` / ``values`` are :class:`ContextCache` buffers. ``ctx`` (the
        projected features of the positions between the cache and the block, or None) is projected to
        keys and values together with the block, one matrix product for both; their entries are
        written after the context, the block's last (scratch space, overwritten by the next call).
        ``kv_pos``: the positions of ``[ctx ; block]``.

        ``slots`` (static shapes, :meth:`BlockDrafter.decode_static`): the buffer entries ``[ctx ; block]``
        go to instead, and attention reads the whole buffers (``mask`` hides what it must not see)."""
        h = rms(self.input_norm, x)
        kv_in = h if ctx is None else torch.cat([ctx, h], dim=1)
        end = length + kv_in.shape[1]
        seen = end if slots is None else keys.shape[2]
        if self.gate_up_proj is None:
            k, v = self.attn.project_kv(kv_in, kv_pos, lean=True)
            _store(keys, values, k, v, length, end, slots)
            return self._attend_and_mlp(x, h, kv_pos[:, -x.shape[1]:], keys[:, :, :seen], values[:, :, :seen], mask, lean=True)
        # fused (fuse_projections): queries, keys and values in one product, the MLP's two inputs in another
        q, k, v = self.attn.project_qkv(kv_in, kv_pos, x.shape[1], end=seen)
        _store(keys, values, k, v, length, end, slots)
        x = x + self.attn.attend_queries(q, keys[:, :, :seen], values[:, :, :seen], mask, lean=True)
        gate, up = self.gate_up_proj(rms(self.post_norm, x)).chunk(2, dim=-1)
        return x + self.mlp.down_proj(self.mlp.act_fn(gate) * up)

    def _attend_and_mlp(self, x, h, x_pos, keys, values, mask, lean: bool = False):
        x = x + self.attn.attend(h, x_pos, keys, values, mask, lean)
        return x + self.mlp(rms(self.post_norm, x, lean))


def _store(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, end: int,
           slots: torch.Tensor | None) -> None:
    """Write keys and values [B, heads, L, D] into cache buffers [B, heads, S, D]: after the context
    (``length:end``), or row by row to ``slots`` [B, L]."""
    if slots is None:
        keys[:, :, length:end], values[:, :, length:end] = k, v
        return
    batch = torch.arange(slots.shape[0], device=slots.device)[:, None]
    keys[batch, :, slots], values[batch, :, slots] = k.transpose(1, 2), v.transpose(1, 2)


class ContextCache:
    """Decode-time keys and values of the verified context, per drafter layer, in buffers that grow by
    doubling: appending the newly verified positions writes in place instead of re-copying the whole
    context every step, and one block's own entries fit after the context (``spare`` positions).
    ``capacity``: the buffers' length from the start, for a compiled draft whose graph is built for one
    length (:mod:`serve_eval.compiled`); past it they grow by doubling all the same."""

    def __init__(self, spare: int, capacity: int = 0):
        self.spare = spare
        self.capacity = capacity  # buffers of exactly this many positions while the context fits them
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add per-layer ``(keys, values)`` [B, heads, n, head_dim] of the next ``n`` positions."""
        self.length = self.write(kv)

    def write(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Write per-layer ``(keys, values)`` of ``n`` positions after the context without counting them
        (entries that attention reads once and the next write overwrites: a draft's own, or positions a
        caller counts itself); returns the end, ``length + n``."""
        end = self.length + kv[0][0].shape[2]
        self.ensure(end + self.spare, kv[0][0], len(kv))
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][:, :, self.length:end] = k
            self.values[layer][:, :, self.length:end] = v
        return end

    def check_anchor(self, anchor_pos: int, arriving: torch.Tensor | None) -> None:
        """A block anchored at ``anchor_pos`` must follow the cached positions and the ``arriving``
        features [B, n, F] (or None) directly: a ValueError otherwise."""
        n = 0 if arriving is None else arriving.shape[1]
        if self.length + n != anchor_pos:
            raise ValueError(f"the context cache holds {self.length} positions and {n} arrive, the block is anchored at {anchor_pos}")

    def ensure(self, end: int, like: torch.Tensor, layers: int) -> None:
        """Buffers for ``layers`` layers with room for ``end`` positions, shaped and typed like ``like``
        [B, heads, *, head_dim] (grown by doubling; the context's entries move along). Zeros where nothing
        was written: :meth:`BlockDrafter.decode_static` attends over whole buffers, the unwritten entries
        masked, and a masked NaN would still reach the output (0 * NaN)."""
        if not self.keys or end > self.keys[0].shape[2]:
            shape = (like.shape[0], like.shape[1], self.capacity if end <= self.capacity else max(2 * end, 64), like.shape[3])
            self.keys = [self._grown(old, shape, like) for old in self.keys or [None] * layers]
            self.values = [self._grown(old, shape, like) for old in self.values or [None] * layers]

    def _grown(self, old: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        new = like.new_zeros(shape)
        if old is not None:
            new[:, :, :self.length] = old[:, :, :self.length]
        return new


# --------------------------------------------------------------------------------------------------
# Shared config and model base
# --------------------------------------------------------------------------------------------------


class DrafterConfig(PretrainedConfig):
    """Fields every drafter records: its shape, the target it serves, how it reads the target, its loss."""

    default_loss_terms = {"ce": 1.0}
    #: what a builder must know of a kind without knowing its insides: the recipe keys (``drafter:``
    #: section) its config takes beside the common ones, how many target layers it reads (None: the
    #: recipe says), and whether it needs the tokenizer's mask token (block drafters fill blocks with it)
    recipe_keys: tuple[str, ...] = ()
    fixed_target_layers: int | None = None
    needs_mask_token = True

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 256,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int = 512,
        rms_norm_eps: float = 1e-6,
        rope_theta: float | None = None,
        rope_parameters: dict | None = None,
        max_position_embeddings: int = 32768,
        hidden_act: str = "silu",
        target_hidden_size: int | None = None,
        target_layer_ids: list[int] | None = None,
        layer_id_convention: str = LAYER_ID_CONVENTION,
        target_name_or_path: str | None = None,
        mask_token_id: int | None = None,
        block_size: int = 8,
        block_attention: str = "bidirectional",
        num_anchors: int = 16,
        initializer_range: float = 0.02,
        qk_norm: bool = False,
        loss_terms: dict[str, float] | None = None,
        position_weighting: str = "exp",
        loss_gamma: float = 4.0,
        loss_chunk: int | None = None,
        mask_implementation: str = "auto",
        draft_vocab_size: int | None = None,
        **kwargs,
    ):
        if block_attention not in ("bidirectional", "causal"):
            raise ValueError(f"block_attention must be 'bidirectional' or 'causal', got {block_attention!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        # transformers' RoPE settings (type, theta, scaling); configs saved before they were recorded carry
        # only rope_theta, which is the default RoPE at that theta
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": rope_theta or 10000.0})
        self.rope_theta = self.rope_parameters["rope_theta"]
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.target_hidden_size = target_hidden_size or hidden_size
        self.target_layer_ids = list(target_layer_ids or [])
        self.layer_id_convention = layer_id_convention
        self.target_name_or_path = target_name_or_path
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        self.block_attention = block_attention
        self.num_anchors = num_anchors
        self.initializer_range = initializer_range
        self.qk_norm = qk_norm
        # the training loss (:mod:`drafters.losses`): term -> weight, and how block positions are weighted
        self.loss_terms = dict(loss_terms if loss_terms is not None else self.default_loss_terms)
        self.position_weighting = position_weighting
        self.loss_gamma = loss_gamma
        self.loss_chunk = loss_chunk  # positions whose vocabulary-sized logits the loss holds at once (None: all)
        if mask_implementation not in ("auto", "dense", "flex"):
            raise ValueError(f"mask_implementation must be 'auto', 'dense' or 'flex', got {mask_implementation!r}")
        self.mask_implementation = mask_implementation  # the blocks' mask: auto = flex for > 128 block queries on CUDA
        self.draft_vocab_size = draft_vocab_size  # drafts only from these many target tokens (drafters.vocab); None: all
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


@dataclass
class DrafterOutput(ModelOutput):
    """``loss`` for training; per drafted position [B, N, K-1] (EAGLE-3: [B, chains, steps]), as
    decoding would draft them: ``draft_tokens`` (the drafter's argmax), ``target_tokens`` (the
    target's), ``accept`` (``alpha = 1 - TV``), ``scored`` (the label is scored: ``loss_mask``);
    ``draft_logits`` / ``target_logits`` [..., V] unless the loss ran in chunks (``config.loss_chunk``);
    ``logs`` extra scalars."""

    loss: torch.Tensor | None = None
    draft_tokens: torch.Tensor | None = None
    target_tokens: torch.Tensor | None = None
    accept: torch.Tensor | None = None
    draft_logits: torch.Tensor | None = None
    target_logits: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    scored: torch.Tensor | None = None
    logs: dict | None = None


#: the weights a drafter shares with its target; a shipped drafter leaves them out (:func:`save_without_target_io`)
TARGET_IO = ("embed_tokens.weight", "lm_head.weight")


class DrafterBase(PreTrainedModel):
    """Frozen target embeddings and LM head, weight init, and copying them in from a target."""

    base_model_prefix = "drafter"
    supports_gradient_checkpointing = False
    _no_split_modules = ["InjectedLayer"]
    _keys_to_ignore_on_load_missing = [r"^embed_tokens\.weight$", r"^lm_head\.weight$"]  # shipped without them
    _supports_sdpa = True  # config._attn_implementation: sdpa by default, eager on request (see DraftAttention)
    _supports_flex_attn = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, LlamaRotaryEmbedding):  # its inverse frequencies, recomputed (a buffer not saved)
            super()._init_weights(module)

    def _make_target_io(self, cfg) -> None:
        # the target's raw table: a target that scales its embeddings (Gemma, by sqrt(hidden)) does so in its
        # own forward in vLLM and SGLang, whose drafters read the shared table unscaled, as this one does
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "draft_vocab_size", None):  # a saved draft vocabulary (drafters.vocab): its ids load into this
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size))
        self.freeze_target_io()

    def target_features(self, aux: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's features ``aux`` and last hidden states ``last`` in the dtypes of the weights that
        read them (``fc``'s, the LM head's), where they differ and autocast is off: a bf16 target's features
        feed an fp32 drafter (``target.dtype: bfloat16``, ``mixed_precision: no``), an fp32 target's (or a
        feature cache's, which batches read in fp32) feed a drafter cast whole to bf16 (DeepSpeed's ``bf16``).
        Under autocast they pass as they are (autocast casts a Linear's inputs itself); tensors already in
        their weights' dtype are returned as they are."""
        return _as_input_of(aux, self.fc.weight), _as_input_of(last, self.lm_head.weight)

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits over the whole vocabulary from its last hidden state (the frozen head is
        the target's; a draft vocabulary restricts only what the drafter proposes)."""
        return F.linear(hidden, self.lm_head.weight)

    def draft_vocab_ids(self) -> torch.Tensor | None:
        """The draft vocabulary's target ids, or None for the whole vocabulary."""
        return self.draft_vocab if getattr(self.config, "draft_vocab_size", None) else None

    def _restrict_to_draft_vocab(self) -> "DrafterBase":
        """Re-restrict the heads to the saved draft vocabulary (if any) after their weights changed."""
        if getattr(self.config, "draft_vocab_size", None):
            restrict_vocab(self, self.draft_vocab)
        return self

    def freeze_target_io(self) -> None:
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        model = super().from_pretrained(*args, **kwargs)
        model.freeze_target_io()  # loading builds fresh Parameters, which would be trainable
        return model._restrict_to_draft_vocab()

    def _target_io(self, target) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's embedding and LM head weights, checked against the drafter's shapes."""
        emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        if emb.shape != self.embed_tokens.weight.shape or head.shape != self.lm_head.weight.shape:
            raise ValueError(f"drafter vocab/hidden {tuple(self.embed_tokens.weight.shape)} does not match the "
                             f"target's embeddings {tuple(emb.shape)}: build the drafter with the target's sizes")
        return emb, head

    @torch.no_grad()
    def load_own_weights(self, folder: str | Path) -> "DrafterBase":
        """This drafter's weights (all but the target's embeddings and head, which stay as they are)
        from a saved drafter folder; every one must be there, with its shape."""
        from safetensors.torch import load_file

        state = {}
        for file in sorted(Path(folder).glob("*.safetensors")):
            state.update(load_file(file))
        state = {k: v for k, v in state.items() if k not in TARGET_IO}
        own = {k: v for k, v in self.state_dict().items() if k not in TARGET_IO}
        wrong = sorted(set(own) ^ set(state)) + [k for k in own if k in state and own[k].shape != state[k].shape]
        if wrong:
            raise ValueError(f"{folder}: its weights do not fit this drafter ({', '.join(wrong[:4])}"
                             f"{' ...' if len(wrong) > 4 else ''} missing, unexpected or of another shape)")
        self.load_state_dict(state, strict=False)
        return self

    @torch.no_grad()
    def copy_target_io(self, target) -> "DrafterBase":
        """Copy (and keep frozen) the target's token embeddings and LM head."""
        emb, head = self._target_io(target)
        self.embed_tokens.weight.copy_(emb)
        self.lm_head.weight.copy_(head)
        return self._restrict_to_draft_vocab()

    def share_target_io(self, target) -> "DrafterBase":
        """Use the target's own embedding and LM head tensors (no copy), as serving engines do: the
        drafter reads the very bytes the target's head just read, still in cache, and holds no second
        copy. Falls back to :meth:`copy_target_io` when dtype or device differ."""
        emb, head = self._target_io(target)
        mine = self.embed_tokens.weight
        if any((w.dtype, w.device) != (mine.dtype, mine.device) for w in (emb, head)):
            return self.copy_target_io(target)
        self.embed_tokens.weight, self.lm_head.weight = emb, head  # the target's Parameters, left as they are
        return self._restrict_to_draft_vocab()


def _as_input_of(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` in ``weight``'s dtype where they differ and autocast is off for ``x``'s device; else ``x``."""
    if x.dtype == weight.dtype or torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(weight.dtype)


def own_target_io(drafter):
    """Give a drafter that shares its target's embeddings and head (:meth:`DrafterBase.share_target_io`)
    copies of its own: saving needs them when the target ties the two (one tensor under two names,
    which ``save_pretrained`` refuses). Returns the drafter."""
    for module in (drafter.embed_tokens, drafter.lm_head):
        module.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=False)
    return drafter._restrict_to_draft_vocab()


def save_without_target_io(drafter, folder, dtype: torch.dtype = torch.float16) -> None:
    """``save_pretrained`` of the drafter's own weights in ``dtype``: the target's embeddings and LM head
    are left out (:func:`load_drafter` copies them from the target, as serving engines do)."""
    state = {k: v.to(dtype) for k, v in drafter.state_dict().items() if k not in TARGET_IO}
    drafter.save_pretrained(folder, state_dict=state)


def shares_target_io(folder) -> bool:
    """Whether the drafter folder left the target's embeddings and LM head out (they load from the target)."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    keys = set()
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            keys.update(h.keys())
    return bool(files) and not any(k in keys for k in TARGET_IO)


class BlockDrafter(DrafterBase):
    """The parallel block backbone: ``fc`` + ``hidden_norm`` over target features, KV-injected layers.

    Subclasses (DFlash, DSpark) add their heads and losses on top of :meth:`block_hidden`.
    ``conditional_drafts``: whether a draft's distribution depends on the drafts before it in the
    block (DSpark's Markov head) or only on the anchor and the context (DFlash).
    """

    conditional_drafts = False

    def __init__(self, config):
        super().__init__(config)
        n_feat = len(config.target_layer_ids) * config.target_hidden_size
        if n_feat == 0:
            raise ValueError("a block drafter needs target_layer_ids")
        self.fc = nn.Linear(n_feat, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(InjectedLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._make_target_io(config)
        self.build_heads(config)
        self.post_init()

    def build_heads(self, config) -> None:
        """Subclasses add their own modules here, before weights are initialised."""

    def fuse_projections(self) -> "BlockDrafter":
        """Serve :meth:`decode_hidden` from fused products (:meth:`InjectedLayer.fuse_projections`): per
        layer one for queries, keys and values and one for the MLP's gate and up, three fewer calls a
        layer. Copies of the weights, made once for serving; returns the drafter."""
        for layer in self.layers:
            layer.fuse_projections()
        return self

    @property
    def causal_blocks(self) -> bool:
        return self.config.block_attention == "causal"

    def block_hidden(self, aux: torch.Tensor, anchor_tokens: torch.Tensor, anchors: torch.Tensor,
                     ctx_kv: list | None = None) -> torch.Tensor:
        """Hidden states [B, N, K, H] of the blocks anchored at ``anchors`` [B, N].

        ``aux`` [B, C, F] holds target features for positions ``0..C-1`` (or pass their per-layer
        ``ctx_kv`` from :meth:`context_kv`, as decoding does, with ``aux`` None and C = its length);
        block ``n`` sees those before ``anchors[:, n]`` only. ``anchor_tokens`` [B, N] are the clean
        tokens at the anchors.
        """
        cfg = self.config
        B, N = anchors.shape
        K = cfg.block_size
        tokens = torch.full((B, N, K), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
        tokens[:, :, 0] = anchor_tokens
        x = self.embed_tokens(tokens).view(B, N * K, -1)
        x_pos = (anchors[:, :, None] + torch.arange(K, device=anchors.device)).view(B, N * K)
        if ctx_kv is None:
            ctx_kv = self.context_kv(aux, torch.arange(aux.shape[1], device=aux.device)[None].expand(B, -1))
        ctx_len = ctx_kv[0][0].shape[2]
        impl = getattr(cfg, "mask_implementation", "auto")
        # auto: flex for training-sized batches of blocks on a GPU; decoding's few blocks keep the dense mask
        if impl == "flex" or (impl == "auto" and anchors.device.type == "cuda" and N * K > 128):
            mask = flex_block_mask(anchors, ctx_len, K, self.causal_blocks)
        else:
            mask = block_attention_mask(anchors, ctx_len, K, self.causal_blocks)
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, x_pos, kv, mask)
        return self.norm(x).view(B, N, K, -1)

    def decode_hidden(self, anchor_token: torch.Tensor, anchor_pos: int, cache: ContextCache,
                      features: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`block_hidden` [1, 1, K, H] of one block at ``anchor_pos`` whose context (every position
        before it) is in ``cache``, followed by ``features`` [1, n, F] of the positions the cache does not
        hold yet, which this call adds to it (each layer projects them and the block in one product):
        the decoding fast path, with no mask for bidirectional blocks (the whole context is visible)
        and no copy of the context's keys and values."""
        cfg = self.config
        K = cfg.block_size
        start = cache.length
        cache.check_anchor(anchor_pos, features)
        device = anchor_token.device
        tokens = torch.full((1, K), cfg.mask_token_id, dtype=torch.long, device=device)
        tokens[0, 0] = anchor_token
        x = self.embed_tokens(tokens)
        kv_pos = torch.arange(start, anchor_pos + K, device=device)[None]
        ctx = None if features is None else rms(self.hidden_norm, self.fc(features))
        mask = None
        if self.causal_blocks:  # every context key, and block keys up to the query's own position
            mask = torch.ones(K, anchor_pos + K, dtype=torch.bool, device=device)
            mask[:, anchor_pos:] = torch.ones(K, K, dtype=torch.bool, device=device).tril()
        cache.ensure(anchor_pos + K, x.new_empty(1, cfg.num_key_value_heads, 0, cfg.head_dim), len(self.layers))
        for layer, keys, values in zip(self.layers, cache.keys, cache.values):
            x = layer.decode(x, kv_pos, keys, values, start, mask, ctx)
        cache.length = anchor_pos
        return rms(self.norm, x).view(1, 1, K, -1)

    def decode_static(self, anchor_tokens: torch.Tensor, counts: torch.Tensor, features: torch.Tensor,
                      keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`decode_hidden` in shapes that do not change from call to call, for a compiled graph
        (:mod:`serve_eval.compiled`), for ``R`` rows at once (a batch's, or one): each row's block
        hidden states, [R, 1, K, H], as :meth:`decode_hidden` gives them for that row alone.

        ``anchor_tokens`` [R]; ``counts`` [R, 2] = ``[start, n]`` per row (a tensor, so that the graph
        does not specialise on them): row ``r``'s cache holds ``start`` positions and ``n`` more arrive,
        ``0 <= n <= K``, in the first ``n`` rows of ``features[r]`` [K, F] (the rest padding).
        ``keys`` / ``values``: the cache's buffers, each [R, kv_heads, S, D] with ``S > start + n + K``,
        zero where nothing was written. Per layer and row:

        * the rows ``[features ; block]`` are projected together, 2K of them, and written to slots
          ``start + i`` (feature ``i < n``), the last slot ``S - 1`` (padding: never a position, never
          visible) and ``a + k`` (block row ``k``, anchor ``a = start + n``);
        * the block's queries attend over the whole buffer, masked to the slots below ``a + K``
          (bidirectional blocks) or below ``a + k + 1`` (causal ones): what :meth:`decode_hidden`'s
          slices select, so the keys a query sees and their values are the same.

        A padding entry changes no other (each entry's products and norms are its own); the caller advances
        each row's cache length to its ``a``."""
        cfg = self.config
        K = cfg.block_size
        S = keys[0].shape[2]
        rows = torch.arange(K, device=features.device)
        start, n = counts[:, :1], counts[:, 1:]
        anchor_pos = start + n  # [R, 1]
        x = self.embed_tokens(torch.where(rows == 0, anchor_tokens[:, None], cfg.mask_token_id))
        ctx = rms(self.hidden_norm, self.fc(features))
        kv_pos = torch.cat([start + rows, anchor_pos + rows], dim=1)  # [R, 2K]
        slots = torch.cat([torch.where(rows < n, start + rows, S - 1), anchor_pos + rows], dim=1)
        last = anchor_pos + 1 + rows if self.causal_blocks else (anchor_pos + K).expand(-1, K)
        mask = torch.arange(S, device=features.device) < last[:, None, :, None]  # [R, 1, K, S]: query k sees slots below last
        for layer, k, v in zip(self.layers, keys, values):
            x = layer.decode(x, kv_pos, k, v, 0, mask, ctx, slots=slots)
        return rms(self.norm, x).view(features.shape[0], 1, K, -1)

    def propose(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, choose=None):
        """Decode-time drafts for block positions 1..K-1 from :meth:`block_hidden`: (tokens [B, N, K-1],
        logits [B, N, K-1, V], confidence or None). ``choose(logits) -> tokens`` picks each draft
        (argmax by default, or a sampler's draw). The base (DFlash) drafts all positions in parallel."""
        logits = self.lm_head(hidden)[:, :, 1:]  # all K rows: MKL multiplies 8 rows faster than 7
        return (choose or argmax_choice)(logits), logits, None

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor, lean: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, keys and values of target features ``aux`` [B, C, F] at ``positions`` [B, C];
        ``lean``: decoding's path (:meth:`DraftAttention.project_kv`), the same values."""
        ctx = rms(self.hidden_norm, self.fc(aux), lean)
        return [layer.attn.project_kv(ctx, positions, lean) for layer in self.layers]

    def anchors_for(self, input_ids: torch.Tensor, anchors: torch.Tensor | None, loss_mask: torch.Tensor | None) -> torch.Tensor:
        """The given anchors, or ``num_anchors`` random ones per sequence where labels are scored."""
        if anchors is not None:
            return anchors
        cfg = self.config
        return sample_anchors(input_ids.shape[1], cfg.block_size, cfg.num_anchors, input_ids.shape[0],
                              input_ids.device, loss_mask=loss_mask)

    def block_scores(self, draft_fn, draft_in: tuple, targets: tuple) -> BlockScores:
        """The configured loss over the blocks (:func:`drafters.losses.block_scores`, in chunks of
        ``config.loss_chunk`` positions): ``draft_fn(*draft_in)`` gives the drafter's logits, ``targets``
        is :meth:`block_targets`."""
        cfg = self.config
        labels, target_hidden, scored = targets
        return block_scores(cfg.loss_terms, cfg.position_weighting, cfg.loss_gamma, draft_fn, self.target_logits, draft_in,
                            target_hidden, labels, scored, getattr(cfg, "loss_chunk", None), self.draft_vocab_ids())

    def block_targets(self, input_ids: torch.Tensor, last: torch.Tensor, anchors: torch.Tensor,
                      loss_mask: torch.Tensor | None = None):
        """For block positions ``k = 1..K-1``: labels ``x[a+k]`` [B, N, K-1], the target's last hidden
        state that predicts them [B, N, K-1, H] (its LM head gives the target's logits), and which of
        them are scored [B, N, K-1] (all, without a loss mask)."""
        pos = anchors[:, :, None] + torch.arange(1, self.config.block_size, device=anchors.device)
        labels = gather_positions(input_ids, pos)
        scored = torch.ones_like(labels, dtype=torch.bool) if loss_mask is None else gather_positions(loss_mask, pos).bool()
        return labels, gather_positions(last, pos - 1), scored


def argmax_choice(logits: torch.Tensor) -> torch.Tensor:
    """The default way a drafter picks a draft token: greedy."""
    return logits.argmax(-1)


# --------------------------------------------------------------------------------------------------
# Blocks, masks and acceptance
# --------------------------------------------------------------------------------------------------


def sample_anchors(seq_len: int, block_size: int, count: int, batch: int, device=None,
                   generator: torch.Generator | None = None, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
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
        scores = scores + loss_mask[:, 2:hi + 2].to(scores.device, scores.dtype)
    anchors = scores.topk(count, dim=1).indices + 1
    return anchors.sort(dim=1).values.to(device)


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, causal: bool) -> torch.Tensor:
    """Boolean mask [B, 1, N*K, ctx_len + N*K]: True where a block query may attend (see module doc)."""
    B, N = anchors.shape
    K = block_size
    dev = anchors.device
    ctx_visible = torch.arange(ctx_len, device=dev)[None, None, :] < anchors[:, :, None]  # [B, N, T]
    ctx_visible = ctx_visible[:, :, None, :].expand(B, N, K, ctx_len).reshape(B, N * K, ctx_len)
    blk = torch.arange(N * K, device=dev)
    same_block = (blk[:, None] // K) == (blk[None, :] // K)
    if causal:
        same_block &= (blk[None, :] % K) <= (blk[:, None] % K)
    mask = torch.cat([ctx_visible, same_block[None].expand(B, -1, -1)], dim=-1)
    return mask[:, None]


def flex_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, causal: bool) -> BlockMask:
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
        return ((kv < ctx_len) & (kv < anchors[b, n])) | same

    return create_block_mask(visible, B, None, N * K, ctx_len + N * K, device=anchors.device)


def gather_positions(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x`` [B, T, ...] gathered at ``positions`` [B, *] -> [B, *, ...]."""
    B = x.shape[0]
    flat = positions.reshape(B, -1)
    idx = flat.view(B, -1, *([1] * (x.dim() - 2))).expand(B, flat.shape[1], *x.shape[2:])
    return x.gather(1, idx).view(*positions.shape, *x.shape[2:])


def acceptance_stats(draft_tokens: torch.Tensor, target_tokens: torch.Tensor, accept: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums for greedy and probabilistic acceptance over chains [M, K] (positions 1..K of each draft:
    both argmaxes and alpha, as :class:`DrafterOutput` holds them).

    Returns sums (not means) so callers can add them across batches and processes:
    ``chains``, ``greedy_prefix[k]`` = number of chains whose first k+1 drafts all match the target's
    argmax, ``prob_prefix[k]`` = sum of prod_{j<=k} (1 - TV_j), ``match[k]`` = per-position matches.
    """
    match = (draft_tokens == target_tokens).float()
    return {
        "chains": torch.tensor(float(match.shape[0]), device=match.device),
        "greedy_prefix": match.cumprod(-1).sum(0),
        "prob_prefix": accept.float().cumprod(-1).sum(0),
        "match": match.sum(0),
    }


def accepted_lengths(draft_tokens: torch.Tensor, target_tokens: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Greedy drafts kept per chain: the number of leading positions whose draft equals the target's
    argmax (an unscored label ends the chain). [..., S] -> [...] (long)."""
    match = (draft_tokens == target_tokens) & scored.bool()
    return match.long().cumprod(-1).sum(-1)


def decode_walk(accepted: dict[int, int], first: int, last: int) -> tuple[int, int]:
    """``(tokens, target forwards)`` of greedy speculative decoding replayed over a known sequence.

    The sequence is the target's own greedy answer at positions ``first..last``; ``accepted[a]`` is how
    many drafts the block anchored at ``a`` (the bonus token at ``a``) keeps. The prefill emits
    ``x[first]``; each step at anchor ``a`` emits its kept drafts and the target's next token and moves
    to ``a + n + 1``. This is exactly what the decoding loop does at T=0 on this answer (its tau is
    tokens / forwards), so anchors are weighted as serving visits them: hard stretches take many steps,
    easy ones few, which a mean over uniformly drawn blocks does not see."""
    tokens, forwards, a = last - first + 1, 1, first
    while a < last:
        a += min(accepted.get(a, 0), last - a - 1) + 1
        forwards += 1
    return tokens, forwards


def summarize_acceptance(sums: dict[str, torch.Tensor], prefix: str = "val") -> dict[str, float]:
    """tau and per-position conditional acceptance from accumulated :func:`acceptance_stats` sums."""
    n = max(sums["chains"].item(), 1.0)  # no fully scored chain: report tau = 1
    greedy = sums["greedy_prefix"] / n
    prob = sums["prob_prefix"] / n
    prev = torch.cat([torch.ones(1, device=greedy.device), greedy[:-1]])
    cond = torch.where(prev > 0, greedy / prev.clamp_min(1e-12), torch.zeros_like(greedy))
    out = {f"{prefix}_block_tau": 1.0 + greedy.sum().item(), f"{prefix}_tau_probabilistic": 1.0 + prob.sum().item()}
    for k, a in enumerate(cond.tolist(), start=1):
        out[f"{prefix}_acc_{k}"] = a
    return out
