"""serve_eval.int8: a Linear served from int8 weight codes and int8 activations computes what its
codes say (the int32 sum is exact), stays close to the full-precision Linear, and converts a drafter's
heads (restricted or not) or all its Linears."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from drafters.vocab import RestrictedHead
from serve_eval.int8 import Int8Linear, Int8RestrictedHead, int8_drafter


@pytest.mark.parametrize("shape", [(1, 37), (8, 64), (3, 5, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_its_codes_exactly_and_close_to_the_float_linear(shape, bias):
    """Both kernels: ``torch._int_mm`` computes exactly its per-row arithmetic; fbgemm holds exactly the same
    weight codes and, its rows scaled to peak 1, misses the codes' own product by at most its activation
    rounding (half a step per input, ``a m_r / 2 * sum_i |W_q,oi|``); both stay within a few percent of
    the float Linear."""
    torch.manual_seed(0)
    linear = nn.Linear(shape[-1], 50, bias=bias)
    x = torch.randn(*shape)
    int8 = Int8Linear.from_linear(linear, kernel="int_mm")
    assert int8.kernel == "int_mm" and int8.packed is None
    assert int8.codes.dtype == torch.int8 and int8.codes.shape == (shape[-1], 50) and int8.codes.abs().max() == 127
    y = int8(x)
    # the same arithmetic in float64: per-row activation codes times the weight codes, rescaled
    rows = x.reshape(-1, shape[-1]).double()
    step = rows.abs().amax(1, keepdim=True) / 127
    exact = (torch.round(rows / step) @ int8.codes.double()) * step * int8.scale.double()
    bias64 = linear.bias.double() if bias else torch.zeros(50, dtype=torch.float64)
    exact += bias64
    assert y.shape == (*shape[:-1], 50)
    assert torch.allclose(y.reshape(-1, 50).double(), exact, rtol=1e-5, atol=1e-5)
    full = linear(x)
    assert (y - full).norm() / full.norm() < 0.02  # two roundings of ~0.4% each
    assert not torch.equal(y, full)

    fbgemm = Int8Linear.from_linear(linear)
    assert fbgemm.kernel == "fbgemm", "this torch (2.13, x86) has fbgemm's kernel"
    weight, _ = torch.ops.quantized.linear_unpack(fbgemm.packed)
    assert torch.equal(weight.int_repr(), int8.codes.T) and torch.equal(weight.q_per_channel_scales().float(), int8.scale)
    y = fbgemm(x)
    assert y.shape == (*shape[:-1], 50) and not torch.equal(y, full)
    w_q = int8.codes.double() * int8.scale.double()  # in x out
    peak = rows.abs().amax(1, keepdim=True)
    a = ((rows / peak).max().clamp_min(0) - (rows / peak).min().clamp_max(0)) / 127
    bound = a * peak / 2 * w_q.abs().sum(0) + 1e-4
    assert ((y.reshape(-1, 50).double() - (rows @ w_q + bias64)).abs() <= bound).all()
    assert (y - full).norm() / full.norm() < 0.03  # 7-bit activations, a step per row


def test_the_cpp_operator_is_fbgemms_product_and_the_python_one_serves_without_it(monkeypatch):
    """``draftsmith_int8::linear`` gives exactly ``quantized::linear_dynamic``'s products, eager and in a
    compiled graph; a Linear made where it could not be built (``native_op`` None) computes the same
    numbers through the Python operator, in a graph too. A key nobody registered is a clear error."""
    from serve_eval import int8 as int8_module
    from serve_eval.compiled import available

    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    x = torch.randn(5, 48)
    native = Int8Linear.from_linear(linear)
    assert native.native is int8_module.native_op() is not None, "this machine builds the C++ operator (g++)"
    peak = x.abs().amax(1, keepdim=True)
    direct = torch.ops.quantized.linear_dynamic(x / peak, native.packed, True).mul_(peak) + linear.bias
    assert torch.equal(native(x), direct)
    monkeypatch.setattr(int8_module, "native_op", lambda: None)
    python = Int8Linear.from_linear(linear)
    assert python.native is None and torch.equal(python(x), direct)
    if available():
        for module in (native, python):
            assert torch.allclose(torch.compile(module, fullgraph=True)(x), direct, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="no weight registered under key 12345"):
        torch.ops.draftsmith_int8.linear(x, 12345)


def test_a_restricted_head_keeps_its_rows_and_fill():
    torch.manual_seed(0)
    head = nn.Linear(16, 40, bias=False)
    ids = torch.tensor([1, 5, 6, 30])
    for fill in (float("-inf"), 0.0):
        restricted = RestrictedHead(head, ids, fill=fill)
        int8 = Int8RestrictedHead(restricted)
        x = torch.randn(2, 3, 16)
        y, ref = int8(x), restricted(x)
        others = torch.ones(40, dtype=torch.bool)
        others[ids] = False
        assert torch.equal(y[..., others], ref[..., others])  # the fill, untouched
        assert torch.allclose(y[..., ids], ref[..., ids], rtol=0.05, atol=0.05)


def test_int8_drafter_converts_heads_or_everything():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            self.lm_head = nn.Linear(8, 32, bias=False)

    head_only = int8_drafter(Toy(), "head")
    assert head_only == {"which": "head", "linears": 1, "weight_bytes": 32 * 8 * 4, "int8_bytes": 32 * 8 + 32 * 4,
                         "kernel": "fbgemm", "op": "c++"}
    toy = Toy()
    assert int8_drafter(toy, "all")["linears"] == 2
    assert isinstance(toy.layer[0], Int8Linear) and isinstance(toy.lm_head, Int8Linear)
    with pytest.raises(ValueError, match="no Linear"):
        int8_drafter(nn.Sequential(nn.ReLU()), "head")


def test_the_recipe_setting_reads_a_bare_yaml_off():
    from recipes.registry import load_recipe

    assert load_recipe("eval_testbed", ["decoding.drafter_int8=off"]).decoding.drafter_int8 == "off"
    assert load_recipe("eval_testbed", []).decoding.drafter_int8 == "auto"
