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

Function API (any ``nn.Module`` with Linear layers; a training recipe uses :class:`recipes.quant_stage.QuantStage`)::

    plan = resolve_layer_map(model, spec)          # RecipeError on a dead pattern, before any compute
    prepare_qat(model, spec, plan)                 # fake quantization where the plan says, nowhere else
    set_fake_quant(model, step >= after)           # delayed fake quantization
    convert(model, spec, plan)                     # real quantized weights
    ptq(model, spec, plan)                         # the baseline: quantize without training
    model_bytes(model), save_quantized(...), load_quantized(...)

Modules: ``schemes`` (torchao configs, bits, hardware), ``plan`` (the per-layer plan), ``apply``
(QAT, conversion, PTQ), ``storage`` (sizes, save, load). The report and the training stage live
with the recipes that write and run them (:mod:`recipes.quant_report`, :mod:`recipes.quant_stage`).
"""

from .apply import (
    convert,
    fake_quant_enabled,
    fake_quant_hook,
    fake_quantized_modules,
    prepare_qat,
    ptq,
    quantized_layers,
    set_fake_quant,
)
from .plan import LayerPlan, always_kept, check_hardware, linear_names, resolve_layer_map
from .schemes import base_config, hardware_problem, scheme_bits, scheme_family
from .storage import (
    PLAN_FILE,
    QUANTIZED_FILE,
    load_quantized,
    model_bytes,
    save_quantized,
    transformers_quantization_config,
)

__all__ = [
    "convert",
    "fake_quant_enabled",
    "fake_quant_hook",
    "fake_quantized_modules",
    "prepare_qat",
    "ptq",
    "quantized_layers",
    "set_fake_quant",
    "LayerPlan",
    "always_kept",
    "check_hardware",
    "linear_names",
    "resolve_layer_map",
    "base_config",
    "hardware_problem",
    "scheme_bits",
    "scheme_family",
    "PLAN_FILE",
    "QUANTIZED_FILE",
    "load_quantized",
    "model_bytes",
    "save_quantized",
    "transformers_quantization_config",
]
