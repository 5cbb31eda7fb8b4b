"""serve_eval.cpu.prepack: a Linear served from a weight repacked once (our AVX2 panels, oneDNN's layout)
computes the float Linear (up to summation order), the panel kernel gives a row the same bits whatever
rows share the call, the original Parameters stay, gradients fall back to F.linear, every fp32 Linear
of a target converts; the setting resolves per device and reads bare YAML on / off; a prepacked target
decodes losslessly in chains, trees and batches."""

from __future__ import annotations

import copy
import pickle
import shutil

import pytest
import torch
from torch import nn

from serve_eval.budget import Budget
from serve_eval.cpu import prepack
from serve_eval.cpu.prepack import PANEL_ROWS, PrepackedLinear, available, prepack_linears, resolve
from serve_eval.loop import plain_generate, speculative_generate

from ..conftest import KINDS, MAX_NEW

KERNELS = [
    pytest.param("panels", marks=pytest.mark.skipif(not prepack.panels_available(), reason="no AVX2 or no compiler")),
    pytest.param("onednn", marks=pytest.mark.skipif(not prepack.onednn_available(), reason="no oneDNN Linear ops")),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(1, 37), (8, 64), (3, 5, 96), (0, 16), (PANEL_ROWS + 1, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_prepacked_linear_computes_the_float_linear(kernel, shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(shape[-1], 50, bias=bias)  # 50 outputs: the last 16-column panel is partly padding
    packed = PrepackedLinear(linear, kernel)
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


@pytest.mark.skipif(not prepack.panels_available(), reason="no AVX2 or no compiler")
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call():
    torch.manual_seed(0)
    packed = PrepackedLinear(nn.Linear(320, 100), "panels")
    x = torch.randn(40, 320)
    with torch.no_grad():
        alone = torch.cat([packed(x[i : i + 1]) for i in range(40)])
        # tiles of 6 rows, the last one or two across panels, AVX-512's of up to 12: every split
        for rows in range(1, 41):
            assert torch.equal(packed(x[:rows]), alone[:rows])
        threads = torch.get_num_threads()
        try:  # panels split over threads: each panel is one thread's, so the bits stay
            torch.set_num_threads(2)
            wide = PrepackedLinear(nn.Linear(320, 40 * 16), "panels")
            many = wide(x)
            torch.set_num_threads(1)
            assert torch.equal(wide(x), many)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.skipif(not prepack.panels_available(), reason="no AVX2 or no compiler")
def test_only_rows_computes_the_listed_rows_alone_and_zeros_elsewhere():
    torch.manual_seed(0)
    packed = PrepackedLinear(nn.Linear(320, 100), "panels")
    x = torch.randn(3, 5, 320)  # a batch of 3 rows verifying 5 tokens each, padded
    rows = torch.tensor([0, 1, 5, 10, 11, 12, 13])  # row 0 reads 2 tokens, row 1 one, row 2 four
    with torch.no_grad():
        full = packed(x)
        with prepack.only_rows(rows, 15):
            y = packed(x)
            other = packed(x[:2])  # another size: every row computed
    flat = y.reshape(15, 100)
    assert torch.equal(flat[rows], full.reshape(15, 100)[rows])  # the same bits as computed among all 15
    padding = torch.ones(15, dtype=torch.bool).index_fill(0, rows, False)
    assert torch.equal(flat[padding], torch.zeros(15 - len(rows), 100))
    assert torch.equal(other, full[:2])
    with pytest.raises(RuntimeError, match="row 15 of 15"):
        torch.ops.draftsmith_fp32.linear(x, packed.packed, 100, None, torch.tensor([15]))


@pytest.mark.skipif(not prepack.panels_available(), reason="no AVX2 or no compiler")
def test_streamed_weights_give_the_same_bits(monkeypatch):
    """One- and two-row products that stream the weight past the caches (a target larger than the
    last-level cache) compute exactly what the cached ones do: only the prefetch hint differs."""
    torch.manual_seed(0)
    linear = nn.Linear(320, 100)
    cached, streamed = PrepackedLinear(linear, "panels"), PrepackedLinear(linear, "panels", stream=True)
    with torch.no_grad():
        for rows in (1, 2, 3, 8, 13):
            x = torch.randn(rows, 320)
            assert torch.equal(streamed(x), cached(x))
    monkeypatch.setattr(prepack, "last_level_cache_bytes", lambda: 1024)  # a cache smaller than the weights
    model = nn.Sequential(nn.Linear(320, 100))
    assert prepack_linears(model, "panels")["streamed"] and model[0].stream


@pytest.mark.skipif(not prepack.panels_available(), reason="no AVX2 or no compiler")
def test_fp16_valued_weights_pack_in_fp16_and_give_the_same_bits():
    """A weight whose every value is an fp16 one (a checkpoint saved in fp16, served in fp32) is packed
    in fp16, half the bytes, and every kernel path (tiles, streamed tiles, wide tiles, only some rows)
    computes exactly what the fp32 panels compute; a weight with one value that is not stays fp32."""
    torch.manual_seed(0)
    linear = nn.Linear(320, 100)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.half().float())
    half = PrepackedLinear(linear, "panels")
    assert half.packed.dtype == torch.float16
    full = torch.ops.draftsmith_fp32.pack(linear.weight.detach())
    bias = linear.bias.detach()
    with torch.no_grad():
        for rows in (1, 2, 3, 5, 6, 7, 8, 13, 16, 25):
            x = torch.randn(rows, 320)
            for stream in (False, True):
                expected = torch.ops.draftsmith_fp32.linear(x, full, 100, bias, None, stream)
                assert torch.equal(torch.ops.draftsmith_fp32.linear(x, half.packed, 100, bias, None, stream), expected)
        x, listed = torch.randn(3, 5, 320), torch.tensor([0, 1, 5, 10, 11])
        with prepack.only_rows(listed, 15):
            assert torch.equal(half(x), torch.ops.draftsmith_fp32.linear(x, full, 100, bias, listed))
        linear.weight[3, 7] += 1e-4  # no longer an fp16 value
    assert PrepackedLinear(linear, "panels").packed.dtype == torch.float32


def test_the_last_level_cache_is_read_from_sysfs_or_unknown(tmp_path, monkeypatch):
    """The size of the highest cache level sysfs lists (entries it cannot read skipped), None where it lists
    none; on this machine, a size wherever its own sysfs lists levels."""
    sysfs, real_path = "/sys/devices/system/cpu/cpu0/cache", prepack.Path
    listed = any((folder / "level").exists() for folder in real_path(sysfs).glob("index*"))
    assert (prepack.last_level_cache_bytes() is not None) == listed
    for name, level, size in [
        ("index0", "1", "32K"),
        ("index1", "1", "48K"),
        ("index2", "2", "1280K"),
        ("index3", "3", "30M"),
        ("index4", "4", "?"),
        ("index5", None, "64M"),
    ]:  # index4, index5: unreadable
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
        if level is not None:
            (tmp_path / name / "level").write_text(level + "\n")
    monkeypatch.setattr(prepack, "Path", lambda path: tmp_path if path == sysfs else real_path(path))
    assert prepack.last_level_cache_bytes() == 30 * 2**20
    for name in ("index3", "index4", "index5"):
        shutil.rmtree(tmp_path / name)
    assert prepack.last_level_cache_bytes() == 1280 * 2**10
    for name in ("index0", "index1", "index2"):
        shutil.rmtree(tmp_path / name)
    assert prepack.last_level_cache_bytes() is None


@pytest.mark.skipif(not available(), reason="no kernel serves here")
def test_prepack_converts_every_fp32_linear_of_a_model():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8).half())
            self.lm_head = nn.Linear(8, 32, bias=False)

    toy = Toy()
    kernel = "panels" if prepack.panels_available() else "onednn"
    panels = (
        {"panel_bytes": (16 * 8 + 32 * 8) * 4, "fp16_panels": 0} if kernel == "panels" else {}
    )  # random fp32 values: fp32 panels
    assert prepack_linears(toy) == {
        "kernel": kernel,
        "linears": 2,
        "weight_bytes": (8 * 8 + 32 * 8) * 4,
        **panels,
        "streamed": False,
    }
    assert isinstance(toy.layer[0], PrepackedLinear) and isinstance(toy.lm_head, PrepackedLinear)
    assert toy.lm_head.kernel == kernel and not toy.lm_head.stream  # 1.3 KB: they stay cached
    assert type(toy.layer[2]) is nn.Linear  # fp16: not what the kernels were measured for


