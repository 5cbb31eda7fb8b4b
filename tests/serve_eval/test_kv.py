"""The quantized KV cache (serve_eval.kv): rounding within half a step, one fixed quantized model
whatever the chunking, the loop's cache calls (crop, row selection, tree moves) on codes, the in-place
cache against transformers' own, and decoding over a quantized cache as lossless as over its plain decoding."""

from __future__ import annotations

import pytest
import torch

from serve_eval.budget import Budget
from serve_eval.kv import InPlaceLayer, KVQuant, QuantizedLayer, RowWrites, dequantize, quantize, rotation
from serve_eval.loop import generate, plain_generate, speculative_generate
from serve_eval.proposers import make_proposer
from serve_eval.session import TargetSession

from ..conftest import KINDS, MAX_NEW

FORMATS = [KVQuant("int8"), KVQuant("fp8"), KVQuant("int4"), KVQuant("int4", rotate=True)]


def states(*shape: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    x[..., 5] *= 30  # an outlier channel, as keys have
    return x


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_integer_codes_round_to_within_half_a_step(fmt):
    spec = KVQuant(fmt, group=16)
    x = states(2, 3, 7, 64)
    stored = quantize(x, spec)
    error = (dequantize(stored, spec) - x).abs().unflatten(-1, (-1, 16))
    step = stored[1].float()[..., None]
    assert bool((error <= step * 0.5 + 1e-3 * step).all())
    assert stored[0].dtype == (torch.int8 if fmt == "int8" else torch.uint8)
    assert stored[0].shape[-1] == (64 if fmt == "int8" else 32)  # int4: two codes a byte


def test_fp8_codes_keep_a_relative_error_of_e4m3():
    spec = KVQuant("fp8")
    x = states(4, 64)
    error = (dequantize(quantize(x, spec), spec) - x).abs()
    group_max = x.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True).expand(-1, -1, 32).flatten(-2)
    assert bool((error <= x.abs() * 2**-4 + group_max * 2**-9 + 1e-6).all())  # 3 mantissa bits; subnormals


def test_rotation_is_orthogonal_and_spreads_outliers():
    R = rotation(64)
    assert torch.allclose(R @ R.T, torch.eye(64), atol=1e-5)
    assert torch.equal(R, rotation(64))  # fixed: the same on every call
    x = states(1000, 64)
    for spec in (KVQuant("int8"), KVQuant("int4")):
        plain = (dequantize(quantize(x, spec), spec) - x).norm()
        rotated = (dequantize(quantize(x @ R, spec), spec) @ R.T - x).norm()
        assert rotated < 0.8 * plain


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: f"{s.format}{'-rot' if s.rotate else ''}")
def test_a_position_reads_the_same_whatever_the_chunking(spec):
    """Written one token at a time or in blocks of any size, each position reads back identical."""
    keys, values = states(2, 3, 40, 64, seed=1), states(2, 3, 40, 64, seed=2)
    reads = []
    for chunks in ([1] * 40, [7, 1, 12, 20], [40]):
        layer, start = QuantizedLayer(spec), 0
        for n in chunks:
            k, v = layer.update(keys[:, :, start : start + n], values[:, :, start : start + n])
            start += n
        reads.append((k, v))
    for k, v in reads[1:]:
        assert torch.equal(k, reads[0][0]) and torch.equal(v, reads[0][1])
    assert (reads[0][0] - keys).norm() < (0.15 if spec.format == "int4" else 0.02) * keys.norm()


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: f"{s.format}{'-rot' if s.rotate else ''}")
def test_crops_row_selection_and_moves_act_on_codes_as_on_floats(spec):
    """The loop's cache calls on a quantized layer equal the same calls on a float layer holding the
    dequantized states: crop (rejected drafts), row selection (finished rows), move (a tree's path)."""
    keys, values = states(3, 2, 30, 64, seed=3), states(3, 2, 30, 64, seed=4)
    quantized, reference = QuantizedLayer(spec), InPlaceLayer()
    k, v = quantized.update(keys[:, :, :20], values[:, :, :20])
    reference.update(k, v)
    for layer in (quantized, reference):
        layer.move(8, torch.tensor([12, 15, 19]))
        layer.crop(-9)
        layer.batch_select_indices(torch.tensor([2, 0]))
    k, v = quantized.update(keys[[2, 0], :, 20:], values[[2, 0], :, 20:])
    assert quantized.get_seq_length() == 21
    assert torch.equal(k[:, :, :11], reference.keys) and torch.equal(v[:, :, :11], reference.values)
    fresh = QuantizedLayer(spec)
    expect = fresh.update(keys[[2, 0], :, 20:], values[[2, 0], :, 20:])
    assert torch.equal(k[:, :, 11:], expect[0]) and torch.equal(v[:, :, 11:], expect[1])


