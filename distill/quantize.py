"""Quantization of drafters, students and Parcae models with torchao: QAT, PTQ and per-layer maps.

Schemes (recipe names -> torchao configs)
    ``8da<N>w`` (N = 2..8)   int8 dynamic per-token asymmetric activations + intN symmetric weights,
                             one scale per ``group_size`` weights (``Int8DynamicActivationIntxWeightConfig``);
                             the edge/CPU scheme (ExecuTorch, torchao's CPU kernels). ``8da8w`` is the
                             "int8 attention" scheme.
    ``w<N>``                 intN weight-only, per group (``IntxWeightOnlyConfig``); runs anywhere
                             (weights dequantized on the fly); ``w2``/``w3`` are the aggressive ones.
    ``int4_weight_only``     torchao's GPU int4 (``Int4WeightOnlyConfig``, bf16 activations); convert
                             needs CUDA and its kernel package: validated and QAT-prepared anywhere,
                             converted on GPUs only.
    ``float8``               float8 e4m3 dynamic activations and weights, per row
                             (``Float8DynamicActivationFloat8WeightConfig``); needs compute capability
                             >= 8.9 (Hopper, Ada): validated anywhere, refused on CPUs.

Fake quantization (what QAT trains through)
    For a weight group with scale ``s`` (symmetric: ``s = max|w| / (2^(N-1) - 1)``, zero point 0) the
    forward uses ``w_fq = s * (clamp(round(w / s) + z, qmin, qmax) - z)``; activations (8da schemes) use
    per-token asymmetric int8 with ``s = (max - min) / 255`` and ``z = qmin - round(min / s)``. Rounding
    passes gradients straight through (STE), so the full-precision weights learn to sit where
    rounding hurts least. ``convert`` replaces each fake-quantized Linear by the real quantized
    tensor (integer codes + scales), which computes the same function: on CPU the converted outputs
    equal the fake-quantized ones to float rounding (a test checks it).

The three models a report compares (torchao's convention)
    * **full**: the trained full-precision model;
    * **PTQ**: that model quantized as is (post-training quantization, no data);
    * **QAT**: the same starting point fine-tuned with fake quantization, then converted.
    QAT had extra training steps; ``recipes/quantize.py`` therefore also fine-tunes full precision for
    the same steps (``full_ft``) and PTQs that (``ptq_ft``, *compute-matched*).
    ``recovered = (QAT - PTQ_ft) / (full_ft - PTQ_ft)``: the share of the quantization gap QAT wins
    back (1 = QAT matches full precision, 0 = no better than PTQ, < 0 worse), on the primary metric
    (drafters: simulated tau; LMs: held-out loss); not reported where ``|full - PTQ|`` is below the
    recipe's ``min_gap`` (a ratio of noise to noise).

Per-layer maps
    :func:`resolve_layer_map` turns a recipe's ordered ``pattern -> scheme | keep`` map into one
    decision per ``nn.Linear`` (exact module names, globs, or ``re:`` full-match regexes, tried in
    order; the first match wins), then hands torchao an ``FqnToConfig`` of exact module names, so
    torchao never sees a regex that could also match a container module. A pattern that matches no
    Linear, or only Linears an earlier pattern took, is an error listing the closest module names.
    The output head is kept unless named; Parcae's ``A_log``, ``dt_bias`` (Delta) and ``B`` are always
    kept (they set the loop's dynamics; a module or parameter path with one of those names is never
    quantized, and :func:`prepare_qat` / :func:`ptq` check they are untouched).

Sizes (:func:`model_bytes`)
    ``bytes`` is what the tensors occupy in memory here (torchao's portable intx format stores each
    code in an int8, so int4 and int2 weights take a byte each); ``packed_bytes`` is what a packed
    serving format stores: ``N/8`` bytes per code plus the scales and zero points as stored.

Saving
    Quantized weights are tensor subclasses, which ``safetensors.save_file`` cannot take as they are;
    torchao flattens them into plain tensors plus JSON metadata (``torchao.prototype.safetensors``, the
    layout transformers' ``TorchAoConfig`` reads and writes). :func:`save_quantized` writes
    ``config.json`` (with a ``quantization_config``: a ``TorchAoConfig`` wrapping the plan as an
    ``FqnToConfig``, so transformers' ``from_pretrained`` loads the folder as it is),
    ``model.safetensors`` in that layout and ``quantization.json`` (the resolved per-layer plan);
    :func:`load_quantized` rebuilds the model from its config and assigns the tensors.

Function API (any ``nn.Module`` with Linear layers; a training recipe uses :class:`QuantStage`)::

    plan = resolve_layer_map(model, spec)          # RecipeError on a dead pattern, before any compute
    prepare_qat(model, spec, plan)                 # fake quantization where the plan says, nowhere else
    set_fake_quant(model, step >= after)           # delayed fake quantization
    convert(model, spec, plan)                     # real quantized weights
    ptq(model, spec, plan)                         # the baseline: quantize without training
    model_bytes(model), save_quantized(...), load_quantized(...), quant_report(rows, out_dir, ...)
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import json
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn

from .checkpoint import write_atomically
from .config import QuantSchemeSpec, QuantSection, RecipeError

QUANTIZED_FILE = "model.safetensors"
PLAN_FILE = "quantization.json"

# --------------------------------------------------------------------------------------------------
# Schemes
# --------------------------------------------------------------------------------------------------


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
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=getattr(torch, f"int{scheme_bits(name)}"),
                                                     weight_granularity=granularity)
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
            return ("int4_weight_only converts with a CUDA kernel (torchao's Int4WeightOnlyConfig); this run is on the "
                    "CPU: use w4 (int4 weight-only, portable) or 8da4w here")
        try:
            import mslk  # noqa: F401  (torchao's int4 kernel package)
        except ImportError:
            return "int4_weight_only needs torchao's CUDA kernel package (pip install mslk)"
    return None


# --------------------------------------------------------------------------------------------------
# The per-layer plan
# --------------------------------------------------------------------------------------------------


@dataclass
class LayerPlan:
    """One decision per Linear module: a scheme name or ``keep``, and why."""

    assignments: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    group_size: int | None = 32
    kept_parameters: list[str] = field(default_factory=list)  # always-kept non-Linear parameters seen

    def quantized(self) -> dict[str, str]:
        return {n: s for n, s in self.assignments.items() if s != "keep"}

    def schemes(self) -> list[str]:
        return sorted(set(self.quantized().values()))

    def to_json(self) -> dict:
        counts: dict[str, int] = {}
        for s in self.assignments.values():
            counts[s] = counts.get(s, 0) + 1
        return {"group_size": self.group_size, "counts": counts, "layers": self.assignments, "reasons": self.reasons,
                "always_kept_parameters": self.kept_parameters}


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def always_kept(model: nn.Module) -> set[str]:
    """Parameter and module names that are never quantized: what each module of ``model`` declares in
    its ``quantization_keep`` (e.g. Parcae's injection dynamics), as full names."""
    return {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
            for name in getattr(module, "quantization_keep", ())}


def _is_kept(name: str, kept: set[str]) -> bool:
    return name in kept or any(name.startswith(k + ".") for k in kept)


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern


def _closest(pattern: str, names: list[str], n: int = 5) -> list[str]:
    probe = pattern[3:] if pattern.startswith("re:") else pattern
    probe = re.sub(r"[\\^$*+?()\[\]{}|]", "", probe)  # regex syntax out, names in
    scored = sorted(names, key=lambda x: -difflib.SequenceMatcher(None, probe, x).ratio())
    return scored[:n]


def _output_head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in model.named_modules():
        if module is head:
            return name
    return "lm_head" if isinstance(getattr(model, "lm_head", None), nn.Linear) else None


def _head_is_tied(model: nn.Module, head_name: str | None) -> bool:
    if head_name is None or not hasattr(model, "get_input_embeddings"):
        return False
    emb = model.get_input_embeddings()
    head = model.get_submodule(head_name)
    return emb is not None and head.weight is emb.weight


def resolve_layer_map(model: nn.Module, spec: QuantSchemeSpec, key: str = "quant") -> LayerPlan:
    """The scheme of every Linear in ``model`` under ``spec``; :class:`RecipeError` naming ``key`` for a
    pattern that matches nothing, a group size that does not divide a layer, or a tied head."""
    names = linear_names(model)
    kept = always_kept(model)
    candidates = [n for n in names if not _is_kept(n, kept)]
    plan = LayerPlan(group_size=spec.group_size)
    plan.kept_parameters = [n for n, _ in model.named_parameters() if _is_kept(n, kept) and not any(
        n.startswith(m + ".") for m in names)]
    for n in names:
        if _is_kept(n, kept):
            plan.assignments[n], plan.reasons[n] = "keep", "always kept (declared by the model's quantization_keep)"
    for pattern, scheme in spec.layers.items():
        hits = [n for n in names if _matches(pattern, n)]
        where = f"{key}.layers['{pattern}']"
        if not hits:
            others = [n for n, _ in model.named_modules() if n and _matches(pattern, n)]
            extra = f"; it matches only non-Linear modules ({', '.join(others[:3])}): only Linear layers are quantized" if others else ""
            raise RecipeError(f"{where}: the pattern matches no Linear module of {type(model).__name__}{extra}; "
                              f"closest module names: {', '.join(_closest(pattern, names))}")
        free = [n for n in hits if n in candidates and n not in plan.assignments]
        if not free:
            if all(_is_kept(n, kept) for n in hits):
                raise RecipeError(f"{where}: the pattern matches only {', '.join(hits[:3])}, which are always kept in "
                                  f"full precision (the model declares them in quantization_keep, e.g. Parcae's "
                                  f"A_log, dt_bias and B)")
            raise RecipeError(f"{where}: every module it matches ({', '.join(hits[:3])}{', ...' if len(hits) > 3 else ''}) "
                              "was already assigned by an earlier pattern (the first match wins): reorder or remove it")
        for n in free:
            plan.assignments[n], plan.reasons[n] = scheme, f"layers['{pattern}']"
    head = _output_head_name(model)
    for n in candidates:
        if n not in plan.assignments:
            if n == head:
                plan.assignments[n], plan.reasons[n] = "keep", "output head: kept unless the layer map names it"
            else:
                plan.assignments[n], plan.reasons[n] = spec.scheme, "default scheme"
    plan.assignments = {n: plan.assignments[n] for n in names}  # model order
    if head in plan.quantized() and _head_is_tied(model, head):
        raise RecipeError(f"{key}.layers: '{head}' shares its weight with the input embeddings (tied); quantizing it "
                          "would untie them: keep it, or untie the model first")
    for n, scheme in plan.quantized().items():
        linear = model.get_submodule(n)
        if spec.group_size and scheme != "float8" and linear.in_features % spec.group_size:
            raise RecipeError(f"{key}.group_size = {spec.group_size}: module '{n}' has in_features {linear.in_features}, "
                              "not a multiple; choose a group size that divides it, or keep that module")
    return plan


def check_hardware(plan: LayerPlan, key: str = "quant", device=None) -> None:
    """RecipeError when a scheme of ``plan`` cannot be converted on this machine (before any compute)."""
    for scheme in plan.schemes():
        problem = hardware_problem(scheme, device)
        if problem:
            raise RecipeError(f"{key}: scheme '{scheme}' cannot run here: {problem}")


# --------------------------------------------------------------------------------------------------
# Prepare, fake-quant switch, convert, PTQ
# --------------------------------------------------------------------------------------------------


def _fqn_config(plan: LayerPlan, step: str | None):
    from torchao.quantization import FqnToConfig
    from torchao.quantization.qat import QATConfig

    mapping = {}
    for name, scheme in plan.quantized().items():
        base = base_config(scheme, plan.group_size)
        mapping[name] = base if step is None else QATConfig(base, step=step)
    return FqnToConfig(mapping)


def _snapshot_kept(model: nn.Module) -> dict[str, torch.Tensor]:
    kept = always_kept(model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if _is_kept(n, kept)}


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
        quantize_(model, _fqn_config(plan, "prepare"), filter_fn=None)
    got = set(fake_quantized_modules(model))
    if got != set(plan.quantized()):
        raise RuntimeError(f"QAT prepare put fake quantization on {sorted(got ^ set(plan.quantized()))[:5]} "
                           "contrary to the plan")
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
        quantize_(model, _fqn_config(plan, "convert"), filter_fn=None)
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
        quantize_(model, _fqn_config(plan, None), filter_fn=None)
    _check_kept(model, kept)
    return plan


def quantized_layers(model: nn.Module) -> dict[str, str]:
    """Linear module name -> class name of its weight tensor, for the Linears that hold quantized weights."""
    return {n: type(m.weight).__name__ for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and type(m.weight) not in (torch.Tensor, nn.Parameter)}


# --------------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------------


def _tensor_bytes(t: torch.Tensor) -> tuple[int, int]:
    """(bytes in memory, packed bytes) of one parameter or buffer."""
    data = t.data if isinstance(t, nn.Parameter) else t
    if not hasattr(data, "__tensor_flatten__") or type(data) is torch.Tensor:
        n = data.numel() * data.element_size()
        return n, n
    names, meta = data.__tensor_flatten__()
    target = meta.get("target_dtype") if isinstance(meta, dict) else getattr(data, "target_dtype", None)
    bits = int(str(target).removeprefix("torch.int")) if target is not None and str(target).startswith("torch.int") else None
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


# --------------------------------------------------------------------------------------------------
# Save and load
# --------------------------------------------------------------------------------------------------


def transformers_quantization_config(plan: LayerPlan):
    """The plan as transformers' ``TorchAoConfig`` (an ``FqnToConfig`` of exact module names): written into
    ``config.json``, so ``from_pretrained`` (transformers, and engines that load through it) reads the
    quantized weights as they are."""
    from transformers import TorchAoConfig

    return TorchAoConfig(quant_type=_fqn_config(plan, None))


def save_quantized(model: nn.Module, folder: str | Path, plan: LayerPlan, extra: dict | None = None,
                   tokenizer=None) -> Path:
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
            t = t.contiguous()
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
        record = {"format": f"{QUANTIZED_FILE}: torchao tensor subclasses flattened for safetensors "
                            "(torchao.prototype.safetensors), the layout transformers' TorchAoConfig also uses",
                  "torchao": torchao.__version__, "torch": torch.__version__,
                  "load": "distill.quantize.load_quantized(folder)", **(extra or {}), "plan": plan.to_json()}
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
        tensors = {k: f.get_tensor(k) for k in f.keys()}
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


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def recovered(full: float | None, ptq_value: float | None, qat_value: float | None) -> float | None:
    """(QAT - PTQ) / (full - PTQ): the share of the quantization gap QAT wins back; None without a gap."""
    if None in (full, ptq_value, qat_value) or full == ptq_value:
        return None
    return (qat_value - ptq_value) / (full - ptq_value)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def quant_report(rows: list[dict], out_dir: str | Path, metric: str, columns: list[str], title: str,
                 summary: list[dict] | None = None) -> dict:
    """Write ``quant_report.json``, ``quant_report.md`` and, for several variants, ``quant_report.png``
    (the primary metric against packed bytes) into ``out_dir``; return the report."""
    from .provenance import write_json_atomic

    out = Path(out_dir)
    report = {"title": title, "metric": metric, "rows": rows, "summary": summary or []}
    write_json_atomic(out / "quant_report.json", report)
    text = f"# {title}\n\n" + markdown_table(rows, columns)
    if summary:
        text += "\n" + markdown_table(summary, list(summary[0]))
    tmp = out / f".quant_report.md.tmp-{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, out / "quant_report.md")
    variants = sorted({r["variant"] for r in rows if r.get("variant") not in (None, "-")})
    if len(variants) > 1:
        plot_report(rows, metric, out / "quant_report.png", title)
    return report


def plot_report(rows: list[dict], metric: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=120)
    own = any(r.get("own_packed_bytes", r["packed_bytes"]) != r["packed_bytes"] for r in rows)  # drafters
    size = "own_packed_bytes" if own else "packed_bytes"
    markers = {"full": ("*", "black"), "full_ft": ("*", "grey"), "ptq": ("o", "#d8703b"), "ptq_ft": ("s", "#d8a03b"),
               "qat": ("^", "#3b7dd8")}
    for kind, (marker, color) in markers.items():
        pts = [r for r in rows if r["model"] == kind and r.get(metric) is not None]
        if pts:
            ax.scatter([r[size] / 1e6 for r in pts], [r[metric] for r in pts], marker=marker, color=color,
                       s=60, label=kind, zorder=3)
            for r in pts:
                if kind in ("qat", "ptq") and r.get("variant") not in (None, "-"):  # one label per point pair
                    ax.annotate(r["variant"], (r[size] / 1e6, r[metric]), fontsize=7,
                                xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("packed size (MB)" + (", without the shared embeddings and LM head" if own else ""))
    ax.set_ylabel(metric)
    ax.set_title(textwrap.fill(title, 80), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# The stage a training recipe calls
# --------------------------------------------------------------------------------------------------


class QuantStage:
    """The ``quant:`` section of a training recipe, applied to the model it trains.

    Usage (``recipes/train_drafter.py``, ``recipes/train_lm.py``; Parcae and students the same way)::

        stage = QuantStage(recipe.quant, model)       # right after the model is built: RecipeError on a bad
                                                      # pattern or a scheme this machine cannot run
        stage.prepare()                               # qat: fake quantization, before the Trainer
        trainer = Trainer(..., before_step=stage.before_step)
        result = trainer.fit()
        quant = stage.finish(model, evaluate_fn, out_dir, metric, tokenizer)   # quantized copy + report

    ``finish`` leaves ``model`` in full precision (QAT-trained weights, the ``model/`` folder a normal
    ``from_pretrained`` loads) and writes the quantized copy to ``<out_dir>/model_quantized``."""

    def __init__(self, section: QuantSection, model: nn.Module, key: str = "quant", check_device: bool = True):
        self.section = section
        self.model = model
        self.enabled = section.mode != "none"
        self.plan = resolve_layer_map(model, section, key) if self.enabled else None
        if self.enabled and check_device:
            check_hardware(self.plan, key)

    def summary(self) -> dict | None:
        return None if not self.enabled else {"mode": self.section.mode, **self.plan.to_json()}

    def prepare(self) -> None:
        """qat: fake quantization on the planned layers (call before the Trainer builds its optimizer)."""
        if self.section.mode == "qat":
            prepare_qat(self.model, self.section, self.plan)
            self._fake_quant = fake_quant_hook(self.model, self.section.fake_quant_after_steps)

    def before_step(self, step: int) -> None:
        """The Trainer's hook: fake quantization on from ``fake_quant_after_steps`` completed steps."""
        if self.section.mode == "qat":
            self._fake_quant(step)

    def finish(self, model: nn.Module, evaluate_fn: Callable[[nn.Module], dict], out_dir: str | Path, metric: str,
               tokenizer=None, exclude_from_bytes: Iterable[str] = (), is_main_process: bool = True) -> dict | None:
        """Quantize a copy of the trained ``model`` (convert after QAT, PTQ otherwise), evaluate it (every
        process: evaluations reduce across them), save it and write the report (main process); returns
        the rows for the recipe's ``summary.json``."""
        if not self.enabled:
            return None
        out = Path(out_dir)
        sec = self.section
        rows = []
        if sec.mode == "qat":
            set_fake_quant(model, True)
            rows.append({"model": "qat_fake_quant", **self._measure(model, evaluate_fn, exclude_from_bytes)})
            quantized = copy.deepcopy(model)
            convert(quantized, sec, self.plan)
            set_fake_quant(model, False)  # the saved full-precision weights are plain Linears' weights
        else:
            rows.append({"model": "full", **self._measure(model, evaluate_fn, exclude_from_bytes)})
            quantized = copy.deepcopy(model)
            ptq(quantized, sec, self.plan)
        rows.append({"model": "qat" if sec.mode == "qat" else "ptq", **self._measure(quantized, evaluate_fn, exclude_from_bytes)})
        for r in rows:
            r["variant"] = sec.scheme if not sec.layers else f"{sec.scheme} + map"
        if is_main_process:
            save_quantized(quantized, out / "model_quantized", self.plan, {"mode": sec.mode, "scheme": sec.scheme}, tokenizer)
            columns = ["model", "variant", "bytes", "packed_bytes", metric]
            quant_report(rows, out, metric, columns, f"{sec.mode}: {sec.scheme} (group {sec.group_size})")
            print((out / "quant_report.md").read_text(), flush=True)
        return {"mode": sec.mode, "scheme": sec.scheme, "checkpoint": str(out / "model_quantized"), "rows": rows}

    @staticmethod
    def _measure(model, evaluate_fn, exclude) -> dict:
        model.eval()
        with torch.no_grad():
            metrics = evaluate_fn(model)
        return {**model_bytes(model, exclude), **metrics}
