"""Quantization (distill/quantize.py, recipes/quantize.py): layer maps, QAT prepare/convert, PTQ, sizes,
save/load, the quantized drafter in the decoding loop, and the training-recipe and quantize-recipe stages."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from distill import quantize as Q
from distill.config import ModelConfig, QuantSchemeSpec, QuantSection, RecipeError
from distill.models import build_causal_lm
from recipes import quant_report as R
from recipes.quant_stage import QuantStage
from recipes.registry import parse_recipe

from ..conftest import tiny_lm_recipe

ATTN = r"re:model\.layers\.\d+\.self_attn\..*"
MLP = r"re:model\.layers\.\d+\.mlp\..*"


def tiny_lm(seed: int = 0, vocab: int = 256):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return build_causal_lm(cfg, vocab).eval()


def weight_bits(module) -> int | None:
    """Bits of a fake-quantized Linear's weights (None when it is not fake-quantized)."""
    fq = getattr(module, "weight_fake_quantizer", None)
    return None if fq is None else int(str(fq.config.dtype).removeprefix("torch.int"))


# --------------------------------------------------------------------------------------------------
# The layer map
# --------------------------------------------------------------------------------------------------


def test_prepare_inserts_fake_quant_exactly_where_the_map_says():
    model = tiny_lm()
    spec = QuantSchemeSpec(scheme="w4", layers={ATTN: "8da8w", "model.layers.1.mlp.down_proj": "keep", MLP: "w2"})
    plan = Q.prepare_qat(model, spec)
    fq = Q.fake_quantized_modules(model)
    for name in Q.linear_names(model):
        module = model.get_submodule(name)
        if name in ("lm_head", "model.layers.1.mlp.down_proj"):
            assert name not in fq and type(module) is nn.Linear, name  # kept: a plain Linear
        elif ".self_attn." in name:
            assert weight_bits(module) == 8 and module.activation_fake_quantizer is not None, name  # int8 + int8 acts
        else:
            assert weight_bits(module) == 2 and module.activation_fake_quantizer is None, name  # weight-only int2
    assert set(fq) == set(plan.quantized()) and len(fq) == 13
    assert plan.assignments["lm_head"] == "keep" and "output head" in plan.reasons["lm_head"]
    # the first matching pattern wins: down_proj of layer 1 was claimed by the exact name before MLP's regex
    assert plan.reasons["model.layers.1.mlp.down_proj"] == "layers['model.layers.1.mlp.down_proj']"
    # embeddings and norms are never touched
    assert type(model.model.embed_tokens) is nn.Embedding


def test_mixed_precision_map_applies_each_scheme_after_convert():
    model = tiny_lm()
    spec = QuantSchemeSpec(scheme="w4", layers={ATTN: "8da8w", "*.mlp.down_proj": "w2", "lm_head": "8da4w"})
    plan = Q.prepare_qat(model, spec)
    Q.convert(model, spec, plan)
    for name in Q.linear_names(model):
        w = model.get_submodule(name).weight
        expected = {
            "8da8w": (torch.int8, "int8_asym_per_token"),
            "w2": (torch.int2, None),
            "w4": (torch.int4, None),
            "8da4w": (torch.int4, "int8_asym_per_token"),
        }[plan.assignments[name]]
        assert (w.target_dtype, w.activation_quantization) == expected, name
    assert plan.assignments["lm_head"] == "8da4w" and plan.assignments["model.layers.0.mlp.gate_proj"] == "w4"
    assert plan.assignments["model.layers.0.mlp.down_proj"] == "w2"


