"""Sizes of quantized models, and saving / loading them in the layout transformers' TorchAoConfig reads."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import write_atomically
from .apply import fqn_config
from .plan import LayerPlan

QUANTIZED_FILE = "model.safetensors"
PLAN_FILE = "quantization.json"


def _tensor_bytes(t: torch.Tensor) -> tuple[int, int]:
    """(bytes in memory, packed bytes) of one parameter or buffer."""
    data = t.data if isinstance(t, nn.Parameter) else t
    if not hasattr(data, "__tensor_flatten__") or type(data) is torch.Tensor:
        n = data.numel() * data.element_size()
        return n, n
    names, meta = data.__tensor_flatten__()
    target = meta.get("target_dtype") if isinstance(meta, dict) else getattr(data, "target_dtype", None)
    bits = (
        int(str(target).removeprefix("torch.int"))
        if target is not None and str(target).startswith("torch.int")
        else None
    )
    mem = packed = 0
    for name in names:
        inner = getattr(data, name)
        m, p = _tensor_bytes(inner)
        mem += m
        packed += (inner.numel() * bits + 7) // 8 if (name == "qdata" and bits) else p
    return mem, packed


def model_bytes(model: nn.Module, exclude: Iterable[str] = ()) -> dict:
    """Bytes of every parameter and buffer (shared tensors once): in memory and packed (see the module
    docstring); names starting with an ``exclude`` prefix are left out."""
    exclude = tuple(exclude)
    seen: set[int] = set()
    mem = packed = 0
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in tensors:
        if exclude and name.startswith(exclude):
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        m, p = _tensor_bytes(t)
        mem, packed = mem + m, packed + p
    return {"bytes": mem, "packed_bytes": packed}


# Save and load


def transformers_quantization_config(plan: LayerPlan):
    """The plan as transformers' ``TorchAoConfig`` (an ``FqnToConfig`` of exact module names): written into
    ``config.json``, so ``from_pretrained`` (transformers, and engines that load through it) reads the
    quantized weights as they are."""
    from transformers import TorchAoConfig

    return TorchAoConfig(quant_type=fqn_config(plan, None))


def save_quantized(
    model: nn.Module, folder: str | Path, plan: LayerPlan, extra: dict | None = None, tokenizer=None
) -> Path:
    """``config.json`` + ``model.safetensors`` (torchao's flattened tensor-subclass format) +
    ``quantization.json`` (+ tokenizer), written atomically."""
    import torchao
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    state, aliases, seen = {}, {}, {}
    for name, t in model.state_dict().items():
        if type(t) is torch.Tensor:  # tied weights (a kept head and its embeddings) are stored once
            key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
            state[name] = t.contiguous()
        else:
            state[name] = t
    tensors, metadata = flatten_tensor_state_dict(state)
    metadata["draftsmith_aliases"] = json.dumps(aliases)

    config = copy.deepcopy(model.config)
    config.quantization_config = transformers_quantization_config(plan).to_dict()

    def write(tmp: Path) -> None:
        config.save_pretrained(tmp)
        save_file(tensors, tmp / QUANTIZED_FILE, metadata=metadata)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        record = {
            "format": f"{QUANTIZED_FILE}: torchao tensor subclasses flattened for safetensors "
            "(torchao.prototype.safetensors), the layout transformers' TorchAoConfig also uses",
            "torchao": torchao.__version__,
            "torch": torch.__version__,
            "load": "distill.quantize.load_quantized(folder)",
            **(extra or {}),
            "plan": plan.to_json(),
        }
        (tmp / PLAN_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")

    write_atomically(None, Path(folder), write)
    return Path(folder)


def load_quantized(folder: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """A model saved by :func:`save_quantized`: built from its config, quantized tensors assigned."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    import drafters  # (and registers the drafter classes with AutoModel)
    import parcae  # noqa: F401  (registers Parcae with AutoModelForCausalLM)

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    is_drafter = drafters.kind_of(config) is not None  # AutoModel; causal LMs, students, Parcae: AutoModelForCausalLM
    model = (AutoModel if is_drafter else AutoModelForCausalLM).from_config(config)
    from safetensors import safe_open
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    with safe_open(folder / QUANTIZED_FILE, framework="pt", device=str(device)) as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 safe_open has keys(), not __iter__
    state, leftover = unflatten_tensor_state_dict(tensors, metadata)
    if leftover:
        raise ValueError(f"{folder / QUANTIZED_FILE}: tensors no metadata names: {sorted(leftover)[:5]}")
    for name, source in json.loads(metadata.get("draftsmith_aliases", "{}")).items():
        state[name] = state[source]
    model.load_state_dict(state, assign=True, strict=True)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    model.to(device)
    if is_drafter:
        model.freeze_target_io()
    return model.eval()
