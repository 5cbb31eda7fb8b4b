"""Quantization schemes: their torchao configs, bit widths and whether this machine can run them."""

from __future__ import annotations

import re

import torch


def scheme_family(name: str) -> str:
    if name.startswith("8da"):
        return "8da"
    if re.fullmatch(r"w[2-8]", name):
        return "w"
    return name


def scheme_bits(name: str) -> int:
    """Weight bits of a scheme (float8 counts 8)."""
    if name == "int4_weight_only":
        return 4
    if name == "float8":
        return 8
    return int(re.search(r"\d", name.removeprefix("8da")).group())


def base_config(name: str, group_size: int | None):
    """The torchao PTQ config of a scheme (QAT derives its fake quantizers from it)."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
        PerAxis,
        PerGroup,
        PerRow,
    )

    granularity = PerGroup(group_size) if group_size else PerAxis(0)
    family = scheme_family(name)
    if family == "8da":
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=getattr(torch, f"int{scheme_bits(name)}"), weight_granularity=granularity
        )
    if family == "w":
        return IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{scheme_bits(name)}"), granularity=granularity)
    if name == "int4_weight_only":
        return Int4WeightOnlyConfig(group_size=group_size)
    if name == "float8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    raise ValueError(f"unknown quantization scheme '{name}'")


def hardware_problem(name: str, device: torch.device | str | None = None) -> str | None:
    """Why ``name`` cannot be converted (really quantized) on ``device`` (default: this machine), or None."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if name == "float8":
        if device.type != "cuda":
            return "float8 needs a GPU of compute capability >= 8.9 (Hopper/Ada); this run is on the CPU"
        if torch.cuda.get_device_capability(device) < (8, 9):
            return f"float8 needs compute capability >= 8.9; this GPU has {torch.cuda.get_device_capability(device)}"
    if name == "int4_weight_only":
        if device.type != "cuda":
            return (
                "int4_weight_only converts with a CUDA kernel (torchao's Int4WeightOnlyConfig); this run is on the "
                "CPU: use w4 (int4 weight-only, portable) or 8da4w here"
            )
        try:
            import mslk  # noqa: F401  (torchao's int4 kernel package)
        except ImportError:
            return "int4_weight_only needs torchao's CUDA kernel package (pip install mslk)"
    return None