@pytest.mark.parametrize(
    "layers, bad, message",
    [
        (
            {"re:.*atn.*": "w4"},
            "re:.*atn.*",
            "matches no Linear module.*closest module names: model.layers.0.self_attn",
        ),
        ({"model.layers.0.mlp": "w4"}, "model.layers.0.mlp", "only non-Linear modules \\(model.layers.0.mlp\\)"),
        (
            {"*.mlp.*": "w4", "model.layers.0.mlp.up_proj": "w2"},
            "model.layers.0.mlp.up_proj",
            "already assigned by an earlier pattern",
        ),
        (
            {"model.layers.0.mlp.gate_prj": "w4"},
            "model.layers.0.mlp.gate_prj",
            "closest module names: model.layers.0.mlp.gate_proj",
        ),
    ],
)
def test_a_bad_pattern_is_a_clear_error(layers, bad, message):
    with pytest.raises(RecipeError, match=message) as err:
        Q.resolve_layer_map(tiny_lm(), QuantSchemeSpec(layers=layers), key="quant")
    assert str(err.value).startswith(f"quant.layers['{bad}']: ")


def test_group_size_and_tied_head_are_checked_against_the_model():
    with pytest.raises(
        RecipeError, match="quant.group_size = 48: module 'model.layers.0.self_attn.q_proj' has in_features 64"
    ):
        Q.resolve_layer_map(tiny_lm(), QuantSchemeSpec(group_size=48))
    tied = build_causal_lm(ModelConfig(hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128), 256)
    with pytest.raises(RecipeError, match="'lm_head' shares its weight with the input embeddings"):
        Q.resolve_layer_map(tied, QuantSchemeSpec(layers={"lm_head": "w4"}))
    assert Q.resolve_layer_map(tied, QuantSchemeSpec()).assignments["lm_head"] == "keep"


class StandInInjection(nn.Module):
    """Parcae's diagonal injection's parameter names, plus a Linear named B (the guard must catch both)."""

    quantization_keep = ("A_log", "dt_bias", "B")  # declared as Parcae's DiagonalInjection declares them

    def __init__(self, d: int = 64):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(d))
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.B = nn.Linear(d, d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.proj(x * torch.exp(-self.dt_bias.exp() * self.A_log.exp()) + self.B(x))


class StandInParcae(nn.Module):
    def __init__(self):
        super().__init__()
        self.inject = StandInInjection()
        self.core = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))

    def forward(self, x):
        return self.core(self.inject(x))


def test_parcae_dynamics_are_always_kept():
    model = StandInParcae()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    spec = QuantSchemeSpec(scheme="w2", layers={"re:.*": "8da4w"})
    plan = Q.prepare_qat(model, spec)
    assert plan.assignments == {"inject.B": "keep", "inject.proj": "8da4w", "core.0": "8da4w", "core.2": "8da4w"}
    assert set(plan.kept_parameters) == {"inject.A_log", "inject.dt_bias"}
    Q.convert(model, spec, plan)
    assert set(Q.quantized_layers(model)) == {"inject.proj", "core.0", "core.2"}
    for name in ("inject.A_log", "inject.dt_bias", "inject.B.weight"):
        p = dict(model.named_parameters())[name]
        assert type(p.data) is torch.Tensor and torch.equal(p, before[name]), name
    with pytest.raises(RecipeError, match="always kept in full precision"):
        Q.resolve_layer_map(StandInParcae(), QuantSchemeSpec(layers={"inject.B": "w4"}))
    ptq_model = StandInParcae()
    Q.ptq(ptq_model, spec)
    assert type(ptq_model.inject.B.weight.data) is torch.Tensor


# --------------------------------------------------------------------------------------------------
# QAT numerics
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["8da4w", "8da8w", "w4", "w2"])
def test_converted_outputs_match_fake_quantized_outputs(scheme):
    model = tiny_lm()
    spec = QuantSchemeSpec(scheme=scheme)
    plan = Q.prepare_qat(model, spec)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake = model(input_ids=ids).logits
        Q.set_fake_quant(model, False)
        full = model(input_ids=ids).logits
        Q.set_fake_quant(model, True)
        Q.convert(model, spec, plan)
        real = model(input_ids=ids).logits
    assert len(Q.quantized_layers(model)) == 14
    scale = fake.abs().max()
    assert (real - fake).abs().max() <= 1e-4 * scale, scheme  # convert computes what QAT trained through
    assert (full - fake).abs().max() > 1e-3 * scale, scheme  # and fake quantization really changed the function