def test_the_panel_kernel_needs_avx2(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    prepack.panels_available.cache_clear()
    try:
        assert not prepack.panels_available()
    finally:
        monkeypatch.undo()
        prepack.panels_available.cache_clear()


@pytest.mark.skipif(not available(), reason="no kernel serves here")
def test_the_setting_resolves_per_device_to_a_kernel():
    best = "panels" if prepack.panels_available() else "onednn"
    assert resolve("auto", "cpu") == resolve("on", "cpu") == best
    assert resolve("auto", "cuda") == "off" and resolve("off", "cpu") == "off"
    with pytest.raises(ValueError, match="decoding.cpu.prepack = 'on'.*cuda"):
        resolve("on", "cuda")
    with pytest.raises(ValueError, match="decoding.cpu.prepack = 'onednn'.*cuda"):
        resolve("onednn", "cuda")


def test_a_kernel_that_does_not_serve_here_is_refused(monkeypatch):
    monkeypatch.setattr(prepack, "panels_available", lambda: False)
    with pytest.raises(ValueError, match="decoding.cpu.prepack = 'panels'.*AVX2"):
        resolve("panels", "cpu")
    monkeypatch.setattr(prepack, "onednn_available", lambda: False)
    assert resolve("auto", "cpu") == "off"
    with pytest.raises(ValueError, match="decoding.cpu.prepack = 'on': neither"):
        resolve("on", "cpu")


def test_the_recipe_setting_reads_bare_yaml_on_and_off():
    from recipes.registry import load_recipe

    assert load_recipe("eval_testbed", []).decoding.cpu.prepack == "auto"
    assert load_recipe("eval_testbed", ["decoding.cpu.prepack=off"]).decoding.cpu.prepack == "off"
    assert load_recipe("eval_testbed", ["decoding.cpu.prepack=on"]).decoding.cpu.prepack == "on"
    assert load_recipe("eval_testbed", ["decoding.cpu.prepack=onednn"]).decoding.cpu.prepack == "onednn"


@pytest.mark.parametrize("kind", KINDS)
def test_a_prepacked_target_stays_lossless(target_and_prompts, trained_drafters, kind):
    """A target served from weights prepacked once (serve_eval.cpu.prepack: the AVX2 panel kernel where it
    builds, else oneDNN's) is the target both loops decode with: its logits are the float Linears' up to summation order, and greedy chains, trees and
    batches still equal its own plain decoding."""
    import copy

    from serve_eval.cpu import CpuBackend
    from serve_eval.cpu.prepack import panels_available, prepack_linears
    from serve_eval.loop import generate
    from serve_eval.proposers import make_proposer

    target, tok, prompts = target_and_prompts
    packed = copy.deepcopy(target)
    record = prepack_linears(packed)
    assert record["linears"] == 7 * target.config.num_hidden_layers + 1  # q, k, v, o, gate, up, down; the head
    ids = torch.cat(prompts)[None]
    with torch.no_grad():
        assert torch.allclose(packed(ids).logits, target(ids).logits, rtol=1e-4, atol=1e-4)
    drafter = trained_drafters[kind]
    references = [plain_generate(packed, prompt, MAX_NEW)[0] for prompt in prompts]
    for prompt, reference in zip(prompts, references):
        assert speculative_generate(packed, drafter, prompt, MAX_NEW)[0] == reference
        assert (
            speculative_generate(packed, drafter, prompt, MAX_NEW, mode="tree", budget=Budget({1: 1.0, 16: 1.3}))[0]
            == reference
        )
    assert generate(packed, prompts, MAX_NEW, proposer=make_proposer(drafter))[0] == references
    # rows that verify different numbers of tokens: the panel kernel skips the padding (prepack.only_rows)
    backend = CpuBackend(prepack="panels" if panels_available() else "off", int8="off", compile="off")
    K = make_proposer(drafter).block_size

    class Ragged(Budget):  # every step's rows read 1..K tokens, whatever the drafts' confidences
        def choose_rows(self, reaches, top_q=None):
            super().choose_rows(reaches, top_q)
            self.by_rows[-1] = [1 + (self.drafted_steps + r) % K for r in range(len(reaches))]
            return self.by_rows[-1]

    budget = Ragged({1: 1.0, 2: 1.05, 4 * K: 2.5}, min_drafts=10**6)
    assert (
        generate(packed, prompts, MAX_NEW, proposer=make_proposer(drafter), budget=budget, backend=backend)[0]
        == references
    )
    assert any(len(set(step)) > 1 for step in budget.by_rows)
