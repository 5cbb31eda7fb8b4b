"""The drafters' layers: attention whose keys and values may come from another input (KV injection),
the pre-norm decoder layer built on it, and the small helpers decoding's fast paths share.

Norms, the MLP and rotary embeddings are transformers' own Llama modules (Qwen3's are the same
classes), so RoPE scaling (``rope_parameters``: YaRN, llama3, ...) and the attention kernels
transformers registers come with them; only the KV injection is the drafter's. Every decoding
variant (``lean``, fused projections, static shapes) computes the same values as the training path
(tested); the layers hold no state between calls but the caches a caller hands them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import LlamaConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

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
        self.scaling = self.head_dim**-0.5
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

    def _rope(
        self, x: torch.Tensor, positions: torch.Tensor, table: bool = False, end: int | None = None
    ) -> torch.Tensor:
        """``x`` [B, heads, L, D] rotated to ``positions`` [B, L] (below ``end`` when the caller knows it);
        ``table``: cos/sin read from :meth:`rope_table` (decoding) instead of computed for these positions."""
        cos, sin = self.rope_table(positions, x.dtype, end) if table and self.static_rope else self.rotary(x, positions)
        return x * cos[:, None] + rotate_half(x) * sin[:, None]

    @property
    def static_rope(self) -> bool:
        """Whether cos/sin depend on the position alone; dynamic NTK and LongRoPE rescale with the length seen."""
        kind = str(self.rotary.rope_type)
        return "dynamic" not in kind and kind != "longrope"

    def rope_table(
        self, positions: torch.Tensor, dtype: torch.dtype, end: int | None = None, signed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
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

    def project_kv(
        self, kv_in: torch.Tensor, kv_pos: torch.Tensor, lean: bool = False, end: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [B, kv_heads, L, D] of ``kv_in`` [B, L, in] at ``kv_pos`` (below
        ``end`` when the caller knows it: no host read of the positions); ``lean`` (decoding): the same
        values by fewer operations (:func:`rms`, :meth:`rope_table`)."""
        B, L, _ = kv_in.shape
        k = self.k_proj(kv_in).view(B, L, self.kv_heads, self.head_dim)
        k = rms(self.k_norm, k, lean).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        return self._rope(k, kv_pos, table=lean, end=end), v

    def fuse_projections(self) -> None:
        """Give decoding one product for queries, keys and values: ``qkv_proj`` holds ``[W_q; W_k; W_v]``,
        a copy (training and batched drafting read the separate Linears; call again after they change)."""
        self.qkv_proj = fused_linear(self.q_proj, self.k_proj, self.v_proj)
        if (
            self.q_norm is not None
            and self.k_norm is not None
            and self.q_norm.variance_epsilon == self.k_norm.variance_epsilon
        ):
            self.qk_norm_weight = torch.cat(
                [
                    self.q_norm.weight.detach().expand(self.heads, -1),
                    self.k_norm.weight.detach().expand(self.kv_heads, -1),
                ]
            )

    def project_qkv(
        self, x: torch.Tensor, pos: torch.Tensor, queries: int, end: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Decoding through ``qkv_proj``: queries [B, heads, queries, D] of the last ``queries`` rows of
        ``x`` [B, L, in] and keys and values [B, kv_heads, L, D] of all of them, at ``pos`` [B, L] (below
        ``end``): what :meth:`project_kv` and :meth:`attend` compute, from one product, one norm and
        one rotation for queries and keys together."""
        B, L, _ = x.shape
        H, D = self.heads, self.head_dim
        k_end = (H + self.kv_heads) * D
        if self.qkv_proj is None:
            raise RuntimeError("project_qkv reads qkv_proj: call fuse_projections() first")
        qkv = self.qkv_proj(x)
        qk = qkv[..., :k_end].view(B, L, H + self.kv_heads, D)  # queries of every row (the context's: unused)
        # both norms in one: normalised, then each head scaled by its norm's weight
        if self.q_norm is not None and self.k_norm is not None:
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
        return qk[:, L - queries :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v

    def attend(
        self,
        q_in: torch.Tensor,
        q_pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | BlockMask | None,
        lean: bool = False,
        end: int | None = None,
    ) -> torch.Tensor:
        """Attention of ``q_in`` [B, Q, in] at ``q_pos`` (below ``end``, when known) over keys/values
        [B, kv_heads, S, D], through ``o_proj``. ``lean`` (decoding): :func:`rms`, :meth:`rope_table` and,
        with SDPA, the kernel called directly (the same math as transformers' wrapper, without its per-call work)."""
        B, Q, _ = q_in.shape
        q = self.q_proj(q_in).view(B, Q, self.heads, self.head_dim)
        q = self._rope(rms(self.q_norm, q, lean).transpose(1, 2), q_pos, lean, end)
        return self.attend_queries(q, k, v, mask, lean)

    def attend_queries(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | BlockMask | None,
        lean: bool = False,
    ) -> torch.Tensor:
        """:meth:`attend` from queries already projected, normed and rotated, [B, heads, Q, D]. The kernel,
        whichever it is, gets queries, keys and values of one dtype (:func:`same_dtype`)."""
        B, Q = q.shape[0], q.shape[2]
        q, k, v = same_dtype(q, k, v)
        impl = self.config._attn_implementation or "sdpa"
        if isinstance(mask, BlockMask):
            out = _flex_attention(q.device.type)(
                q, k, v, block_mask=mask, enable_gqa=self.heads != self.kv_heads
            ).transpose(1, 2)
        elif lean and impl == "sdpa":
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
            ).transpose(1, 2)
        else:
            if impl == "eager" and mask is not None and mask.dtype == torch.bool:  # eager adds its mask to the scores
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                    ~mask, torch.finfo(q.dtype).min
                )
            attention: Callable[..., tuple[torch.Tensor, Any]] = (
                eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
            )
            scaling = None if impl == "sdpa" else self.scaling  # SDPA's own default scale: the same, computed by it
            out, _ = attention(self, q, k, v, mask, dropout=0.0, scaling=scaling, is_causal=False)
        return self.o_proj(out.reshape(B, Q, -1))