def test_loss_falls_under_qat_and_delayed_fake_quant_follows_the_step():
    model = tiny_lm(vocab=64).train()
    section = QuantSection(mode="qat", scheme="w2", fake_quant_after_steps=5)
    stage = QuantStage(section, model)
    stage.prepare()
    fq = list(Q.fake_quantized_modules(model).values())
    assert fq and not any(m.weight_fake_quantizer.enabled for m in fq)  # step 0 < 5: full precision
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (16, 33), generator=gen)
    data[:, 1::2] = (data[:, 0::2][:, :16] * 7 + 3) % 64  # learnable: every odd token follows from the one before
    losses = []
    for step in range(40):
        stage.before_step(step)
        assert all(m.weight_fake_quantizer.enabled == (step >= 5) for m in fq)
        logits = model(input_ids=data[:, :-1]).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), data[:, 1:].reshape(-1))
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < sum(losses[5:10]) / 5 - 0.3, losses  # it learns through 2-bit fake quantization
    # an exact resume rebuilds the switch from the step alone
    fresh = tiny_lm(vocab=64)
    again = QuantStage(section, fresh)
    again.prepare()
    again.before_step(12)
    assert all(m.weight_fake_quantizer.enabled for m in Q.fake_quantized_modules(fresh).values())


def test_trainer_calls_the_step_hook_with_the_restored_step_after_a_resume(tmp_path):
    import numpy as np
    from accelerate import Accelerator

    from distill.config import OptimConfig, TrainConfig
    from distill.data import PackedWindows
    from distill.lm import lm_loss
    from distill.trainer import Trainer

    data = PackedWindows(np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint16), 16)
    seen = []

    def run(max_steps):
        cfg = TrainConfig(max_steps=max_steps, micro_batch_size=2, eval_every=100, save_every=3, log_every=1)
        trainer = Trainer(
            accelerator=Accelerator(cpu=True),
            model=tiny_lm(),
            train_cfg=cfg,
            optim_cfg=OptimConfig(),
            output_dir=tmp_path,
            data=data,
            loss_fn=lm_loss,
            flops_per_token=1.0,
            evaluate_fn=lambda m: {"val_loss": 1.0},
            before_step=seen.append,
        )
        trainer.fit()

    run(3)
    run(5)
    assert seen == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------------------------------
# Schemes, hardware, sizes, save/load
# --------------------------------------------------------------------------------------------------


