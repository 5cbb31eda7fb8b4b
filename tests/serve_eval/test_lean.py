"""The lean target forward (serve_eval.cpu.lean) computes bitwise what the model's own forward computes:
logits and features, one row and batches, chains and tree masks, full and quantized caches, on
Llama and Qwen3 targets; it steps aside wherever it would not."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from distill.base.features import FeatureCapture
from distill.config import ModelConfig
from distill.models import build_causal_lm
from serve_eval.cpu import CpuBackend, attention, prepack
from serve_eval.cpu.lean import LeanForward, lean_forward
from serve_eval.forward import TargetForward
from serve_eval.kv import kv_quant
from serve_eval.session import TargetSession


def _target(arch: str, **changes):
    torch.manual_seed(0)
    cfg = ModelConfig(
        **{
            "arch": arch,
            "hidden_size": 64,
            "num_layers": 3,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 96,
            **changes,
        }
    )
    return build_causal_lm(cfg, 300).eval()


LEAN = CpuBackend(prepack="off", int8="off", compile="off")


def _pair(make):
    """The same session twice: the CPU backend's lean walk, and the model's forward (the walk switched off)."""
    lean, module = make(LEAN), make(LEAN.with_lean(False))
    assert isinstance(lean.run.walk, LeanForward) and module.run.walk is None
    return lean, module


def _same(a, b) -> None:
    assert torch.equal(a[0], b[0])  # logits, bit for bit
    if a[1] is not None or b[1] is not None:
        fa, fb = (f if isinstance(f, torch.Tensor) else f.aux for f in (a[1], b[1]))
        assert torch.equal(fa, fb)
        if not isinstance(a[1], torch.Tensor):
            assert torch.equal(a[1].last, b[1].last)


@pytest.mark.parametrize(
    "arch, kv, served",
    [
        ("llama", "full", False),
        ("qwen3", "full", False),
        ("llama", "int8", False),
        ("qwen3", "full", True),
        ("llama", "full", True),
    ],
)
def test_one_row_steps_equal_the_models_forward(arch, kv, served):
    """A prefill, decode steps, a verified chain cut back, and a tree: the same bits either way,
    with transformers' kernels and (``served``) with the prepacked Linears and our attention kernel."""
    target = _target(arch)
    if served:
        if not (prepack.available() and attention.available()):
            pytest.skip("the C++ kernels do not build here")
        prepack.prepack_linears(target, "on")
        attention.use_attention(target)
    capture = FeatureCapture(target, [0, 2])
    lean, module = _pair(lambda backend: TargetSession(target, capture, kv_quant(kv), backend))
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(0, 300, (1,), generator=gen)
    _same(lean.prefill([first]), module.prefill([first]))
    for n in (13, 1, 1, 6, 3):  # steps: a long one, decode steps, verified chains
        ids = torch.randint(0, 300, (1, n), generator=gen)
        _same(lean.step(ids), module.step(ids))
        kept = [n - 2 if n > 1 else n]  # a rejected tail
        lean.keep(kept)
        module.keep(kept)
    ids, depths = torch.randint(0, 300, (1, 4), generator=gen), torch.tensor([[0, 1, 1, 2]])
    ancestors = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    _same(lean.step_tree(ids, depths, ancestors), module.step_tree(ids, depths, ancestors))
    prompt = torch.randint(0, 300, (11,), generator=gen)  # a prefill that reads the last position's logits only
    lean, module = _pair(lambda backend: TargetSession(target, capture, kv_quant(kv), backend))
    last = lean.prefill([prompt])
    _same(last, module.prefill([prompt]))
    assert last[0].shape == (1, 300)
    if served:  # the panel kernel computes each row apart: the same bits as the whole prefill's last row
        from serve_eval.kv import inplace_cache

        with torch.inference_mode():  # the model's own forward over the whole prompt, as a plain session runs it
            whole, _ = TargetForward(target)(prompt[None], torch.arange(11)[None], None, inplace_cache(target.config))
        assert torch.equal(last[0], whole[0, -1:])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batch_steps_equal_the_models_forward(arch):
    """Ragged rows, padded steps where rows read different counts, rows keeping different counts."""
    target = _target(arch)
    capture = FeatureCapture(target, [1])
    lean, module = _pair(lambda backend: TargetSession(target, capture, backend=backend))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (length,), generator=gen) for length in (9, 4, 12)]
    _same(lean.prefill(prompts), module.prefill(prompts))
    for _ in range(4):
        ids, counts = torch.randint(0, 300, (3, 5), generator=gen), torch.randint(1, 6, (3,), generator=gen)
        _same(lean.step(ids, counts), module.step(ids, counts))
        kept = torch.minimum(counts, torch.randint(1, 6, (3,), generator=gen))
        lean.keep(kept)
        module.keep(kept)


def test_a_model_without_logits_to_keep_gives_each_rows_own_logits():
    """A prefill's ``logits_at`` on a target whose forward computes every position's logits (no
    ``logits_to_keep``): each row's logits at its own position, as the whole forward has them."""
    target = _target("llama")

    class Plain(torch.nn.Module):  # a causal LM that knows nothing of logits_to_keep
        def __init__(self):
            super().__init__()
            self.inner, self.config = target, target.config

        def forward(self, input_ids, position_ids=None, attention_mask=None, cache=None, use_cache=True):
            return self.inner(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                cache=cache,
                use_cache=use_cache,
            )

    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(7)[None].expand(2, 7)
    run = TargetForward(Plain())
    assert run.walk is None and not run.keeps
    with torch.inference_mode():
        full, _ = run(ids, positions, None, DynamicCache(config=target.config))
        last, _ = run(ids, positions, None, DynamicCache(config=target.config), torch.tensor([6, 3]))
    assert last.shape == (2, 1, 300)
    assert torch.equal(last[:, 0], torch.stack([full[0, 6], full[1, 3]]))


def test_the_lean_forward_steps_aside_where_it_would_not_reproduce_the_model():
    target = _target("llama")
    assert lean_forward(target) is not None
    assert lean_forward(_target("llama").train()) is None  # training: dropout and the rest
    handle = target.model.layers[1].mlp.register_forward_hook(lambda *_: None)
    assert lean_forward(target) is None  # a hook it would not run
    handle.remove()
    assert lean_forward(_target("parcae", num_layers=4)) is None  # a model it does not walk
    sliding = _target("qwen3")
    sliding.config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    assert lean_forward(sliding) is None