@pytest.mark.parametrize(
    "spec", [None, *FORMATS], ids=lambda s: "full" if s is None else f"{s.format}{'-rot' if s.rotate else ''}"
)
def test_rows_written_at_slots_of_their_own_and_put_from_another_layer(spec):
    """A batch's cache calls (:mod:`serve_eval.session`): each row writing at slots of its own
    (``write_at``) and a row starting over as another layer's row (``put_rows``, longer than the
    buffers: they grow). Every row then holds its own tokens in order from slot 0, read as a fresh
    layer given just those tokens reads them."""
    make = InPlaceLayer if spec is None else (lambda: QuantizedLayer(spec))
    keys, values = states(3, 2, 80, 64, seed=5), states(3, 2, 80, 64, seed=6)
    layer = make()
    layer.update(keys[:, :, :10], values[:, :, :10])
    layer.write_at = RowWrites(torch.tensor([10, 4, 7]), 13)
    layer.update(keys[:, :, 10:13], values[:, :, 10:13])
    layer.write_at = None
    other = make()
    other.update(keys[:, :, 10:], values[:, :, 10:])  # 70 tokens: more than the layer's 64 slots
    layer.put_rows(torch.tensor([1]), other, torch.tensor([2]))
    assert layer.get_seq_length() == 70
    k, v = layer.read()
    for row, (source, tokens) in enumerate([(0, [*range(13)]), (2, [*range(10, 80)]), (2, [*range(7), 10, 11, 12])]):
        fresh = make()
        expect = fresh.update(keys[source : source + 1, :, tokens], values[source : source + 1, :, tokens])
        assert torch.equal(k[row : row + 1, :, : len(tokens)], expect[0]) and torch.equal(
            v[row : row + 1, :, : len(tokens)], expect[1]
        )


def test_cache_bytes_per_token_follow_the_format():
    keys = states(1, 4, 10, 64)
    full = InPlaceLayer()
    full.update(keys, keys)
    assert full.nbytes() == 2 * 4 * 10 * 64 * 4  # float32
    for fmt, per_value in (("int8", 1 + 2 / 32), ("fp8", 1 + 2 / 32), ("int4", 0.5 + 4 / 32)):
        layer = QuantizedLayer(KVQuant(fmt))
        layer.update(keys, keys)
        assert layer.nbytes() == 2 * 4 * 10 * 64 * per_value


def test_a_head_narrower_than_a_group_is_one_group():
    layer = QuantizedLayer(KVQuant("int4"))
    k, _ = layer.update(states(1, 2, 5, 8), states(1, 2, 5, 8))
    assert layer.spec.group == 8 and k.shape == (1, 2, 5, 8)


def test_the_in_place_cache_holds_what_a_dynamic_cache_holds(target_and_prompts):
    """The loop's target cache (serve_eval.kv) against transformers' own under the calls the loop
    makes: appends across buffer growth, crops, row selection; the same keys, values and logits."""
    from transformers import DynamicCache

    from serve_eval.kv import inplace_cache

    target = target_and_prompts[0]
    gen = torch.Generator().manual_seed(0)
    ours, theirs = inplace_cache(target.config), DynamicCache(config=target.config)
    length = 0
    for n, crop, rows in [(3, 0, None), (40, 5, None), (1, 0, [0, 2]), (70, 30, None), (8, 7, [1])]:
        batch = theirs.layers[0].keys.shape[0] if length else 3
        ids = torch.randint(0, target.config.vocab_size, (batch, n), generator=gen)
        pos = torch.arange(length, length + n)[None].expand(batch, -1)
        a = target(input_ids=ids, position_ids=pos, cache=ours, use_cache=True).logits
        b = target(input_ids=ids, position_ids=pos, cache=theirs, use_cache=True).logits
        assert torch.allclose(a, b, atol=1e-5)
        for cache in (ours, theirs):
            cache.crop(-crop)
            if rows is not None:
                for layer in cache.layers:
                    layer.batch_select_indices(torch.tensor(rows))
        length += n - crop
        assert ours.get_seq_length() == theirs.get_seq_length() == length
        for mine, ref in zip(ours.layers, theirs.layers):
            assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_kv_caches_stay_lossless(target_and_prompts, trained_drafters, kind):
    """With the target's KV cache quantized (serve_eval.kv), greedy chains and trees (with a budget)
    emit exactly what plain decoding with the same quantized cache emits, for every format, and so
    do batches of rows of different lengths, with a prompt taking a finished row's place too; the
    quantized cache does change the target's logits (it is in use)."""
    from serve_eval.kv import KVQuant

    target, tok, prompts = target_and_prompts
    drafter = trained_drafters[kind]
    for kv in (KVQuant("int8"), KVQuant("fp8"), KVQuant("int4"), KVQuant("int4", rotate=True)):
        full, quantized = TargetSession(target).prefill(prompts[:1]), TargetSession(target, kv=kv).prefill(prompts[:1])
        assert not torch.allclose(full[0], quantized[0], atol=1e-4)
        for prompt in prompts:
            reference, _ = plain_generate(target, prompt, MAX_NEW, kv=kv)
            assert speculative_generate(target, drafter, prompt, MAX_NEW, kv=kv)[0] == reference
            assert (
                speculative_generate(
                    target, drafter, prompt, MAX_NEW, mode="tree", kv=kv, budget=Budget({1: 1.0, 16: 1.3})
                )[0]
                == reference
            )
        rows = [prompts[0], prompts[1][:17], prompts[2][:9]]
        expected = [plain_generate(target, p, MAX_NEW, kv=kv)[0] for p in rows]
        for slots in (None, 2):  # 2: the third prompt takes a finished row's place, codes copied in place
            assert generate(target, rows, MAX_NEW, proposer=make_proposer(drafter), kv=kv, slots=slots)[0] == expected