def test_scheme_names_and_gpu_schemes_are_validated_in_config():
    base = {"recipe": "train_lm", "output_dir": "x"}
    with pytest.raises(RecipeError, match="key 'quant.scheme'.*'int4' is not a quantization scheme.*did you mean 'w4'"):
        parse_recipe({**base, "quant": {"scheme": "int4"}})
    with pytest.raises(
        RecipeError, match="layer pattern 'lm_head'.*'kep' is not a quantization scheme.*did you mean 'keep'"
    ):
        parse_recipe({**base, "quant": {"layers": {"lm_head": "kep"}}})
    with pytest.raises(RecipeError, match="not a valid regular expression"):
        parse_recipe({**base, "quant": {"layers": {"re:(": "w4"}}})
    with pytest.raises(RecipeError, match="int4_weight_only needs group_size 32, 64, 128 or 256"):
        parse_recipe({**base, "quant": {"scheme": "int4_weight_only", "group_size": 48}})
    with pytest.raises(RecipeError, match="unknown key 'quant.schem'; did you mean 'quant.scheme'"):
        parse_recipe({**base, "quant": {"schem": "w4"}})
    for scheme in ("float8", "int4_weight_only", "8da3w", "w8"):
        assert (
            parse_recipe({**base, "quant": {"mode": "qat", "scheme": scheme, "group_size": 128}}).quant.scheme == scheme
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_gpu_schemes_prepare_on_cpu_but_refuse_to_convert_naming_the_key():
    model = tiny_lm()
    spec = QuantSchemeSpec(scheme="int4_weight_only", group_size=32)
    plan = Q.prepare_qat(model, spec)  # QAT prepare of the GPU int4 scheme works anywhere
    assert len(Q.fake_quantized_modules(model)) == 14
    with pytest.raises(RecipeError, match="scheme 'int4_weight_only' cannot run here: .*CUDA.*use w4"):
        Q.convert(model, spec, plan)
    with pytest.raises(RecipeError, match="variants.fp8: scheme 'float8' cannot run here: float8 needs a GPU"):
        Q.check_hardware(Q.resolve_layer_map(tiny_lm(), QuantSchemeSpec(scheme="float8")), key="variants.fp8")
    with pytest.raises(RecipeError, match="quant: scheme 'float8' cannot run here"):
        QuantStage(QuantSection(mode="qat", scheme="float8"), tiny_lm())


def test_model_bytes_count_packed_codes_and_scales():
    model = tiny_lm()
    full = Q.model_bytes(model)
    tensors = list(model.parameters()) + list(model.buffers())  # buffers: the rotary tables
    assert full["bytes"] == full["packed_bytes"] == 4 * sum(t.numel() for t in tensors)
    linear = sum(model.get_submodule(n).weight.numel() for n in Q.linear_names(model) if n != "lm_head")
    sizes = {}
    for scheme in ("w8", "w4", "w2"):
        q = copy.deepcopy(model)
        Q.ptq(q, QuantSchemeSpec(scheme=scheme))
        sizes[scheme] = Q.model_bytes(q)
        bits = int(scheme[1])
        scales = (4 + 1) * linear // 32  # an fp32 scale and an int8 zero point per group of 32
        assert sizes[scheme]["packed_bytes"] == full["bytes"] - 4 * linear + linear * bits // 8 + scales, scheme
        assert sizes[scheme]["bytes"] == full["bytes"] - 3 * linear + scales  # codes stored one per int8 here
    assert sizes["w2"]["packed_bytes"] < sizes["w4"]["packed_bytes"] < sizes["w8"]["packed_bytes"] < full["bytes"]


def test_save_and_load_round_trip(tmp_path):
    model = tiny_lm()
    spec = QuantSchemeSpec(scheme="w4", layers={ATTN: "8da8w"})
    plan = Q.prepare_qat(model, spec)
    Q.convert(model, spec, plan)
    Q.save_quantized(model, tmp_path / "q", plan, {"scheme": "w4"})
    assert not (tmp_path / "q.tmp").exists()
    record = json.loads((tmp_path / "q" / Q.PLAN_FILE).read_text())
    assert record["plan"]["layers"] == plan.assignments and record["torchao"]
    loaded = Q.load_quantized(tmp_path / "q")
    assert Q.quantized_layers(loaded) == Q.quantized_layers(model) and len(Q.quantized_layers(model)) == 14
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert Q.model_bytes(loaded) == Q.model_bytes(model)
    # config.json carries a TorchAoConfig, so transformers loads the quantized weights as they are
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert Q.quantized_layers(hf) == Q.quantized_layers(model)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, model(input_ids=ids).logits)


def test_quantized_drafter_saves_reloads_and_stays_lossless_in_the_decoding_loop(tmp_path):
    from distill.config import DrafterSection
    from distill.drafter_eval import build_drafter
    from serve_eval.loop import plain_generate, speculative_generate

    target = tiny_lm()
    target.requires_grad_(False)
    drafter = build_drafter(
        DrafterSection(num_anchors=2, target_layer_ids=[0, 1]), target, "tiny", mask_token_id=255
    ).eval()
    spec = QuantSchemeSpec(scheme="8da4w")
    plan = Q.ptq(drafter, spec)
    assert plan.assignments["lm_head"] == "keep" and plan.assignments["fc"] == "8da4w"
    Q.save_quantized(drafter, tmp_path / "d", plan)
    loaded = Q.load_quantized(tmp_path / "d")
    assert Q.quantized_layers(loaded) == Q.quantized_layers(drafter) and "layers.0.attn.q_proj" in Q.quantized_layers(
        loaded
    )
    assert not loaded.lm_head.weight.requires_grad
    from transformers import AutoModel

    assert Q.quantized_layers(AutoModel.from_pretrained(tmp_path / "d")) == Q.quantized_layers(drafter)
    prompt = torch.randint(0, 255, (12,), generator=torch.Generator().manual_seed(1))
    base, _ = plain_generate(target, prompt, 24)
    ours, stats = speculative_generate(target, loaded, prompt, 24)
    assert ours == base and stats.target_forwards <= 24  # the target is untouched: output is lossless


