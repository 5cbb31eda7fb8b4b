"""The target's forward without transformers' module machinery: the same operations, fewer Python calls.

A decode or verify step of a small target spends much of its time outside the model's arithmetic.
Going through transformers' modules, one step of the 8-layer testbed target makes ~110 module calls
(``nn.Module.__call__``'s hook checks), runs keyword-argument decorators on every layer and attention,
reads the config through a wrapper ~60 times and wraps its outputs; on the twenty-first session's
CPU that was ~0.7 ms of a 4.9 ms one-row step (the Linears, at the memory bus's pace, take ~2.1).
:class:`LeanForward` walks the same modules itself: for each layer the norm, the projections, RoPE,
the cache update, the attention function transformers would pick, the output projection and the
MLP, calling each module's own ``forward`` (so the prepacked Linears and our attention kernel serve
as before) and building the mask and the rotary tables with the model's own functions, once a step.

Invariants:

* The same tensor operations in the same order as the model's forward: logits and hidden states are
  bitwise the same (tested against the model's forward for Llama and Qwen3 targets, one row and
  batches, chains and tree masks, quantized caches). So plain and speculative decoding, which both
  run it, stay lossless and the speedup between them honest.
* The features a drafter reads (the hidden states after the layers it names, and the final norm's
  output) come back from the walk itself, where :class:`~distill.base.features.FeatureCapture`
  hooks them off the module forward: no hooks.
* Only what it reproduces exactly: ``LlamaForCausalLM`` and ``Qwen3ForCausalLM`` (no sliding-window
  layers), in inference, with no hooks on any module (they would not run). Anything else returns
  None from :func:`lean_forward` and decodes through the model's forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from distill.base.features import FeatureCapture, TargetFeatures

#: model classes whose forward :class:`LeanForward` reproduces, and their decoder layer's class
SUPPORTED = {"LlamaForCausalLM": "LlamaDecoderLayer", "Qwen3ForCausalLM": "Qwen3DecoderLayer"}
_OFF = contextvars.ContextVar("lean_forward_off", default=False)


@contextlib.contextmanager
def off():
    """Within: sessions made run the model's own forward (an A/B of the two: ``recipes.profile_step``)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos) + (_rotate_half(x) * sin)


class LeanForward:
    """``target``'s forward over ``input_ids`` at ``position_ids`` with a cache, walked module by module
    (see the module docstring). Returns the logits and, for ``features`` (layer ids), a dict of those
    layers' outputs and the final norm's under ``"last"`` (what
    :meth:`~distill.base.features.FeatureCapture.features` reads)."""

    def __init__(self, target):
        self.target, self.model = target, target.model
        self.layers = list(self.model.layers[: target.config.num_hidden_layers])
        attention = self.layers[0].self_attn
        self.head_dim, self.qk_norm = attention.head_dim, hasattr(attention, "q_norm")
        self.eager = sys.modules[type(target).__module__].eager_attention_forward  # transformers' fallback

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache, features: list[int] | None = None) -> tuple[torch.Tensor, dict | None]:
        model, config = self.model, self.target.config
        x = model.embed_tokens.forward(input_ids)
        mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        cos, sin = model.rotary_emb(x, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, self.eager)
        leading = x.shape[:-1]
        heads = (*leading, -1, self.head_dim)
        captured = None if features is None else {}
        for i, layer in enumerate(self.layers):
            a, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm.forward(x)
            q, k = a.q_proj.forward(h).view(heads), a.k_proj.forward(h).view(heads)
            if self.qk_norm:
                q, k = a.q_norm.forward(q), a.k_norm.forward(k)
            q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
            v = a.v_proj.forward(h).view(heads).transpose(1, 2)
            k, v = cache.update(k, v, i)
            out, _ = attend(a, q, k, v, mask, dropout=0.0, scaling=a.scaling)
            x = x + a.o_proj.forward(out.reshape(*leading, -1).contiguous())
            h = layer.post_attention_layernorm.forward(x)
            x = x + mlp.down_proj.forward(mlp.act_fn.forward(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))
            if captured is not None and i in features:
                captured[i] = x
        x = model.norm.forward(x)
        if captured is not None:
            captured["last"] = x
        return self.target.lm_head.forward(x), captured


def _hooked(module: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def lean_forward(target) -> LeanForward | None:
    """A :class:`LeanForward` of ``target`` where it reproduces the model's forward exactly, else None
    (and within :func:`off`)."""
    layer_class = SUPPORTED.get(type(target).__name__)
    layers = getattr(getattr(target, "model", None), "layers", None)
    if _OFF.get() or layer_class is None or layers is None or target.training or _hooked(target):
        return None
    if any(type(layer).__name__ != layer_class for layer in layers):
        return None
    if any(kind != "full_attention" for kind in getattr(target.config, "layer_types", None) or ()):
        return None  # sliding-window layers take a mask of their own
    return LeanForward(target)


class TargetForward:
    """A step of the target as the decoding loops run it: :class:`LeanForward` where it serves, else the
    model's forward with ``capture``'s hooks. ``(input_ids, position_ids, attention_mask, cache)`` ->
    logits [B, n, V] and the features ``capture`` names (None without one)."""

    def __init__(self, target, capture: FeatureCapture | None = None):
        self.target, self.capture, self.lean = target, capture, lean_forward(target)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache) -> tuple[torch.Tensor, TargetFeatures | None]:
        capture = self.capture
        if self.lean is not None:
            logits, captured = self.lean(input_ids, position_ids, attention_mask, cache,
                                         None if capture is None else capture.layer_ids)
            return logits, None if capture is None else capture.features(captured)
        kwargs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, use_cache=True)
        if capture is None:
            return self.target(**kwargs).logits, None
        with capture.hooks() as captured:
            logits = self.target(**kwargs).logits
        return logits, capture.features(captured)
