"""Drafters in bf16, at tiny size on a CPU: under autocast (accelerate's ``mixed_precision: bf16``) and cast
whole to bf16 (DeepSpeed's ``bf16: enabled``: bf16 weights, no autocast). Each kind (DFlash, DSpark,
EAGLE-3), with and without ``qk_norm``, with the dense mask SDPA reads and the flex-attention BlockMask,
trains a step: a finite loss close to the fp32 one, finite gradients on every trainable weight, and
queries, keys and values of one dtype at the attention kernel."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F

from distill.base.features import FeatureCapture
from distill.config.sections import DrafterSection, ModelConfig
from distill.drafter_eval import build_drafter
from distill.models import build_causal_lm
from drafters import kind_of, layers

from ..conftest import reset_accelerate

BF16 = torch.bfloat16
VOCAB, SEQ, MASK_ID = 64, 32, 1
ANCHORS = torch.tensor([[2, 9, 20, 25], [4, 15, 22, 26]])
CASES = [
    (kind, qk_norm, mask) for kind in ("dflash", "dspark") for qk_norm in (False, True) for mask in ("dense", "flex")
]
CASES += [("eagle3", qk_norm, "dense") for qk_norm in (False, True)]  # EAGLE-3's test-time-training mask is dense only


@pytest.fixture(scope="module")
def target():
    """A random 3-layer target whose logits are far from uniform (weights of std 0.5), so losses depend on
    what the drafter computes."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        initializer_range=0.5,
    )
    return build_causal_lm(cfg, VOCAB).eval()


@pytest.fixture(scope="module")
def batch(target):
    """``(input_ids, aux, last)`` in fp32: a batch of 2 random sequences and the target's features of layers 0-2."""
    ids = torch.randint(2, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    feats = FeatureCapture(target, [0, 1, 2])(ids)
    return ids, feats.aux, feats.last


def make_drafter(target, kind: str, qk_norm: bool, mask: str):
    """A drafter of ``kind`` for ``target`` whose trainable weights are drawn with std 0.15 (attention far
    from uniform: its dtype shows in the loss), training mode."""
    section = DrafterSection(
        kind=kind, block_size=4, num_anchors=4, markov_rank=8, qk_norm=qk_norm, target_layer_ids=[0, 1, 2]
    )
    drafter = build_drafter(section, target, "tiny", MASK_ID).train()
    drafter.config.mask_implementation = mask
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return drafter


def anchors(drafter) -> dict:
    """The forward's anchors keyword: fixed blocks for block drafters, none for EAGLE-3."""
    return {} if kind_of(drafter) == "eagle3" else {"anchors": ANCHORS}


def step(drafter, ids, aux, last):
    """One forward and backward; the loss."""
    drafter.zero_grad()
    loss = drafter(ids, aux, last, **anchors(drafter)).loss
    loss.backward()
    return loss


@pytest.fixture
def kernel_dtypes(monkeypatch):
    """The dtypes ``(q, k, v)`` of every call of SDPA and of flex attention, recorded as the kernels are
    called (before autocast casts anything). Flex attention's CPU backward, which torch refuses, is let
    through to its eager reference implementation, so that the BlockMask path's gradients can be checked here."""
    seen = []

    def spy(kernel):
        def call(q, k, v, *args, **kwargs):
            seen.append((q.dtype, k.dtype, v.dtype))
            return kernel(q, k, v, *args, **kwargs)

        return call

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy(F.scaled_dot_product_attention))
    monkeypatch.setattr(layers, "flex_attention", spy(layers.flex_attention))
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    return seen


def fp32_loss(drafter, ids, aux, last) -> float:
    with torch.no_grad():
        return drafter(ids, aux, last, **anchors(drafter)).loss.item()


def assert_trained_in_bf16(drafter, loss, reference: float, seen: list) -> None:
    """A finite loss within 5% of ``reference``, finite gradients on every trainable weight, and one dtype,
    bf16, for queries, keys and values at every attention call."""
    assert torch.isfinite(loss) and abs(loss.item() - reference) <= 5e-2 * abs(reference), (loss.item(), reference)
    trainable = [(name, p) for name, p in drafter.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and torch.isfinite(p.grad).all() for _, p in trainable), [
        name for name, p in trainable if p.grad is None or not torch.isfinite(p.grad).all()
    ]
    assert seen and set(seen) == {(BF16, BF16, BF16)}, set(seen)


@pytest.mark.parametrize("kind,qk_norm,mask", CASES)
def test_autocast_bf16_trains_each_drafter(target, batch, kernel_dtypes, kind, qk_norm, mask):
    """Under ``torch.autocast("cpu", bf16)`` (accelerate's bf16 on a CPU) a step of each drafter: the
    per-head norms return fp32 queries and keys while ``v_proj`` returns bf16 values; they meet in bf16 at
    the kernel (flex attention, which autocast does not cover, gets what SDPA gets)."""
    drafter = make_drafter(target, kind, qk_norm, mask)
    reference = fp32_loss(drafter, *batch)
    kernel_dtypes.clear()
    with torch.autocast("cpu", dtype=BF16):
        loss = step(drafter, *batch)
    assert_trained_in_bf16(drafter, loss, reference, kernel_dtypes)