def test_recovered_and_the_report(tmp_path):
    assert R.recovered(full=1.6, ptq_value=1.8, qat_value=1.65) == pytest.approx(0.75)
    assert R.recovered(full=1.3, ptq_value=1.1, qat_value=1.2) == pytest.approx(0.5)
    assert R.recovered(1.0, 1.0, 1.0) is None
    rows = [
        {"variant": "-", "model": "full", "packed_bytes": 100, "val_loss": 1.0},
        {"variant": "w4", "model": "ptq", "packed_bytes": 30, "val_loss": 1.2},
        {"variant": "w4", "model": "qat", "packed_bytes": 30, "val_loss": 1.1},
        {"variant": "w2", "model": "ptq", "packed_bytes": 20, "val_loss": 1.5},
        {"variant": "w2", "model": "qat", "packed_bytes": 20, "val_loss": 1.2, "lossless": True},
    ]
    R.quant_report(rows, tmp_path, "val_loss", ["variant", "model", "packed_bytes", "val_loss", "lossless"], "t")
    md = (tmp_path / "quant_report.md").read_text()
    assert "| w2 | qat | 20 | 1.2 | yes |" in md
    assert json.loads((tmp_path / "quant_report.json").read_text())["rows"] == rows
    assert (tmp_path / "quant_report.png").stat().st_size > 1000


# --------------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_trained_lm(tmp_path_factory):
    """A 2-layer LM trained 16 steps with QAT (w2 from step 8): the train_lm quant stage, and the
    model the quantize recipe starts from."""
    from recipes import train_lm

    from ..conftest import reset_accelerate

    out = tmp_path_factory.mktemp("qat-lm")
    recipe = tiny_lm_recipe(
        out,
        train={"max_steps": 16, "eval_every": 16, "save_every": 8},
        quant={"mode": "qat", "scheme": "w2", "fake_quant_after_steps": 8, "layers": {"re:.*self_attn\\..*": "8da8w"}},
    )
    reset_accelerate()
    summary = train_lm.main(parse_recipe(recipe))
    reset_accelerate()
    return out, summary


def test_train_lm_with_qat_writes_a_reloadable_quantized_model(tiny_trained_lm):
    out, summary = tiny_trained_lm
    rows = {r["model"]: r for r in summary["quant"]["rows"]}
    assert set(rows) == {"qat_fake_quant", "qat"}
    assert rows["qat"]["val_loss"] == pytest.approx(rows["qat_fake_quant"]["val_loss"], abs=1e-4)
    assert rows["qat"]["packed_bytes"] < rows["qat_fake_quant"]["packed_bytes"]
    losses = [
        json.loads(line)["train/loss"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if "train/loss" in line
    ]
    assert losses[-1] < losses[0]
    loaded = Q.load_quantized(out / "model_quantized")
    kinds = dict(Q.quantized_layers(loaded))
    assert len(kinds) == 14 and "lm_head" not in kinds  # tied head kept
    assert loaded.get_submodule("model.layers.0.self_attn.q_proj").weight.target_dtype == torch.int8
    assert loaded.get_submodule("model.layers.0.mlp.up_proj").weight.target_dtype == torch.int2
    assert (out / "quant_report.md").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "model")  # the full-precision (QAT-trained) weights load as usual