def llama_view(cfg) -> LlamaConfig:
    """The drafter's shape as a ``LlamaConfig``: what transformers' rotary embedding and MLP read."""
    return LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        hidden_act=cfg.hidden_act,
        mlp_bias=False,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope_parameters),
    )


def fused_linear(*linears: nn.Linear) -> nn.Linear:
    """One bias-free Linear whose output is the given Linears' outputs side by side (their weights stacked,
    copied): decoding's fused projections, one product where there were several over the same input."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


@functools.cache
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
        return self._attend_and_mlp(
            x, h, x_pos, torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2), mask
        )

    def decode(self, x, kv_pos, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, mask, ctx):
        """:meth:`forward` for a block after a cached context, without copying the context: ``keys`` /
        ``values`` are :class:`~drafters.cache.ContextCache` buffers [R, heads, S, D]. ``ctx`` (the
        projected features of the positions between the cache and the block) is projected to keys and
        values together with the block, one matrix product for both; the entries ``[ctx ; block]`` (at
        positions ``kv_pos``) are written to the buffer ``slots`` [R, 2K] and attention reads the whole
        buffers, ``mask`` hiding what a query must not see (:meth:`BlockDrafter.decode`)."""
        h = rms(self.input_norm, x)
        kv_in = torch.cat([ctx, h], dim=1)
        if self.gate_up_proj is None:
            k, v = self.attn.project_kv(kv_in, kv_pos, lean=True, end=keys.shape[2])
            store_rows(keys, values, k, v, slots)
            return self._attend_and_mlp(
                x, h, kv_pos[:, -x.shape[1] :], keys, values, mask, lean=True, end=keys.shape[2]
            )
        # fused (fuse_projections): queries, keys and values in one product, the MLP's two inputs in another
        q, k, v = self.attn.project_qkv(kv_in, kv_pos, x.shape[1], end=keys.shape[2])
        store_rows(keys, values, k, v, slots)
        x = x + self.attn.attend_queries(q, keys, values, mask, lean=True)
        gate, up = self.gate_up_proj(rms(self.post_norm, x)).chunk(2, dim=-1)
        return x + self.mlp.down_proj(self.mlp.act_fn(gate) * up)

    def _attend_and_mlp(self, x, h, x_pos, keys, values, mask, lean: bool = False, end: int | None = None):
        x = x + self.attn.attend(h, x_pos, keys, values, mask, lean, end)
        return x + self.mlp(rms(self.post_norm, x, lean))


def store_rows(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write keys and values [R, heads, L, D] into cache buffers [R, heads, S, D], row by row to ``slots`` [R, L]."""
    batch = torch.arange(slots.shape[0], device=slots.device)[:, None]
    keys[batch, :, slots], values[batch, :, slots] = k.transpose(1, 2), v.transpose(1, 2)
