"""The per-layer plan: which Linear gets which scheme, from a recipe's layer map and what the model keeps."""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field

from torch import nn

from ..config import QuantSchemeSpec, RecipeError
from .schemes import hardware_problem


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
        return {
            "group_size": self.group_size,
            "counts": counts,
            "layers": self.assignments,
            "reasons": self.reasons,
            "always_kept_parameters": self.kept_parameters,
        }


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def always_kept(model: nn.Module) -> set[str]:
    """Parameter and module names that are never quantized: what each module of ``model`` declares in
    its ``quantization_keep`` (e.g. Parcae's injection dynamics), as full names."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in getattr(module, "quantization_keep", ())
    }


def is_kept(name: str, kept: set[str]) -> bool:
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


def resolve_layer_map(model: nn.Module, spec: QuantSchemeSpec, key: str = "quant") -> LayerPlan:  # noqa: PLR0912 one check per error it names
    """The scheme of every Linear in ``model`` under ``spec``; :class:`RecipeError` naming ``key`` for a
    pattern that matches nothing, a group size that does not divide a layer, or a tied head."""
    names = linear_names(model)
    kept = always_kept(model)
    candidates = [n for n in names if not is_kept(n, kept)]
    plan = LayerPlan(group_size=spec.group_size)
    plan.kept_parameters = [
        n for n, _ in model.named_parameters() if is_kept(n, kept) and not any(n.startswith(m + ".") for m in names)
    ]
    for n in names:
        if is_kept(n, kept):
            plan.assignments[n], plan.reasons[n] = "keep", "always kept (declared by the model's quantization_keep)"
    for pattern, scheme in spec.layers.items():
        hits = [n for n in names if _matches(pattern, n)]
        where = f"{key}.layers['{pattern}']"
        if not hits:
            others = [n for n, _ in model.named_modules() if n and _matches(pattern, n)]
            extra = (
                f"; it matches only non-Linear modules ({', '.join(others[:3])}): only Linear layers are quantized"
                if others
                else ""
            )
            raise RecipeError(
                f"{where}: the pattern matches no Linear module of {type(model).__name__}{extra}; "
                f"closest module names: {', '.join(_closest(pattern, names))}"
            )
        free = [n for n in hits if n in candidates and n not in plan.assignments]
        if not free:
            if all(is_kept(n, kept) for n in hits):
                raise RecipeError(
                    f"{where}: the pattern matches only {', '.join(hits[:3])}, which are always kept in "
                    f"full precision (the model declares them in quantization_keep, e.g. Parcae's "
                    f"A_log, dt_bias and B)"
                )
            raise RecipeError(
                f"{where}: every module it matches ({', '.join(hits[:3])}{', ...' if len(hits) > 3 else ''}) "
                "was already assigned by an earlier pattern (the first match wins): reorder or remove it"
            )
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
        raise RecipeError(
            f"{key}.layers: '{head}' shares its weight with the input embeddings (tied); quantizing it "
            "would untie them: keep it, or untie the model first"
        )
    for n, scheme in plan.quantized().items():
        linear = model.get_submodule(n)
        if spec.group_size and scheme != "float8" and linear.in_features % spec.group_size:
            raise RecipeError(
                f"{key}.group_size = {spec.group_size}: module '{n}' has in_features {linear.in_features}, "
                "not a multiple; choose a group size that divides it, or keep that module"
            )
    return plan


def check_hardware(plan: LayerPlan, key: str = "quant", device=None) -> None:
    """RecipeError when a scheme of ``plan`` cannot be converted on this machine (before any compute)."""
    for scheme in plan.schemes():
        problem = hardware_problem(scheme, device)
        if problem:
            raise RecipeError(f"{key}: scheme '{scheme}' cannot run here: {problem}")