def test_quantize_recipe_tables_full_ptq_and_qat(tiny_trained_lm, tmp_path):
    from recipes import quantize

    from ..conftest import reset_accelerate

    src, _ = tiny_trained_lm
    recipe = {
        "recipe": "quantize",
        "output_dir": str(tmp_path / "q"),
        "model": str(src / "model"),
        "variants": {"w2": {"scheme": "w2"}, "mixed": {"scheme": "w4", "layers": {MLP: "w2"}}},
        "measure": {"prompts": 1, "prompt_tokens": 8, "max_new_tokens": 4},
        "min_gap": 0.0,
        "data": {"source": "stdlib", "seq_len": 64, "max_documents": 40, "val_fraction": 0.1},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "train": {
            "max_steps": 3,
            "micro_batch_size": 4,
            "eval_every": 3,
            "eval_batches": 2,
            "save_every": 3,
            "torch_threads": 1,
        },
    }
    reset_accelerate()
    result = quantize.main(parse_recipe(recipe))
    report = json.loads((tmp_path / "q" / "quant_report.json").read_text())
    kinds = [(r["variant"], r["model"]) for r in report["rows"]]
    assert kinds == [
        ("-", "full"),
        ("-", "full_ft"),
        ("w2", "ptq"),
        ("w2", "ptq_ft"),
        ("w2", "qat"),
        ("mixed", "ptq"),
        ("mixed", "ptq_ft"),
        ("mixed", "qat"),
    ]
    rows = dict(zip(kinds, report["rows"]))
    assert rows[("w2", "ptq")]["packed_bytes"] < rows[("-", "full")]["packed_bytes"]
    assert rows[("w2", "qat")]["packed_bytes"] == rows[("w2", "ptq")]["packed_bytes"]
    assert all(r["tokens_per_s"] > 0 and r["speed_vs_full"] > 0 for r in report["rows"])
    w2 = result["summary"][0]
    expected = R.recovered(
        rows[("-", "full_ft")]["val_loss"], rows[("w2", "ptq_ft")]["val_loss"], rows[("w2", "qat")]["val_loss"]
    )
    assert w2["variant"] == "w2" and w2["recovered"] == pytest.approx(expected, abs=1e-3)
    assert json.loads((tmp_path / "q" / "summary.json").read_text())["summary"] == result["summary"]
    # a gap below min_gap is noise: no ratio is reported
    rows_json = report["rows"]
    assert (
        quantize.variant_summary("w2", parse_recipe(recipe).variants["w2"], rows_json, "val_loss", False, min_gap=1e9)[
            "recovered"
        ]
        is None
    )
    assert (tmp_path / "q" / "quant_report.png").exists() and "| w2 | qat |" in (
        tmp_path / "q" / "quant_report.md"
    ).read_text()
    assert Q.quantized_layers(Q.load_quantized(tmp_path / "q" / "mixed" / "model_quantized"))


def test_quantize_recipe_refuses_a_dead_pattern_before_any_compute(tiny_trained_lm, tmp_path, capsys):
    from recipes.cli import main

    from ..conftest import write_recipe

    src, _ = tiny_trained_lm
    path = write_recipe(
        tmp_path / "r.yaml",
        {
            "recipe": "quantize",
            "output_dir": str(tmp_path / "q"),
            "model": str(src / "model"),
            "variants": {"bad": {"layers": {"re:.*mpl.*": "w2"}}},
        },
    )
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "variants.bad.layers['re:.*mpl.*']: the pattern matches no Linear module" in err
    assert "closest module names: model.layers.0.mlp." in err and not (tmp_path / "q").exists()


