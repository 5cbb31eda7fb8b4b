"""The ``quant:`` stage a training recipe runs around its Trainer (QAT or PTQ of the model it trains)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from distill.config import QuantSection
from distill.quantize import (
    check_hardware,
    convert,
    fake_quant_hook,
    model_bytes,
    prepare_qat,
    ptq,
    resolve_layer_map,
    save_quantized,
    set_fake_quant,
)
from recipes.quant_report import quant_report


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

    def finish(
        self,
        model: nn.Module,
        evaluate_fn: Callable[[nn.Module], dict],
        out_dir: str | Path,
        metric: str,
        tokenizer=None,
        exclude_from_bytes: Iterable[str] = (),
        is_main_process: bool = True,
    ) -> dict | None:
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
        rows.append(
            {
                "model": "qat" if sec.mode == "qat" else "ptq",
                **self._measure(quantized, evaluate_fn, exclude_from_bytes),
            }
        )
        for r in rows:
            r["variant"] = sec.scheme if not sec.layers else f"{sec.scheme} + map"
        if is_main_process:
            save_quantized(
                quantized, out / "model_quantized", self.plan, {"mode": sec.mode, "scheme": sec.scheme}, tokenizer
            )
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
