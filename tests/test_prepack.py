"""serve_eval.prepack: a Linear served from oneDNN's prepacked weight computes the float Linear (up to
summation order), keeps the original Parameters, falls back where gradients flow, and converts every
fp32 Linear of a target; the setting resolves per device and reads bare YAML on / off."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from serve_eval.prepack import PrepackedLinear, available, prepack_linears, resolve

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no oneDNN Linear ops")


@pytest.mark.parametrize("shape", [(1, 37), (8, 64), (3, 5, 96), (0, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_prepacked_linear_computes_the_float_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(shape[-1], 50, bias=bias)
    packed = PrepackedLinear(linear)
    assert packed.weight is linear.weight and packed.bias is linear.bias
    x = torch.randn(*shape)
    with torch.no_grad():
        y, ref = packed(x), linear(x)
    assert y.shape == ref.shape and torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    columns = torch.randn(shape[-1], 6).T  # a non-contiguous input
    with torch.no_grad():
        assert torch.allclose(packed(columns), linear(columns), rtol=1e-5, atol=1e-5)
    for copied in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):  # e.g. to a worker process
        with torch.no_grad():
            assert torch.equal(copied(x), y)
    x.requires_grad_(True)  # training reads the Parameters through F.linear: gradients flow
    packed(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None


def test_prepack_converts_every_fp32_linear_of_a_model():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8).half())
            self.lm_head = nn.Linear(8, 32, bias=False)

    toy = Toy()
    assert prepack_linears(toy) == {"kernel": "onednn", "linears": 2, "weight_bytes": (8 * 8 + 32 * 8) * 4}
    assert isinstance(toy.layer[0], PrepackedLinear) and isinstance(toy.lm_head, PrepackedLinear)
    assert type(toy.layer[2]) is nn.Linear  # fp16: not what the kernel was measured for


def test_the_setting_resolves_per_device():
    assert resolve("auto", "cpu") == "on" and resolve("auto", "cuda") == "off" and resolve("off", "cpu") == "off"
    with pytest.raises(ValueError, match="decoding.prepack = 'on'.*cuda"):
        resolve("on", "cuda")


def test_the_recipe_setting_reads_bare_yaml_on_and_off():
    from recipes.registry import load_recipe

    assert load_recipe("eval_testbed", []).decoding.prepack == "auto"
    assert load_recipe("eval_testbed", ["decoding.prepack=off"]).decoding.prepack == "off"
    assert load_recipe("eval_testbed", ["decoding.prepack=on"]).decoding.prepack == "on"