def test_train_drafter_with_qat_on_the_shipped_target(tmp_path):
    """A few QAT steps of a DFlash drafter against the shipped testbed target: the converted drafter is
    saved, reloads, and decodes losslessly beside the untouched target."""
    from distill.config import TargetConfig
    from distill.models import load_target
    from recipes import train_drafter
    from serve_eval.loop import plain_generate, speculative_generate

    from ..conftest import reset_accelerate

    recipe = {
        "recipe": "train_drafter",
        "output_dir": str(tmp_path / "d"),
        "target": {"path": "testbed"},
        "drafter": {"kind": "dflash", "num_anchors": 2, "block_size": 4},
        "data": {"source": "stdlib", "seq_len": 32, "max_documents": 12, "val_fraction": 0.2},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "train": {
            "max_steps": 3,
            "micro_batch_size": 2,
            "eval_every": 3,
            "eval_batches": 1,
            "save_every": 3,
            "torch_threads": 1,
        },
        "quant": {
            "mode": "qat",
            "scheme": "8da4w",
            "fake_quant_after_steps": 1,
            "layers": {"fc": "w8", "re:layers\\.\\d+\\.mlp\\..*": "w2"},
        },
    }
    dry = train_drafter.main(parse_recipe(recipe), dry_run=True)
    assert dry["quant"]["counts"] == {"w8": 1, "8da4w": 4, "w2": 3, "keep": 1}
    reset_accelerate()
    summary = train_drafter.main(parse_recipe(recipe))
    reset_accelerate()
    rows = {r["model"]: r for r in summary["quant"]["rows"]}
    assert rows["qat"]["val_simulated_tau"] == pytest.approx(rows["qat_fake_quant"]["val_simulated_tau"], abs=1e-6)
    assert rows["qat"]["packed_bytes"] < rows["qat_fake_quant"]["packed_bytes"]
    drafter = Q.load_quantized(tmp_path / "d" / "model_quantized")
    assert len(Q.quantized_layers(drafter)) == 8 and drafter.fc.weight.target_dtype == torch.int8
    target, tok = load_target(TargetConfig(path="testbed"))
    prompt = tok("def parse_args(argv):\n    ", return_tensors="pt")["input_ids"][0]
    base, _ = plain_generate(target, prompt, 16)
    ours, _ = speculative_generate(target, drafter, prompt, 16)
    assert ours == base


def test_a_parcae_model_quantizes_keeps_its_dynamics_and_generates(tmp_path):
    from distill.config import ParcaeSection
    from serve_eval.loop import plain_generate

    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="parcae",
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        parcae=ParcaeSection(mean_recurrence=2, backprop_depth=1),
    )
    model = build_causal_lm(cfg, 256).eval()
    dynamics = {
        n: p.detach().clone() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in ("A_log", "dt_bias", "B")
    }
    assert {n.rsplit(".", 1)[-1] for n in dynamics} == {"A_log", "dt_bias", "B"}
    spec = QuantSchemeSpec(scheme="w4", layers={"re:.*mlp\\.(gate|up|down)_proj": "w2"})
    plan = Q.prepare_qat(model, spec)
    assert set(dynamics) <= set(plan.kept_parameters)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake = model(input_ids=ids).logits
        Q.convert(model, spec, plan)
        real = model(input_ids=ids).logits
    assert (real - fake).abs().max() <= 1e-4 * fake.abs().max()
    for n, before in dynamics.items():
        p = dict(model.named_parameters())[n]
        assert type(p.data) is torch.Tensor and torch.equal(p, before), n
    Q.save_quantized(model, tmp_path / "p", plan)
    loaded = Q.load_quantized(tmp_path / "p")
    assert type(loaded).__name__ == "ParcaeForCausalLM" and Q.quantized_layers(loaded) == Q.quantized_layers(model)
    prompt = ids[0]
    assert plain_generate(loaded, prompt, 8)[0] == plain_generate(model, prompt, 8)[0]


def test_ptq_stage_quantizes_a_copy_and_reports_full_vs_ptq(tmp_path):
    model = tiny_lm()
    stage = QuantStage(QuantSection(mode="ptq", scheme="w2"), model)
    stage.prepare()  # nothing to prepare for PTQ
    assert not Q.fake_quantized_modules(model)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))

    def evaluate(m):
        logits = m(input_ids=ids[:, :-1]).logits
        return {"val_loss": nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1)).item()}

    result = stage.finish(model, evaluate, tmp_path, "val_loss")
    rows = {r["model"]: r for r in result["rows"]}
    assert set(rows) == {"full", "ptq"} and rows["ptq"]["val_loss"] != rows["full"]["val_loss"]
    assert rows["ptq"]["packed_bytes"] < rows["full"]["packed_bytes"]
    assert not Q.quantized_layers(model)  # the trained model itself stays in full precision
    assert len(Q.quantized_layers(Q.load_quantized(tmp_path / "model_quantized"))) == 14
    assert "| full |" in (tmp_path / "quant_report.md").read_text()