@pytest.mark.parametrize("kind,qk_norm,mask", CASES)
def test_whole_bf16_drafter_trains_from_features_of_either_dtype(target, batch, kernel_dtypes, kind, qk_norm, mask):
    """A drafter cast whole to bf16 (what DeepSpeed's ``bf16: enabled`` trains, without autocast) trains a
    step from bf16 target features (``target.dtype: bfloat16``) and from fp32 ones (an fp32 target's, or a
    feature cache, which batches read in fp32): the features are read in the weights' dtype."""
    drafter = make_drafter(target, kind, qk_norm, mask)
    reference = fp32_loss(drafter, *batch)
    ids, aux, last = batch
    low = copy.deepcopy(drafter).to(BF16)
    for features in ((aux.to(BF16), last.to(BF16)), (aux, last)):
        kernel_dtypes.clear()
        loss = step(low, ids, *features)
        assert loss.dtype == torch.float32  # the loss terms are computed in fp32 from bf16 logits
        assert_trained_in_bf16(low, loss, reference, kernel_dtypes)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_fp32_drafter_reads_bf16_features(target, batch, kind):
    """An fp32 drafter without autocast (``mixed_precision: no``) trains from a bf16 target's features
    (``target.dtype: bfloat16``, online): the same loss and gradients as from those features cast to fp32
    first, to the bit."""
    drafter = make_drafter(target, kind, True, "dense")
    ids, aux, last = batch
    stored = aux.to(BF16), last.to(BF16)
    loss = step(drafter, ids, *stored)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    grads = [p.grad.clone() for p in trainable]
    assert torch.equal(loss, step(drafter, ids, *(t.float() for t in stored)))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, trainable))


def test_bf16_drafter_rotates_by_fp32_angles(target):
    """Casting a drafter to bf16 leaves its rotary embedding's inverse frequencies fp32: cos and sin at
    positions up to 4,000 are the fp32 drafter's, rounded to bf16 (a bf16 ``inv_freq`` puts them off by
    up to 1 by position 1,000). Decoding's cached table reads the same frequencies."""
    drafter = make_drafter(target, "dflash", True, "dense")
    rotary = drafter.layers[0].attn.rotary
    positions = torch.tensor([[0, 1, 100, 1000, 4000]])
    x = torch.zeros(1, dtype=BF16)
    cos, sin = rotary(x.float(), positions)
    drafter.to(BF16)
    assert rotary.inv_freq.dtype == rotary.original_inv_freq.dtype == torch.float32
    low_cos, low_sin = rotary(x, positions)
    assert low_cos.dtype == BF16
    assert torch.equal(low_cos, cos.to(BF16)) and torch.equal(low_sin, sin.to(BF16))
    table_cos, _ = drafter.layers[0].attn.rope_table(positions, BF16)
    assert torch.equal(table_cos, cos.to(BF16))
    drafter.float()  # and back: the frequencies are the ones the module was built with
    assert torch.equal(rotary(x.float(), positions)[0], cos)


def train_two_steps(out, target_dir, monkeypatch) -> tuple[dict, list[float]]:
    """Two steps of ``recipes/train_drafter.py`` with a ``qk_norm`` DFlash drafter under ``train.mixed_precision:
    bf16``, online features from the fp32 target: (summary, losses). The trainer's matmul-peak measurement
    (for MFU only) is stubbed: a 2,048^2 bf16 product on one CPU core takes tens of seconds, and it measures four."""
    import distill.trainer
    from recipes import train_drafter

    from ..conftest import drafter_recipe

    monkeypatch.setattr(distill.trainer, "measured_matmul_peak", lambda *args: 1e10)
    recipe = drafter_recipe(
        out,
        target_dir,
        "dflash",
        {"qk_norm": True},
        max_steps=2,
        eval_every=2,
        save_every=2,
        log_every=1,
        eval_batches=1,
        mixed_precision="bf16",
    )
    summary = train_drafter.main(recipe)
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, [m["train/loss"] for m in logs if "train/loss" in m]


def assert_trained_two_steps(summary: dict, losses: list[float], kernel_dtypes: list) -> None:
    """Two finite losses, an evaluation, and the drafter's attention in bf16 (the target's, online, runs in fp32)."""
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
    assert summary["steps"] == 2 and 1.0 <= summary["val_simulated_tau"] <= 4.0
    assert all(q == k == v for q, k, v in kernel_dtypes) and (BF16, BF16, BF16) in kernel_dtypes, set(kernel_dtypes)


def test_train_drafter_recipe_trains_under_bf16_autocast(tmp_path, tiny_target_dir, monkeypatch, kernel_dtypes):
    """``train.mixed_precision: bf16`` on a CPU without DeepSpeed: accelerate wraps the drafter's forward in
    bf16 autocast (queries and keys out of ``qk_norm`` in fp32, values in bf16, which meet in bf16)."""
    reset_accelerate()
    assert_trained_two_steps(*train_two_steps(tmp_path, tiny_target_dir, monkeypatch), kernel_dtypes)
    assert json.loads((tmp_path / "provenance.json").read_text())["strategy"]["mixed_precision"] == "bf16"


@pytest.mark.slow
@pytest.mark.xdist_group("distributed")
def test_train_drafter_recipe_trains_under_deepspeed_bf16(
    tmp_path, tiny_target_dir, monkeypatch, kernel_dtypes, request
):
    """The same recipe under DeepSpeed ZeRO-2 (in process, ``accelerate_configs/cpu_zero2.yaml``) with
    ``bf16``: the engine casts the drafter's weights to bf16 and runs it without autocast, and the fp32
    target's features are read in bf16."""
    request.getfixturevalue("deepspeed_env")(2)  # test_deepspeed_semantics' fixture: a one-rank launch's environment
    summary, losses = train_two_steps(tmp_path, tiny_target_dir, monkeypatch)
    assert_trained_two_steps(summary, losses, kernel_dtypes)
    strategy = json.loads((tmp_path / "provenance.json").read_text())["strategy"]
    assert strategy["model_wrapper"] == "DeepSpeedEngine" and strategy["mixed_precision"] == "bf16", strategy
