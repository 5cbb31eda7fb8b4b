"""Applying a plan: QAT's fake quantization (and its delayed switch), conversion to real quantized weights, PTQ."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config import QuantSchemeSpec
from .plan import LayerPlan, always_kept, check_hardware, is_kept, resolve_layer_map
from .schemes import base_config


def fqn_config(plan: LayerPlan, step: str | None):
    from torchao.quantization import FqnToConfig
    from torchao.quantization.qat import QATConfig

    mapping = {}
    for name, scheme in plan.quantized().items():
        base = base_config(scheme, plan.group_size)
        mapping[name] = base if step is None else QATConfig(base, step=step)
    return FqnToConfig(mapping)


def _snapshot_kept(model: nn.Module) -> dict[str, torch.Tensor]:
    kept = always_kept(model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if is_kept(n, kept)}


def _check_kept(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for n, value in before.items():
        p = params.get(n)
        if p is None or type(p.data) is not torch.Tensor or not torch.equal(p.detach(), value):
            raise RuntimeError(f"quantization touched '{n}', which must stay in full precision")


def fake_quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)}


def prepare_qat(model: nn.Module, spec: QuantSchemeSpec, plan: LayerPlan | None = None) -> LayerPlan:
    """Swap the planned Linears for torchao ``FakeQuantizedLinear`` (``QATConfig(base, step="prepare")``).
    Parameters stay the same objects, so an optimizer built before or after sees the same tensors."""
    from torchao.quantization import quantize_

    plan = plan or resolve_layer_map(model, spec)
    kept = _snapshot_kept(model)
    if plan.quantized():
        quantize_(model, fqn_config(plan, "prepare"), filter_fn=None)
    got = set(fake_quantized_modules(model))
    if got != set(plan.quantized()):
        raise RuntimeError(
            f"QAT prepare put fake quantization on {sorted(got ^ set(plan.quantized()))[:5]} contrary to the plan"
        )
    _check_kept(model, kept)
    return plan


def set_fake_quant(model: nn.Module, enabled: bool) -> int:
    """Turn every fake quantizer on or off (QAT's delayed start); returns how many modules it set."""
    from torchao.quantization.qat.linear import enable_linear_fake_quant

    modules = fake_quantized_modules(model)
    for m in modules.values():
        enable_linear_fake_quant(m, enabled)
    return len(modules)


def fake_quant_enabled(step: int, after: int) -> bool:
    """Whether fake quantization is on for the step that follows ``step`` completed steps: a pure
    function of the step, so an exact resume restores it."""
    return step >= after


def fake_quant_hook(model: nn.Module, after: int) -> Callable[[int], None]:
    """The Trainer's ``before_step`` for QAT with a delayed start: sets fake quantization for step 0
    now, then touches the model only on the step where the switch flips (not on every step)."""
    state = {"on": fake_quant_enabled(0, after)}
    set_fake_quant(model, state["on"])

    def hook(step: int) -> None:
        on = fake_quant_enabled(step, after)
        if on != state["on"]:
            set_fake_quant(model, on)
            state["on"] = on

    return hook


def convert(model: nn.Module, spec: QuantSchemeSpec, plan: LayerPlan) -> nn.Module:
    """QAT's last step: fake-quantized Linears become Linears holding real quantized weights."""
    from torchao.quantization import quantize_

    check_hardware(plan, device=next(model.parameters()).device)
    kept = _snapshot_kept(model)
    if plan.quantized():
        quantize_(model, fqn_config(plan, "convert"), filter_fn=None)
    if fake_quantized_modules(model):
        raise RuntimeError("QAT convert left fake-quantized modules behind")
    _check_kept(model, kept)
    return model


def ptq(model: nn.Module, spec: QuantSchemeSpec, plan: LayerPlan | None = None) -> LayerPlan:
    """Post-training quantization with the same scheme and map: the baseline QAT must beat."""
    from torchao.quantization import quantize_

    plan = plan or resolve_layer_map(model, spec)
    check_hardware(plan, device=next(model.parameters()).device)
    kept = _snapshot_kept(model)
    if plan.quantized():
        quantize_(model, fqn_config(plan, None), filter_fn=None)
    _check_kept(model, kept)
    return plan


def quantized_layers(model: nn.Module) -> dict[str, str]:
    """Linear module name -> class name of its weight tensor, for the Linears that hold quantized weights."""
    return {
        n: type(m.weight).__name__
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and type(m.weight) not in (torch.Tensor, nn.Parameter)
    }
