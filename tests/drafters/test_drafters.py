"""Drafters on a tiny target: they learn (loss falls, simulated tau beats an untrained drafter), see
exactly what decoding will show them, round-trip through save/load, and read the right target layers."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from distill.base.features import FeatureCapture, default_layer_ids
from distill.config import TargetConfig
from distill.models import load_target
from recipes.registry import parse_recipe

from ..conftest import KINDS, decode_one, drafter_recipe, reset_accelerate, tiny_dflash_config


def test_hooks_follow_the_output_of_layer_convention(tiny_target_dir):
    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    ids = tok("import os\nprint(os.getcwd())", return_tensors="pt")["input_ids"]
    feats = FeatureCapture(target, [0, 2])(ids)
    hs = target(ids, output_hidden_states=True).hidden_states
    H = target.config.hidden_size
    assert torch.equal(feats.aux[..., :H], hs[1]) and torch.equal(
        feats.aux[..., H:], hs[3]
    )  # id i = hidden_states[i+1]
    assert torch.allclose(feats.last, hs[-1])
    assert torch.allclose(target.lm_head(feats.last), target(ids).logits, atol=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        FeatureCapture(target, [4])
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's published DFlash layers


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_learns_and_beats_untrained(tmp_path, tiny_target_dir, kind):
    from recipes import train_drafter

    untrained = train_drafter.main(
        drafter_recipe(tmp_path / "untrained", tiny_target_dir, kind, max_steps=1, eval_every=1)
    )
    reset_accelerate()
    out = tmp_path / "trained"
    trained = train_drafter.main(drafter_recipe(out, tiny_target_dir, kind))
    losses = [
        m["train/loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in m
    ]
    assert losses[-1] < losses[0], losses
    assert trained["val_simulated_tau"] > untrained["val_simulated_tau"] + 0.05, (trained, untrained)
    assert 1.0 <= trained["val_simulated_tau"] <= 4.0 and 0 <= trained["val_acc_1"] <= 1
    if kind == "dspark":
        assert 0 <= trained["val_confidence_ece"] <= 1 and 0 <= trained["val_confidence_auroc"] <= 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_drafter_trains_over_a_draft_vocabulary(tmp_path, tiny_target_dir, kind):
    """drafter.draft_vocab: the tokens the training windows use most; the loss falls, the checkpoint
    records the vocabulary, and the drafter loads restricted to it: it drafts only those tokens, and
    decoding stays lossless."""
    from recipes import train_drafter
    from recipes.evaluate import load_drafter
    from serve_eval.loop import plain_generate, speculative_generate
    from serve_eval.proposers import make_proposer

    out = tmp_path / "run"
    summary = train_drafter.main(
        drafter_recipe(out, tiny_target_dir, kind, {"draft_vocab": 128}, max_steps=60, eval_every=60)
    )
    losses = [
        m["train/loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in m
    ]
    assert losses[-1] < losses[0] and summary["val_simulated_tau"] >= 1.0, losses
    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    drafter = load_drafter(str(out / "model"), target, "cpu")
    assert drafter.config.draft_vocab_size == 128 == len(drafter.draft_vocab)
    prompt = tok("def main(argv):\n    parser = ", return_tensors="pt")["input_ids"][0]
    drafted, proposer = [], make_proposer(drafter)
    inner = proposer.propose

    def propose(*args, **kwargs):
        got = inner(*args, **kwargs)
        drafted.append(got.tokens[0])
        return got

    proposer.propose = propose
    assert (
        speculative_generate(target, drafter, prompt, 24, proposer=proposer)[0] == plain_generate(target, prompt, 24)[0]
    )
    assert bool(torch.isin(torch.cat(drafted), drafter.draft_vocab).all())


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip_is_exact(tmp_path, tiny_target_dir, kind):
    from transformers import AutoModel

    from distill.drafter_eval import build_drafter

    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    recipe = drafter_recipe(tmp_path, tiny_target_dir, kind)
    drafter = build_drafter(recipe.drafter, target, str(tiny_target_dir), tok.mask_token_id)
    drafter.save_pretrained(tmp_path / "d")
    loaded = AutoModel.from_pretrained(tmp_path / "d")
    assert type(loaded) is type(drafter)
    for key in ("block_size", "mask_token_id", "target_layer_ids", "target_name_or_path", "layer_id_convention"):
        assert getattr(loaded.config, key) == getattr(drafter.config, key)
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, len(tok), (2, 32))
    feats = FeatureCapture(target, drafter.config.target_layer_ids)(ids)
    drafter.eval(), loaded.eval()
    kwargs = {} if kind == "eagle3" else {"anchors": torch.tensor([[3, 10], [5, 20]])}
    torch.testing.assert_close(
        loaded(ids, feats.aux, feats.last, **kwargs).draft_logits,
        drafter(ids, feats.aux, feats.last, **kwargs).draft_logits,
        rtol=1e-5,
        atol=1e-5,
    )
    assert torch.equal(loaded.embed_tokens.weight, target.get_input_embeddings().weight)
    assert not loaded.embed_tokens.weight.requires_grad and not loaded.lm_head.weight.requires_grad


@pytest.mark.parametrize("kind", KINDS)
def test_shipped_drafter_loads_its_embeddings_and_head_from_the_target(tmp_path, tiny_target_dir, kind):
    import drafters
    from distill.drafter_eval import build_drafter
    from recipes.evaluate import load_drafter

    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    drafter = build_drafter(
        drafter_recipe(tmp_path, tiny_target_dir, kind).drafter, target, str(tiny_target_dir), tok.mask_token_id
    ).eval()
    drafters.save_without_target_io(drafter, tmp_path / "d", torch.float16)
    assert drafters.shares_target_io(tmp_path / "d") and not drafters.shares_target_io(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="pt") as f:
        assert not {"embed_tokens.weight", "lm_head.weight"} & set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())  # noqa: SIM118 safe_open is not iterable
    loaded = load_drafter(str(tmp_path / "d"), target, "cpu")
    assert torch.equal(loaded.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(loaded.lm_head.weight, target.get_output_embeddings().weight)
    own = {k: v for k, v in drafter.state_dict().items() if k not in drafters.target_io.TARGET_IO}
    assert all(torch.equal(loaded.state_dict()[k], v.half().float()) for k, v in own.items())  # fp16 rounding only


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_block_sees_only_features_before_its_anchor(attention):
    from drafters import DFlashConfig, DFlashDrafter

    torch.manual_seed(0)
    cfg = DFlashConfig(
        vocab_size=50,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        target_layer_ids=[0],
        target_hidden_size=32,
        mask_token_id=1,
        block_size=4,
        block_attention=attention,
    )
    m = DFlashDrafter(cfg).eval()
    aux = torch.randn(1, 30, 32)
    anchors, tokens = torch.tensor([[10, 20]]), torch.tensor([[5, 7]])
    base = m.block_hidden(aux, tokens, anchors)
    later = aux.clone()
    later[:, 10:] += 1.0  # features at and after the first anchor
    out = m.block_hidden(later, tokens, anchors)
    assert torch.equal(out[:, 0], base[:, 0]), "block 0 saw features at or after its anchor"
    assert not torch.allclose(out[:, 1], base[:, 1]), "block 1 should see features 10..19"
    earlier = aux.clone()
    earlier[:, 9] += 1.0
    assert not torch.allclose(m.block_hidden(earlier, tokens, anchors)[:, 0], base[:, 0])
    # inside a block: the anchor token influences every position; causal blocks hide later positions
    other = m.block_hidden(aux, torch.tensor([[6, 7]]), anchors)
    assert not torch.allclose(other[:, 0, 3], base[:, 0, 3]) and torch.equal(other[:, 1], base[:, 1])


@pytest.mark.parametrize(
    "attention,qk_norm,kv_heads,rope",
    [
        ("bidirectional", False, 4, None),
        ("causal", False, 4, None),
        ("bidirectional", True, 2, None),
        ("bidirectional", True, 4, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}),
    ],
)
def test_cached_decoding_block_equals_the_training_block(attention, qk_norm, kv_heads, rope):
    """The decoding fast path (the context's keys/values appended in place, or projected in the block's
    own forward; the block written after them, no mask for bidirectional blocks; the lean operations:
    fused norms, a rotary table, SDPA called directly; fused projections or not) gives the training forward's block, across buffer and rotary-table growth, with
    Qwen3's query/key norms, grouped keys/values and YaRN scaling. A rotary scaling that changes with
    the length seen (dynamic NTK) gets no table."""
    from drafters import DFlashConfig, DFlashDrafter
    from drafters.cache import ContextCache

    torch.manual_seed(0)
    rope_parameters = {"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}
    cfg = tiny_dflash_config(
        num_key_value_heads=kv_heads,
        block_attention=attention,
        num_hidden_layers=2,
        qk_norm=qk_norm,
        rope_parameters=rope_parameters,
    )
    m = DFlashDrafter(cfg).eval()
    for norm in (m.norm, m.hidden_norm):
        norm.weight.data.uniform_(0.5, 1.5)  # not ones: the fused norm must scale by its weight
    assert m.layers[0].attn.static_rope
    if rope:
        dynamic = DFlashConfig(
            **{**cfg.to_dict(), "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}
        )
        assert not DFlashDrafter(dynamic).layers[0].attn.static_rope
    aux = torch.randn(1, 300, 32)
    cache, done = ContextCache(spare=cfg.block_size), 0
    fused = copy.deepcopy(m).fuse_projections()  # one product for q, k, v and one for gate, up: every other block
    assert fused.layers[1].attn.qkv_proj.weight.shape == (32 + 2 * kv_heads * 8, 32)
    with torch.no_grad():
        # 7, 2, 61, 1, 69 and 150 new positions; buffers grow past 64
        for i, anchor in enumerate((7, 9, 70, 71, 140, 290)):
            new = aux[:, done:anchor]
            if i % 3 == 1:  # appended first; otherwise read by the block's own forward
                cache.append(m.context_kv(new, torch.arange(done, anchor)[None], lean=True))
                new = None
            done = anchor
            token = torch.tensor(5 + anchor % 7)
            fast = decode_one(fused if i % 2 else m, token, anchor, cache, new)
            assert cache.length == anchor
            reference = m.block_hidden(aux[:, :anchor], token.view(1, 1), torch.tensor([[anchor]]))
            torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)


def test_the_fused_projection_path_needs_fused_projections():
    """project_qkv reads the product fuse_projections makes: without it, an error that says what to call."""
    from drafters import DFlashDrafter

    cfg = tiny_dflash_config()
    attn = DFlashDrafter(cfg).layers[0].attn
    with pytest.raises(RuntimeError, match=r"fuse_projections\(\) first"):
        attn.project_qkv(torch.zeros(1, 2, 32), torch.arange(2)[None], queries=1)
    attn.fuse_projections()
    q, k, v = attn.project_qkv(torch.zeros(1, 2, 32), torch.arange(2)[None], queries=1)
    assert q.shape == (1, 4, 1, 8) and k.shape == v.shape == (1, 2, 2, 8)


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
@pytest.mark.parametrize("fused", [False, True])
def test_decoding_rows_equal_each_rows_block_over_its_whole_context(attention, fused):
    """decode (one shape for every step: features padded to K rows, the padding written to the buffers'
    last slot, attention over whole zero-initialised buffers under a mask), for three rows at once whose
    contexts drift apart (0..K features arriving per row and step), gives each row the block that
    block_hidden computes for that row alone over its whole context, and leaves each row's context
    keys and values in its buffers."""
    from drafters import DFlashDrafter
    from drafters.cache import ContextCache

    torch.manual_seed(0)
    cfg = tiny_dflash_config(
        block_attention=attention,
        num_hidden_layers=2,
        qk_norm=True,
        rope_parameters={"rope_theta": 1e4, "rope_type": "default"},
    )
    m = DFlashDrafter(cfg).eval()
    reference = copy.deepcopy(m)
    if fused:
        m.fuse_projections()
    R = 3
    aux = torch.randn(R, 200, 32)
    cache = ContextCache(spare=4, capacity=200)
    cache.start(R)
    cache.ensure(200, torch.zeros(R, 2, 0, cfg.head_dim), len(m.layers))
    pos = [0] * R
    with torch.no_grad():
        for step in range(40):
            ns = [max((step + 2 * r) % 5, int(pos[r] == 0)) for r in range(R)]  # 0..K, at least one to start
            tokens = torch.tensor([5 + (step + r) % 7 for r in range(R)])
            features = torch.zeros(R, 4, 32)
            expected = []
            for r, n in enumerate(ns):
                features[r, :n] = aux[r, pos[r] : pos[r] + n]
                a = pos[r] + n
                expected.append(reference.block_hidden(aux[r : r + 1, :a], tokens[r].view(1, 1), torch.tensor([[a]])))
            got = m.decode(tokens, torch.tensor([[p, n] for p, n in zip(pos, ns)]), features, cache)
            torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)
            pos = [p + n for p, n in zip(pos, ns)]
        for r in range(R):
            context = reference.context_kv(aux[r : r + 1, : pos[r]], torch.arange(pos[r])[None])
            for (k, v), keys, values in zip(context, cache.keys, cache.values):
                torch.testing.assert_close(keys[r : r + 1, :, : pos[r]], k, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(values[r : r + 1, :, : pos[r]], v, rtol=1e-5, atol=1e-5)
        assert len(set(pos)) > 1  # the rows drifted apart


def test_eagle3_ttt_chain_sees_only_its_own_past():
    from drafters.eagle3 import ttt_mask

    m = ttt_mask(2, 6)
    # query p=4 of step 2 belongs to the chain that started at t=2
    assert m[4, :6].tolist() == [True, True, True, False, False, False]  # step 0: positions <= 2
    assert m[4, 6:12].tolist() == [False, False, False, True, False, False]  # step 1: position 3
    assert m[4, 12:].tolist() == [False, False, False, False, True, False]  # step 2: itself


def test_offline_cache_trains_like_online_and_refuses_a_mismatch(tmp_path, tiny_target_dir):
    from distill.feature_cache import FeatureCacheMismatch
    from recipes import train_drafter

    def run(out, features, **drafter):
        reset_accelerate()
        raw = drafter_recipe(out, tiny_target_dir, "dflash", max_steps=6, eval_every=3).model_dump(mode="json")
        raw["features"] = {"max_windows": 40, **features}
        raw["drafter"].update(drafter)
        summary = train_drafter.main(parse_recipe(raw))
        return summary, list(map(json.loads, (out / "metrics.jsonl").read_text().splitlines()))

    cache = tmp_path / "cache"
    online, online_log = run(tmp_path / "online", {"mode": "online"})
    offline, offline_log = run(tmp_path / "offline", {"mode": "offline", "cache_dir": str(cache), "dtype": "float32"})
    manifest = json.loads((cache / "train" / "manifest.json").read_text())
    assert manifest["num_windows"] == 40 and manifest["layer_id_convention"] == "output_of_layer"
    assert [m.get("train/loss") for m in online_log] == [m.get("train/loss") for m in offline_log]
    assert online["val_simulated_tau"] == offline["val_simulated_tau"]
    with pytest.raises(FeatureCacheMismatch, match="layer_ids"):
        run(
            tmp_path / "other",
            {"mode": "offline", "cache_dir": str(cache), "dtype": "float32"},
            target_layer_ids=[0, 1, 2],
        )


def test_confidence_calibration_fits_known_temperatures_and_offsets():
    """The fit recovers a per-position temperature and offset from synthetic drafts, and a DSpark
    drafter applies the fitted map (sigmoid(z / T + b) per block position)."""
    from recipes.calibrate_confidence import fit_temperatures

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(20000, generator=gen, dtype=torch.float64) * 3
    positions = torch.arange(20000) % 2
    true_t, true_b = torch.tensor([2.0, 0.5], dtype=torch.float64), torch.tensor([0.0, -1.0], dtype=torch.float64)
    kept = torch.rand(20000, generator=gen, dtype=torch.float64) < (z / true_t[positions] + true_b[positions]).sigmoid()
    temps, offsets = fit_temperatures(z, positions, kept, block_size=3, bias=True)
    assert temps == pytest.approx([2.0, 0.5], rel=0.15) and offsets == pytest.approx([0.0, -1.0], abs=0.2)
    only_t, zero = fit_temperatures(z, positions, kept, block_size=3)
    assert zero == [0.0, 0.0] and only_t[0] == pytest.approx(2.0, rel=0.15)

    from distill.config import DrafterSection, ModelConfig
    from distill.drafter_eval import build_drafter
    from distill.models import build_causal_lm

    target = build_causal_lm(
        ModelConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, max_position_embeddings=64), 12
    )
    drafter = build_drafter(DrafterSection(kind="dspark", block_size=3, target_layer_ids=[0, 1]), target, "toy", 11)
    logits = torch.tensor([[0.5, -2.0]])
    assert torch.allclose(drafter.calibrated(logits), logits.sigmoid())
    drafter.config.confidence_temperature, drafter.config.confidence_offset = [2.0, 0.5], [0.0, -1.0]
    assert torch.allclose(drafter.calibrated(logits), torch.tensor([[0.25, -5.0]]).sigmoid())


@pytest.mark.parametrize("kind", KINDS)
def test_loss_in_chunks_equals_one_pass_and_holds_no_full_logits(tmp_path, tiny_target_dir, kind):
    """``drafter.loss_chunk``: the same loss, gradients and evaluation outputs as one pass, while no
    tensor kept for the backward pass holds more than a chunk of vocabulary-sized logits."""
    from distill.drafter_eval import build_drafter

    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    V = target.config.vocab_size
    ids = torch.randint(0, len(tok), (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :6] = 0

    def run(chunk, train: bool):
        torch.manual_seed(0)
        section = drafter_recipe(tmp_path, tiny_target_dir, kind).drafter.model_copy(update={"loss_chunk": chunk})
        drafter = build_drafter(section, target, str(tiny_target_dir), tok.mask_token_id).train(train)
        if kind == "dspark":
            torch.nn.init.normal_(drafter.markov_out.weight, std=0.02)  # zero at init: make the Markov term count
        feats = FeatureCapture(target, drafter.config.target_layer_ids)(ids)
        kwargs = {} if kind == "eagle3" else {"anchors": torch.tensor([[3, 10, 17, 30], [5, 12, 20, 33]])}
        saved = []

        def pack(t):
            if t.dim() >= 2 and t.shape[-1] == V:
                saved.append(t.numel() // V)  # positions' worth of logits kept for backward
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.set_grad_enabled(train):
            out = drafter(ids, feats.aux, feats.last, loss_mask=mask, **kwargs)
        if train:
            out.loss.backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        return out, grads, max(saved, default=0)

    chunk = 3  # under one block: one block at a time
    for train in (True, False):
        whole, grads, kept = run(None, train)
        part, part_grads, part_kept = run(chunk, train)
        torch.testing.assert_close(part.loss, whole.loss, rtol=1e-5, atol=1e-6)
        for key in ("draft_tokens", "target_tokens", "scored"):
            assert torch.equal(getattr(part, key), getattr(whole, key)), key
        torch.testing.assert_close(part.accept, whole.accept, rtol=1e-5, atol=1e-6)
        if kind == "dspark":
            torch.testing.assert_close(part.confidence, whole.confidence, rtol=1e-5, atol=1e-6)
        assert part.draft_logits is None and whole.draft_logits is not None
        if train:
            assert grads.keys() == part_grads.keys() and grads
            for n in grads:
                torch.testing.assert_close(part_grads[n], grads[n], rtol=1e-4, atol=1e-6, msg=n)
            per_block = (
                1 if kind == "eagle3" else drafter_recipe(tmp_path, tiny_target_dir, kind).drafter.block_size - 1
            )
            assert kept > 4 * per_block  # one pass keeps every position's logits ...
            assert part_kept == 0  # ... chunks keep none (each is recomputed in backward)


def test_init_from_starts_training_from_a_saved_drafter(tmp_path, tiny_target_dir):
    """``drafter.init_from``: the drafter's own weights come from the folder (the target's embeddings
    and head from the target); a folder of another kind or size is refused by name at validation."""
    import drafters
    from distill.config import RecipeError
    from distill.drafter_eval import build_drafter

    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    first = build_drafter(
        drafter_recipe(tmp_path, tiny_target_dir, "dflash").drafter, target, str(tiny_target_dir), tok.mask_token_id
    )
    with torch.no_grad():
        first.fc.weight.add_(1.0)  # anything a fresh init would not give
    drafters.save_without_target_io(first, tmp_path / "first", torch.float32)
    recipe = drafter_recipe(tmp_path / "second", tiny_target_dir, "dflash").model_dump(mode="json")
    recipe["drafter"]["init_from"] = str(tmp_path / "first")
    second = build_drafter(parse_recipe(recipe).drafter, target, str(tiny_target_dir), tok.mask_token_id)
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key, value, expected in (
        ("kind", "dspark", "model_type 'draftsmith_dflash' where this recipe builds 'draftsmith_dspark'"),
        ("block_size", 8, "block_size 4 where this recipe builds 8"),
    ):
        bad = {**recipe, "drafter": {**recipe["drafter"], key: value}}
        with pytest.raises(RecipeError, match=f"drafter.init_from .*{expected}"):
            parse_recipe(bad)
    with pytest.raises(RecipeError, match="drafter.init_from"):
        parse_recipe({**recipe, "drafter": {**recipe["drafter"], "init_from": str(tmp_path / "missing")}})


@pytest.mark.parametrize(
    "kind,attention", [("dflash", "bidirectional"), ("dflash", "causal"), ("dspark", "bidirectional")]
)
def test_flex_block_mask_gives_the_dense_masks_logits(tmp_path, tiny_target_dir, kind, attention):
    """``mask_implementation: flex`` (a GPU's default for training) against the dense mask SDPA reads
    (a CPU's): the same logits, flex run here by its eager reference (torch has no flex backward on
    a CPU; ``make gpu-check`` trains through it on a GPU)."""
    from distill.drafter_eval import build_drafter

    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    ids = torch.randint(0, len(tok), (2, 48), generator=torch.Generator().manual_seed(1))
    section = drafter_recipe(tmp_path, tiny_target_dir, kind).drafter.model_copy(update={"block_attention": attention})
    drafter = build_drafter(section, target, str(tiny_target_dir), tok.mask_token_id).eval()
    feats = FeatureCapture(target, drafter.config.target_layer_ids)(ids)
    outs = {}
    for impl in ("dense", "flex"):
        drafter.config.mask_implementation = impl
        with torch.no_grad():
            outs[impl] = drafter(ids, feats.aux, feats.last, anchors=torch.tensor([[2, 9, 20, 37], [4, 15, 30, 40]]))
    torch.testing.assert_close(outs["flex"].draft_logits, outs["dense"].draft_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(outs["flex"].draft_tokens, outs["dense"].draft_tokens)


def test_train_compile_wraps_the_model_in_torch_compile_and_saves_it_plain(tmp_path, tiny_target_dir):
    """``train.compile``: accelerate's prepare wraps the drafter in torch.compile (inductor), the run's
    strategy record says so, and the weights it saves carry no ``_orig_mod`` prefix. (Compiling on
    this CPU takes a minute: ``make gpu-check`` trains compiled on a GPU.)"""
    from distill.drafter_eval import build_drafter
    from distill.runtime import make_accelerator, run_strategy
    from distill.trainer import plain_state_dict

    recipe = drafter_recipe(tmp_path, tiny_target_dir, "dflash", compile=True)
    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    acc = make_accelerator(recipe.train, 0, tmp_path)
    drafter = build_drafter(recipe.drafter, target, str(tiny_target_dir), tok.mask_token_id)
    model = acc.prepare(drafter)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert run_strategy(acc, model)["compiled"] is True
    assert all(k.startswith("_orig_mod.") for k in acc.get_state_dict(model))  # what saving must undo
    assert set(plain_state_dict(acc, model)) == set(drafter.state_dict())
    assert acc.unwrap_model(model, keep_torch_compile=False) is drafter
    reset_accelerate()
    plain = make_accelerator(recipe.train.model_copy(update={"compile": False}), 0, tmp_path)
    assert run_strategy(plain, plain.prepare(drafter))["compiled"] is False


@pytest.mark.parametrize("kind", KINDS)
def test_attention_kernel_is_chosen_the_transformers_way(tmp_path, tiny_target_dir, kind):
    """The drafter's layers attend with the kernel its config names (``_attn_implementation``): SDPA by
    default, transformers' eager attention on request, with the same drafts; a flex-attention BlockMask
    (training-sized batches on a GPU) gives the dense mask's logits too."""
    from distill.drafter_eval import build_drafter
    from drafters.layers import DraftAttention

    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    drafter = build_drafter(
        drafter_recipe(tmp_path, tiny_target_dir, kind).drafter, target, str(tiny_target_dir), tok.mask_token_id
    ).eval()
    assert drafter.config._attn_implementation == "sdpa"
    ids = torch.randint(0, len(tok), (2, 32), generator=torch.Generator().manual_seed(0))
    feats = FeatureCapture(target, drafter.config.target_layer_ids)(ids)
    kwargs = {} if kind == "eagle3" else {"anchors": torch.tensor([[3, 10], [5, 20]])}
    sdpa = drafter(ids, feats.aux, feats.last, **kwargs).draft_logits
    calls = []
    original = DraftAttention.attend
    DraftAttention.attend = lambda self, *a: calls.append(self.config._attn_implementation) or original(self, *a)
    try:
        drafter.set_attn_implementation("eager")
        eager = drafter(ids, feats.aux, feats.last, **kwargs).draft_logits
    finally:
        DraftAttention.attend = original
    assert calls and set(calls) == {"eager"}
    torch.testing.assert_close(eager, sdpa, rtol=1e-4, atol=1e-4)


def test_rope_parameters_come_from_the_target(tmp_path, tiny_target_dir):
    """A target with scaled RoPE gives its drafter the same rotary frequencies (transformers' rotary
    embedding, ``rope_parameters``), and they survive save / load."""
    from transformers import AutoModel, AutoModelForCausalLM

    from distill.drafter_eval import build_drafter
    from drafters.layers import DraftAttention

    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    scaled = AutoModelForCausalLM.from_config(
        type(target.config)(
            **{
                **target.config.to_dict(),
                "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
            }
        )
    )
    drafter = build_drafter(
        drafter_recipe(tmp_path, tiny_target_dir, "dflash").drafter, scaled, str(tiny_target_dir), tok.mask_token_id
    )
    assert drafter.config.rope_parameters["rope_type"] == "linear" and drafter.config.rope_parameters["factor"] == 4.0
    rotary = next(m for m in drafter.modules() if isinstance(m, DraftAttention)).rotary
    torch.testing.assert_close(rotary.inv_freq, scaled.model.rotary_emb.inv_freq)
    plain = next(
        m
        for m in build_drafter(
            drafter_recipe(tmp_path, tiny_target_dir, "dflash").drafter, target, str(tiny_target_dir), tok.mask_token_id
        ).modules()
        if isinstance(m, DraftAttention)
    )
    torch.testing.assert_close(rotary.inv_freq * 4.0, plain.rotary.inv_freq)  # linear scaling divides the frequencies
    drafter.save_pretrained(tmp_path / "d")
    loaded = next(m for m in AutoModel.from_pretrained(tmp_path / "d").modules() if isinstance(m, DraftAttention))
    torch.testing.assert_close(loaded.rotary.inv_freq, rotary.inv_freq)


def test_draft_vocabulary_tables_and_restricted_head():
    """drafters.vocab: the N most frequent ids (ties to the lower id), speculators' d2t offsets and t2d
    mask, and a head computed on those rows only, -inf (or the given fill) elsewhere."""
    from drafters.vocab import RestrictedHead, coverage, d2t, frequent_tokens, t2d

    counts = torch.tensor([5, 0, 9, 9, 1, 3])
    ids = frequent_tokens(counts, 3)
    assert ids.tolist() == [0, 2, 3] and d2t(ids).tolist() == [0, 1, 1]
    assert t2d(ids, 6).tolist() == [True, False, True, True, False, False]
    assert coverage(ids, counts) == pytest.approx(23 / 27)
    with pytest.raises(ValueError, match="does not fit"):
        frequent_tokens(counts, 7)
    head = torch.nn.Linear(4, 6, bias=False)
    x = torch.randn(2, 5, 4)
    full, restricted = head(x), RestrictedHead(head, ids)(x)
    torch.testing.assert_close(restricted[..., ids], full[..., ids])
    assert torch.isneginf(restricted[..., [1, 4, 5]]).all()
    assert (RestrictedHead(head, ids, fill=0.0)(x)[..., [1, 4, 5]] == 0).all()


def test_per_step_vocabulary_head():
    """drafters.vocab.CandidateHead: exact logits on the subset it chose (the static ids and each row's
    best under the rank-r approximation), -inf elsewhere; at full rank the approximation is the head,
    so each row's true top-k is in the subset; the factors do not depend on the global RNG."""
    from drafters.vocab import CandidateHead

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 64, bias=False)
    x = torch.randn(3, 16)
    static = torch.tensor([5, 40])
    exact = CandidateHead(head, static, candidates=4, rank=16)
    ids = exact.select(x)
    assert ids[:2].tolist() == [5, 40] and len(ids.unique()) == len(ids) == 2 + 4
    best = head(x).log_softmax(-1).amax(0)  # at full rank: the 4 non-static ids likeliest in any row
    best[static] = float("-inf")
    assert set(ids[2:].tolist()) == set(best.topk(4).indices.tolist())
    out = exact(x)
    torch.testing.assert_close(out[:, ids], head(x)[:, ids])
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(out[:, outside]).all()
    assert exact.summary() == {"static": 2, "candidates": 4, "rank": 16, "size": 6}
    shift = torch.zeros(3, 64)
    shift[:, 63] = 1e3  # a term the caller adds (DSpark's Markov term): what it favours is a candidate, and is added
    shifted = exact(x, shift)
    assert 63 in exact.select(x, shift).tolist()
    torch.testing.assert_close(shifted[:, 63], head(x)[:, 63] + 1e3)
    low = CandidateHead(head, None, candidates=2, rank=3)
    torch.manual_seed(123)
    again = CandidateHead(head, None, candidates=2, rank=3)
    assert torch.equal(low.down, again.down) and torch.equal(low.up, again.up) and len(low.static) == 0
    with pytest.raises(ValueError, match="do not fit"):
        CandidateHead(head, static, candidates=63, rank=3)
