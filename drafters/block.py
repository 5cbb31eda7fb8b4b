"""The block-drafter backbone shared by DFlash and DSpark (:class:`BlockDrafter`).

Notation: a sequence ``x[0..T-1]``; target features ``f[t]`` (hidden states of the configured target
layers after the target read ``x[0..t]``, see :mod:`distill.base.features`); block size ``K``.

Blocks
    An *anchor* position ``a`` starts a block ``[x[a], MASK, ..., MASK]`` of ``K`` tokens at positions
    ``a .. a+K-1``. Block position ``k >= 1`` predicts ``x[a+k]``; position 0 (the anchor, the token
    the target just emitted) carries no loss. In decoding the anchor is the target's bonus token, which
    the target has not read yet, so block queries see target features **strictly before** the anchor:
    ``f[j]`` for ``j < a``. Training samples many anchors per sequence at once; each block sees its own
    prefix of features, so one forward trains them all.

Features enter through ``fc`` (concatenated target layers -> hidden) and ``hidden_norm``; in every
drafter layer they are *prepended* to the block's keys and values (KV injection). Token embeddings and
the LM head are the target's, copied in and frozen, so the drafter speaks the target's vocabulary.
The blocks' attention mask is :mod:`drafters.masks`'s; decoding's context cache is
:class:`drafters.cache.ContextCache`; acceptance is measured by :mod:`drafters.metrics`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from .base import DrafterBase, argmax_choice
from .cache import ContextCache
from .layers import InjectedLayer, RMSNorm, rms
from .losses import BlockScores, block_scores
from .masks import block_attention_mask, flex_block_mask, gather_positions, sample_anchors


def layer_attention(cfg) -> list[tuple[bool, int | None]]:
    """Per layer of a block drafter's config, ``(causal, window)``: whether its blocks attend causally,
    and the context window it sees (None: the whole context before the anchor; ``config.layer_types``)."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    sliding_causal = getattr(cfg, "sliding_block_attention", "causal") == "causal"
    full_causal = cfg.block_attention == "causal"
    return [(sliding_causal, cfg.sliding_window) if t == "sliding_attention" else (full_causal, None) for t in types]


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

    def fuse_projections(self) -> BlockDrafter:
        """Serve :meth:`decode` from fused products (:meth:`InjectedLayer.fuse_projections`): per
        layer one for queries, keys and values and one for the MLP's gate and up, three fewer calls a
        layer. Copies of the weights, made once for serving; returns the drafter."""
        for layer in self.layers:
            layer.fuse_projections()
        return self

    @property
    def layer_attention(self) -> list[tuple[bool, int | None]]:
        return layer_attention(self.config)

    def block_hidden(
        self, aux: torch.Tensor, anchor_tokens: torch.Tensor, anchors: torch.Tensor, ctx_kv: list | None = None
    ) -> torch.Tensor:
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
        flex = impl == "flex" or (impl == "auto" and anchors.device.type == "cuda" and N * K > 128)
        make = flex_block_mask if flex else block_attention_mask
        masks: dict[tuple, torch.Tensor | BlockMask] = {}  # one per kind of layer
        for (causal, window), layer, kv in zip(self.layer_attention, self.layers, ctx_kv):
            if (causal, window) not in masks:
                masks[causal, window] = make(anchors, ctx_len, K, causal, window)
            x = layer(x, x_pos, kv, masks[causal, window])
        return self.norm(x).view(B, N, K, -1)

    def decode(
        self, anchor_tokens: torch.Tensor, counts: torch.Tensor, features: torch.Tensor, cache: ContextCache
    ) -> torch.Tensor:
        """The decoding forward: the block after each of ``R`` rows' cached context, [R, 1, K, H], as
        :meth:`block_hidden` gives it for that row alone over its whole context. Its shapes do not change
        from call to call, so it runs eagerly and as one compiled graph alike (:mod:`serve_eval.cpu.compiled`
        compiles this function).

        ``anchor_tokens`` [R]; ``counts`` [R, 2] = ``[start, n]`` per row (a tensor, so that a graph does
        not specialise on them): row ``r``'s ``cache`` holds ``start`` positions and ``n`` more arrive,
        ``0 <= n <= K``, in the first ``n`` rows of ``features[r]`` [K, F] (the rest padding). The cache's
        buffers [R, kv_heads, S, D] must hold ``S > start + n + K`` slots for every row
        (:meth:`ContextCache.ensure`) and be zero where nothing was written. Per layer and row:

        * the rows ``[features ; block]`` are projected together, 2K of them, and written to slots
          ``start + i`` (feature ``i < n``), the last slot ``S - 1`` (padding: never a position, never
          visible) and ``a + k`` (block row ``k``, anchor ``a = start + n``);
        * the block's queries attend over the whole buffer, masked to the slots below ``a + K``
          (bidirectional blocks) or below ``a + k + 1`` (causal ones), and in a layer with a sliding
          window ``W`` to the slots from ``a - W`` on (:attr:`layer_attention`).

        A padding entry changes no other (each entry's products and norms are its own). The cache's
        lengths are the caller's: it advances each row's to its ``a``."""
        cfg = self.config
        K = cfg.block_size
        keys, values = cache.keys, cache.values
        S = keys[0].shape[2]
        rows = torch.arange(K, device=features.device)
        start, n = counts[:, :1], counts[:, 1:]
        anchor_pos = start + n  # [R, 1]
        x = self.embed_tokens(torch.where(rows == 0, anchor_tokens[:, None], cfg.mask_token_id))
        ctx = rms(self.hidden_norm, self.fc(features))
        kv_pos = torch.cat([start + rows, anchor_pos + rows], dim=1)  # [R, 2K]
        slots = torch.cat([torch.where(rows < n, start + rows, S - 1), anchor_pos + rows], dim=1)
        slot = torch.arange(S, device=features.device)
        masks = {}  # one per kind of layer: [R, 1, K, S], query k sees the slots below its last (in its window)
        for causal, window in set(self.layer_attention):
            last = anchor_pos + 1 + rows if causal else (anchor_pos + K).expand(-1, K)
            mask = slot < last[:, None, :, None]
            masks[causal, window] = mask if window is None else mask & (slot >= (anchor_pos - window)[:, None, :, None])
        for kind, layer, k, v in zip(self.layer_attention, self.layers, keys, values):
            x = layer.decode(x, kv_pos, k, v, slots, masks[kind], ctx)
        return rms(self.norm, x).view(features.shape[0], 1, K, -1)

    def propose(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, choose=None):
        """Decode-time drafts for block positions 1..K-1 from :meth:`block_hidden`: (tokens [B, N, K-1],
        logits [B, N, K-1, V], confidence or None). ``choose(logits) -> tokens`` picks each draft
        (argmax by default, or a sampler's draw). The base (DFlash) drafts all positions in parallel."""
        logits = self.lm_head(hidden)[:, :, 1:]  # all K rows: MKL multiplies 8 rows faster than 7
        return (choose or argmax_choice)(logits), logits, None

    def context_kv(
        self, aux: torch.Tensor, positions: torch.Tensor, lean: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, keys and values of target features ``aux`` [B, C, F] at ``positions`` [B, C];
        ``lean``: decoding's path (:meth:`DraftAttention.project_kv`), the same values."""
        ctx = rms(self.hidden_norm, self.fc(aux), lean)
        return [layer.attn.project_kv(ctx, positions, lean) for layer in self.layers]

    def anchors_for(
        self, input_ids: torch.Tensor, anchors: torch.Tensor | None, loss_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The given anchors, or ``num_anchors`` random ones per sequence where labels are scored."""
        if anchors is not None:
            return anchors
        cfg = self.config
        return sample_anchors(
            input_ids.shape[1],
            cfg.block_size,
            cfg.num_anchors,
            input_ids.shape[0],
            input_ids.device,
            loss_mask=loss_mask,
        )

    def block_scores(self, draft_fn, draft_in: tuple, targets: tuple) -> BlockScores:
        """The configured loss over the blocks (:func:`drafters.losses.block_scores`, in chunks of
        ``config.loss_chunk`` positions): ``draft_fn(*draft_in)`` gives the drafter's logits, ``targets``
        is :meth:`block_targets`."""
        cfg = self.config
        labels, target_hidden, scored = targets
        return block_scores(
            cfg.loss_terms,
            cfg.position_weighting,
            cfg.loss_gamma,
            draft_fn,
            self.target_logits,
            draft_in,
            target_hidden,
            labels,
            scored,
            getattr(cfg, "loss_chunk", None),
            self.draft_vocab_ids(),
        )

    def block_targets(
        self, input_ids: torch.Tensor, last: torch.Tensor, anchors: torch.Tensor, loss_mask: torch.Tensor | None = None
    ):
        """For block positions ``k = 1..K-1``: labels ``x[a+k]`` [B, N, K-1], the target's last hidden
        state that predicts them [B, N, K-1, H] (its LM head gives the target's logits), and which of
        them are scored [B, N, K-1] (all, without a loss mask)."""
        pos = anchors[:, :, None] + torch.arange(1, self.config.block_size, device=anchors.device)
        labels = gather_positions(input_ids, pos)
        scored = (
            torch.ones_like(labels, dtype=torch.bool) if loss_mask is None else gather_positions(loss_mask, pos).bool()
        )
        return labels, gather_positions(last, pos - 1), scored
