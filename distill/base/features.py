"""Target features for drafters: hidden states captured with forward hooks while the target runs.

Layer-index convention (recorded in every drafter config and feature cache as
``layer_id_convention = "output_of_layer"``): id ``i`` is the *output of decoder layer i*
(0-based), which is ``hidden_states[i + 1]`` in ``transformers``' ``output_hidden_states`` (index 0
there is the embedding output). This is z-lab DFlash's and SpecForge's convention; vLLM
``speculators`` uses the *input* of layer i (``hidden_states[i]``), so exporting to it shifts ids by one.
A silent off-by-one here costs about one accepted token per step in the reference systems, which is
why a test compares the hooks against ``output_hidden_states``.

The final hidden state is the output of the target's final norm (what its LM head reads), so target
logits at any position can be rebuilt as ``lm_head(last[pos])`` without storing ``[T, vocab]`` logits.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

LAYER_ID_CONVENTION = "output_of_layer"


def decoder_layers(model) -> torch.nn.ModuleList:
    base = getattr(model, "model", None) or model.base_model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__} (expected .model.layers)")
    return layers


def final_norm(model) -> torch.nn.Module:
    base = getattr(model, "model", None) or model.base_model
    return base.norm


def default_layer_ids(num_layers: int, count: int) -> list[int]:
    """``count`` ids spread evenly over ``[1, num_layers - 3]`` (z-lab DFlash's default: low, mid, high);
    over all layers when the target is too shallow for that."""
    lo, hi = 1, num_layers - 3
    if hi - lo + 1 < count:
        lo, hi = 0, num_layers - 1
    if hi - lo + 1 < count:
        raise ValueError(f"a target with {num_layers} layers has fewer than {count} layers to read features from")
    if count == 1:
        return [hi]
    return [round(lo + i * (hi - lo) / (count - 1)) for i in range(count)]


@dataclass
class TargetFeatures:
    aux: torch.Tensor  # [B, T, len(layer_ids) * H]: the captured layers, concatenated in id order
    last: torch.Tensor  # [B, T, H]: final hidden state (after the final norm)


class FeatureCapture:
    """Runs a frozen target and returns the hidden states of ``layer_ids`` plus its final hidden state."""

    def __init__(self, target, layer_ids: list[int]):
        n = len(decoder_layers(target))
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"target layer ids {bad} are out of range: the target has {n} decoder layers (0..{n - 1})")
        self.target = target
        self.layer_ids = list(layer_ids)

    @contextmanager
    def hooks(self):
        """Within the block, any forward of the target fills the yielded dict with the captured states."""
        captured: dict = {}

        def grab(key):
            def hook(_module, _inputs, output):
                captured[key] = output[0] if isinstance(output, tuple) else output

            return hook

        layers = decoder_layers(self.target)
        handles = [layers[i].register_forward_hook(grab(i)) for i in self.layer_ids]
        handles.append(final_norm(self.target).register_forward_hook(grab("last")))
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()

    def features(self, captured: dict, device: torch.device | str | None = None) -> TargetFeatures:
        """The captured states on ``device`` (None: the first captured layer's). A target split over devices
        (``target.device_map``) leaves each state on its layer's device; they are moved, not left there."""
        device = device if device is not None else captured[self.layer_ids[0]].device
        return TargetFeatures(
            aux=torch.cat([captured[i].to(device) for i in self.layer_ids], dim=-1), last=captured["last"].to(device)
        )

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TargetFeatures:
        """The target's features for ``input_ids``, on ``input_ids``' device."""
        with self.hooks() as captured:
            # only the base model runs: the LM head's [T, vocab] logits are rebuilt where needed
            base = getattr(self.target, "model", None) or self.target.base_model
            base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.features(captured, input_ids.device)
