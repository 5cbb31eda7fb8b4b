"""The target's forward without transformers' module machinery: the same operations, fewer Python calls.

A decode or verify step of a small target spends much of its time outside the model's arithmetic.
Going through transformers' modules, one step of the 8-layer testbed target makes ~110 module calls
(``nn.Module.__call__``'s hook checks), runs keyword-argument decorators on every layer and attention,
reads the config through a wrapper ~60 times and wraps its outputs: a sizeable share of a one-row step
on a CPU (docs/benchmarks.md).
:class:`LeanForward` walks the same modules itself: for each layer the norm, the projections, RoPE,
the cache update, the attention function transformers would pick, the output projection and the
MLP, calling each module's own ``forward`` (so the prepacked Linears and our attention kernel serve
as before; the modules read once, when a session makes its walk) and building the mask and the rotary
tables with the model's own functions, once a step.

Invariants:

* The model's arithmetic in the model's order (RoPE's sign carried on the sine instead of the rotated
  half, which rounds alike): logits and hidden states are bitwise the same (tested against the
  model's forward for Llama and Qwen3 targets, one row and batches, chains and tree masks, quantized
  caches). So plain and speculative decoding, which both run it, stay lossless and the speedup
  between them honest.
* The features a drafter reads (the hidden states after the layers it names, and the final norm's
  output) come back from the walk itself, where :class:`~distill.base.features.FeatureCapture`
  hooks them off the module forward: no hooks.
* Only what it reproduces exactly: ``LlamaForCausalLM`` and ``Qwen3ForCausalLM`` (no sliding-window
  layers), in inference, with no hooks on any module (they would not run). Anything else returns
  None from :func:`lean_forward` and decodes through the model's forward.
"""

from __future__ import annotations

import sys

import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

#: model classes whose forward :class:`LeanForward` reproduces, and their decoder layer's class
SUPPORTED = {"LlamaForCausalLM": "LlamaDecoderLayer", "Qwen3ForCausalLM": "Qwen3DecoderLayer"}


class _Layer:
    """One decoder layer's modules, read once (``nn.Module`` attribute reads cost ~1 us each, ~120 a step)."""

    def __init__(self, layer):
        a, mlp = layer.self_attn, layer.mlp
        self.attention, self.scaling = a, a.scaling
        self.norm, self.post_norm = layer.input_layernorm.forward, layer.post_attention_layernorm.forward
        self.q, self.k, self.v, self.o = a.q_proj.forward, a.k_proj.forward, a.v_proj.forward, a.o_proj.forward
        self.qk_norms = (a.q_norm.forward, a.k_norm.forward) if hasattr(a, "q_norm") else None
        self.gate, self.up, self.down, self.act = (
            mlp.gate_proj.forward,
            mlp.up_proj.forward,
            mlp.down_proj.forward,
            mlp.act_fn.forward,
        )


class LeanForward:
    """``target``'s forward over ``input_ids`` at ``position_ids`` with a cache, walked module by module
    (see the module docstring). Returns the logits (with ``logits_at`` [B], only at that position of each
    row: [B, 1, V], a prefill's) and, for ``features`` (layer ids), a dict of those
    layers' outputs and the final norm's under ``"last"`` (what
    :meth:`~distill.base.features.FeatureCapture.features` reads). It reads the modules when made (a
    session makes one): modules swapped in afterwards are not seen.

    RoPE: transformers rotates with ``cat(-x2, x1) * sin``; here ``x[..., perm] * sin'`` with the halves
    swapped by one gather and the sign moved onto ``sin`` (``sin' = cat(-sin1, sin2)``, once a step):
    ``(-a) b`` and ``a (-b)`` round alike, so the products are the same bits, in four operations a
    tensor instead of seven."""

    def __init__(self, target):
        model = target.model
        self.target, self.layers = target, [_Layer(layer) for layer in model.layers[: target.config.num_hidden_layers]]
        self.head_dim = self.layers[0].attention.head_dim
        half = self.head_dim // 2
        device = target.lm_head.weight.device
        self.half, self.swap = half, torch.cat([torch.arange(half, 2 * half), torch.arange(half)]).to(device)
        self.embed, self.rotary, self.final_norm = model.embed_tokens.forward, model.rotary_emb, model.norm.forward
        self.head = target.lm_head.forward
        self.eager = sys.modules[type(target).__module__].eager_attention_forward  # transformers' fallback

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache,
        features: list[int] | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict | None]:
        config = self.target.config
        x = self.embed(input_ids)
        mask = create_causal_mask(
            config=config, inputs_embeds=x, attention_mask=attention_mask, cache=cache, position_ids=position_ids
        )
        cos, sin = self.rotary(x, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        sin = torch.cat((-sin[..., : self.half], sin[..., self.half :]), dim=-1)
        swap = self.swap

        def rope(t):
            return (t * cos) + (t.index_select(-1, swap) * sin)

        attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, self.eager)
        leading = x.shape[:-1]
        heads = (*leading, -1, self.head_dim)
        captured = None if features is None else {}
        for i, layer in enumerate(self.layers):
            h = layer.norm(x)
            q, k = layer.q(h).view(heads), layer.k(h).view(heads)
            if layer.qk_norms is not None:
                q, k = layer.qk_norms[0](q), layer.qk_norms[1](k)
            q, k = rope(q.transpose(1, 2)), rope(k.transpose(1, 2))
            v = layer.v(h).view(heads).transpose(1, 2)
            k, v = cache.update(k, v, i)
            out, _ = attend(layer.attention, q, k, v, mask, dropout=0.0, scaling=layer.scaling)
            x = x + layer.o(out.reshape(*leading, -1).contiguous())
            h = layer.post_norm(x)
            x = x + layer.down(layer.act(layer.gate(h)) * layer.up(h))
            if captured is not None and i in features:
                captured[i] = x
        x = self.final_norm(x)
        if captured is not None:
            captured["last"] = x
        if logits_at is not None:  # as the model's forward keeps them (logits_to_keep [B, 1]): the same product
            x = torch.take_along_dim(x, logits_at.to(x.device)[:, None, None], dim=1)
        return self.head(x), captured


def _hooked(module: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def lean_forward(target) -> LeanForward | None:
    """A :class:`LeanForward` of ``target`` where it reproduces the model's forward exactly, else None."""
    layer_class = SUPPORTED.get(type(target).__name__)
    layers = getattr(getattr(target, "model", None), "layers", None)
    if layer_class is None or layers is None or target.training or _hooked(target):
        return None
    if any(type(layer).__name__ != layer_class for layer in layers):
        return None
    if any(kind != "full_attention" for kind in getattr(target.config, "layer_types", None) or ()):
        return None  # sliding-window layers take a mask of their own
    return LeanForward(target)
