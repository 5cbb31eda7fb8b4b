"""serve_eval.cpu.int8: a Linear served from int8 weight codes and int8 activations computes what its
codes say (the int32 sum is exact), stays close to the full-precision Linear, and converts a drafter's
heads (restricted or not) or all its Linears; an int8 drafter decodes losslessly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from drafters.vocab import RestrictedHead
from serve_eval.budget import Budget
from serve_eval.cpu import int8 as int8_module
from serve_eval.cpu.int8 import Int8Linear, Int8RestrictedHead, int8_drafter
from serve_eval.loop import plain_generate, speculative_generate

from ..conftest import KINDS, MAX_NEW


def _torch_arithmetic(int8: Int8Linear, x: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """The module docstring's arithmetic in torch ops, each row's step its largest magnitude / ``levels``."""
    rows = x.reshape(-1, x.shape[-1])
    step = rows.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny).div_(levels)
    y = torch._int_mm(torch.round(rows / step).to(torch.int8), int8.codes).float().mul_(step).mul_(int8.scale)
    return (y if int8.bias is None else y + int8.bias).view(*x.shape[:-1], -1)


@pytest.mark.parametrize("shape", [(1, 37), (8, 64), (3, 5, 96), (19, 320)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_its_codes_exactly_and_close_to_the_float_linear(shape, bias, isa):
    """Per-row activation codes times the weight codes, rescaled: ``torch._int_mm`` and our operator
    compute exactly the bits of that arithmetic in torch ops (8-bit activations; 7-bit on the AVX2
    kernel), within rounding of the same arithmetic in float64 and a few percent of the float Linear."""
    torch.manual_seed(0)
    linear = nn.Linear(shape[-1], 50, bias=bias)
    x = torch.randn(*shape)
    reference = Int8Linear.from_linear(linear, kernel="int_mm")
    assert reference.kernel == "int_mm" and not hasattr(reference, "panels")
    assert (
        reference.codes.dtype == torch.int8
        and reference.codes.shape == (shape[-1], 50)
        and reference.codes.abs().max() == 127
    )
    y = reference(x)
    assert y.shape == (*shape[:-1], 50) and torch.equal(y, _torch_arithmetic(reference, x))
    rows = x.reshape(-1, shape[-1]).double()
    step = rows.abs().amax(1, keepdim=True) / 127
    exact = (torch.round(rows / step) @ reference.codes.double()) * step * reference.scale.double()
    exact += linear.bias.double() if bias else 0
    assert torch.allclose(y.reshape(-1, 50).double(), exact, rtol=1e-5, atol=1e-5)
    full = linear(x)
    assert (y - full).norm() / full.norm() < 0.02 and not torch.equal(y, full)  # two roundings of ~0.4% each

    ours = Int8Linear.from_linear(linear)
    assert ours.kernel == int8_module.native_op() is not None, "this machine builds the C++ operator (g++, AVX2)"
    served = ours(x)
    assert torch.equal(served, _torch_arithmetic(ours, x, 63 if isa == "avx2" else 127))
    assert (served - full).norm() / full.norm() < 0.03


@pytest.fixture(params=["avx2", "avx512-vnni"])
def isa(request):
    """Our operator served on each instruction set (VNNI where this CPU has it), put back as served after."""
    int8_module.native_op()  # built and loaded
    try:
        if torch.ops.draftsmith_int8.allow_vnni(request.param != "avx2") != request.param:
            pytest.skip(f"this CPU has no {request.param}")
        yield request.param
    finally:
        torch.ops.draftsmith_int8.allow_vnni(True)


def test_a_row_of_the_operator_is_its_own_and_a_row_of_zeros_is_the_bias(isa):
    """A row's outputs do not depend on the rows beside it in the call (each has its own step; the sums
    are exact), whichever tile it falls in; a row of zeros is not multiplied and gives the bias."""
    torch.manual_seed(1)
    linear = nn.Linear(64, 40)
    int8 = Int8Linear.from_linear(linear)
    x = torch.randn(11, 64) * torch.logspace(-2, 2, 11)[:, None]  # rows of very different sizes
    x[[3, 7]] = 0
    y = int8(x)
    assert torch.equal(y[[3, 7]], linear.bias.detach().expand(2, -1))
    for r in range(11):
        assert torch.equal(int8(x[r : r + 1]), y[r : r + 1]), r


def test_a_compiled_graph_holds_the_operator_and_bad_shapes_are_refused():
    from serve_eval.cpu.compiled import available

    torch.manual_seed(0)
    int8 = Int8Linear.from_linear(nn.Linear(48, 40))
    fallback = Int8Linear.from_linear(nn.Linear(48, 40), kernel="int_mm")  # where the operator cannot be built
    x = torch.randn(5, 48)
    if available():
        for module in (int8, fallback):
            assert torch.equal(torch.compile(module, fullgraph=True)(x), module(x)), module.kernel
    with pytest.raises(RuntimeError, match="does not fit panels"):
        torch.ops.draftsmith_int8.linear(torch.randn(5, 40), int8.panels, int8.colsum, int8.scale, None, 40)


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
    assert head_only == {
        "which": "head",
        "linears": 1,
        "weight_bytes": 32 * 8 * 4,
        "int8_bytes": 32 * 8 + 32 * 4,
        "kernel": int8_module.native_op(),
    }
    toy = Toy()
    assert int8_drafter(toy, "all")["linears"] == 2
    assert isinstance(toy.layer[0], Int8Linear) and isinstance(toy.lm_head, Int8Linear)
    with pytest.raises(ValueError, match="no Linear"):
        int8_drafter(nn.Sequential(nn.ReLU()), "head")


def test_the_recipe_setting_reads_a_bare_yaml_off():
    from recipes.registry import load_recipe

    assert load_recipe("eval_testbed", ["decoding.cpu.int8=off"]).decoding.cpu.int8 == "off"
    assert load_recipe("eval_testbed", []).decoding.cpu.int8 == "auto"


@pytest.mark.parametrize("kind", [*KINDS, "causal_lm"])
def test_int8_drafters_stay_lossless(target_and_prompts, trained_drafters, kind):
    """A drafter served with int8 weights (serve_eval.cpu.int8; a causal LM: the target itself, its head in
    int8; block drafters with fused products) is another drafter: greedy chains and trees still equal plain decoding."""
    import copy

    from serve_eval.cpu.int8 import Int8Linear, int8_drafter

    target, tok, prompts = target_and_prompts
    drafter = copy.deepcopy(target if kind == "causal_lm" else trained_drafters[kind])
    if kind in ("dflash", "dspark"):  # served as the eval serves them: fused products, then int8 codes
        drafter.fuse_projections()
    record = int8_drafter(drafter, "head" if kind == "causal_lm" else "all")
    assert record["int8_bytes"] < record["weight_bytes"] / 3 and isinstance(drafter.lm_head, Int8Linear)
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        assert speculative_generate(target, drafter, prompt, MAX_NEW)[0] == reference
        assert (
            speculative_generate(target, drafter, prompt, MAX_NEW, mode="tree", budget=Budget({1: 1.0, 16: 1.3}))[0]
            == reference
        )
