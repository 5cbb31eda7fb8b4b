"""A target that does not fit one device, in two stages: the offline feature cache built by a target placed
with ``target.device_map`` (``features.build_only``) is byte for byte the cache built without it, and
training from a complete cache neither loads nor runs the target yet trains the drafter the target-loaded
offline path trains; a cache made for another target is still refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from distill.config import RecipeError, TargetConfig
from recipes.registry import parse_recipe

from ..conftest import drafter_recipe, reset_accelerate

SPLITS = ("train", "val")


def offline_recipe(out, target_dir, cache, target=None, **features) -> dict:
    raw = drafter_recipe(out, target_dir, "dflash", max_steps=6, eval_every=3).model_dump(mode="json")
    raw["features"] = {"mode": "offline", "cache_dir": str(cache), "dtype": "float32", "max_windows": 40, **features}
    raw["target"].update(target or {})
    return raw


def run(raw: dict) -> dict:
    from recipes import train_drafter

    reset_accelerate()
    try:
        return train_drafter.main(parse_recipe(raw))
    finally:
        reset_accelerate()


def refuse(what: str):
    def fail(*_args, **_kwargs):
        raise AssertionError(f"training from a complete cache {what}")

    return fail


@pytest.fixture(scope="module")
def stage_one(tmp_path_factory, tiny_target_dir):
    """``(cache folder, summary)`` of stage 1: only the cache, built with the target placed by ``device_map``."""
    out = tmp_path_factory.mktemp("stage-one")
    summary = run(offline_recipe(out / "run", tiny_target_dir, out / "cache", {"device_map": "cpu"}, build_only=True))
    return out / "cache", summary


@pytest.fixture(scope="module")
def target_loaded(tmp_path_factory, tiny_target_dir):
    """``(run folder, summary)`` of the offline path with the target loaded: its cache built, then trained from."""
    out = tmp_path_factory.mktemp("target-loaded")
    return out, run(offline_recipe(out / "run", tiny_target_dir, out / "cache"))


def logged(run_dir) -> list[dict]:
    """The losses and evaluation metrics of a run's metrics.jsonl, in order (no timings)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k == "step" or k.startswith(("train/loss", "val_"))} for r in rows]


def test_device_map_builds_the_same_cache_bytes_and_build_only_trains_nothing(stage_one, target_loaded):
    cache, summary = stage_one
    assert summary["windows"] == {"train": 40, "val": summary["windows"]["val"]} and summary["feature_cache"] == str(
        cache
    )
    assert not (cache.parent / "run" / "metrics.jsonl").exists() and not (cache.parent / "run" / "model").exists()
    reference = target_loaded[0] / "cache"
    for split in SPLITS:
        names = sorted(p.name for p in (reference / split).iterdir())
        assert names == sorted(p.name for p in (cache / split).iterdir()) and "manifest.json" in names
        for name in names:
            assert (cache / split / name).read_bytes() == (reference / split / name).read_bytes(), f"{split}/{name}"


def test_training_from_a_complete_cache_neither_loads_nor_runs_the_target(
    stage_one, target_loaded, tiny_target_dir, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    from distill.base.features import FeatureCapture

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse("loaded the target's weights"))
    monkeypatch.setattr(FeatureCapture, "__call__", refuse("ran the target"))
    summary = run(offline_recipe(tmp_path / "run", tiny_target_dir, stage_one[0]))
    reference_dir, reference = target_loaded
    assert logged(tmp_path / "run") == logged(reference_dir / "run") and len(logged(tmp_path / "run")) > 2
    for key in ("steps", "best_step", "best_simulated_tau", "val_simulated_tau", "val_loss"):
        assert summary[key] == reference[key], key
    ours, theirs = (
        load_file(tmp_path / "run" / "model" / "model.safetensors"),
        load_file(reference_dir / "run" / "model" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_cache_made_for_another_target_is_refused_without_its_weights(
    stage_one, tiny_target_dir, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    from distill.feature_cache import FeatureCacheMismatch

    other = tmp_path / "other-target"
    shutil.copytree(tiny_target_dir, other)
    weights = load_file(other / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"] += 1.0  # every sampled element differs
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse("loaded the target's weights"))
    with pytest.raises(FeatureCacheMismatch, match="target_fingerprint"):
        run(offline_recipe(tmp_path / "run", other, stage_one[0]))


def test_target_without_weights_holds_only_what_the_drafter_copies_and_cannot_run(tiny_target_dir):
    from distill.base.features import FeatureCapture
    from distill.feature_cache import target_fingerprint
    from distill.models import load_target, load_target_io

    cfg = TargetConfig(path=str(tiny_target_dir))
    loaded, _ = load_target(cfg)
    target, _ = load_target_io(cfg, norm=True)
    real = {n: p for n, p in target.named_parameters(remove_duplicate=False) if p.device.type != "meta"}
    assert set(real) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    state = loaded.state_dict()
    assert all(torch.equal(p, state[n]) for n, p in real.items())
    assert target_fingerprint(target) == target_fingerprint(loaded)
    assert target_fingerprint(load_target_io(cfg.model_copy(update={"dtype": "bfloat16"}))[0]) != target_fingerprint(
        loaded
    )
    with pytest.raises(RecipeError, match="without its weights"):
        FeatureCapture(target, [0])(torch.tensor([[1, 2, 3]]))
    captured = {0: torch.ones(1, 3, 4), 1: torch.ones(1, 3, 4), "last": torch.ones(1, 3, 4)}  # a split target's states
    feats = FeatureCapture(target, [0, 1]).features(captured, "meta")
    assert feats.aux.device.type == feats.last.device.type == "meta" and feats.aux.shape == (1, 3, 8)


def test_fingerprint_samples_large_tensors_element_by_element_as_flatten_strides(tmp_path):
    from distill.target_files import strided_sample

    tensors = {"big": torch.randn(301, 7, 40).to(torch.bfloat16), "small": torch.randn(100)}
    save_file(tensors, tmp_path / "t.safetensors")
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as handle:
        for name, t in tensors.items():
            assert torch.equal(strided_sample(handle, name), t.flatten()[:: max(1, t.numel() // 64)])


def test_device_map_is_refused_with_several_processes_and_outside_train_drafter(tiny_target_dir, tmp_path):
    from distill.models import check_device_map

    split = TargetConfig(path=str(tiny_target_dir), device_map="auto")
    check_device_map(split, 1)
    check_device_map(TargetConfig(path=str(tiny_target_dir)), 8)
    with pytest.raises(RecipeError, match="target.device_map"):
        check_device_map(split, 2)
    with pytest.raises(RecipeError, match="features.build_only"):
        parse_recipe(offline_recipe(tmp_path, tiny_target_dir, tmp_path / "cache", mode="online", build_only=True))
    student = {
        "recipe": "distill_student",
        "output_dir": str(tmp_path),
        "target": {"path": str(tiny_target_dir), "device_map": "cpu"},
    }
    with pytest.raises(RecipeError, match="target.device_map"):
        parse_recipe(student)


def test_vllm_hidden_states_files_train_the_same_weights(target_loaded, tiny_target_dir, tmp_path, monkeypatch):
    """The offline cache in vLLM's format (``hs_{i}.safetensors``: token ids, the states of the layer ids
    in that convention and the final state before the norm), written here from the in-process capture:
    training from it, without the target's weights, gives the weights training from draftsmith's own
    cache gives. Files extracted with more layers read the right ones; files of other tokens are refused."""
    from transformers import AutoModelForCausalLM

    from distill.base.features import FeatureCapture

    cache = tmp_path / "vllm"
    run(offline_recipe(tmp_path / "write", tiny_target_dir, cache, format="vllm", build_only=True))
    drafter_ids = json.loads((target_loaded[0] / "run" / "model" / "config.json").read_text())["target_layer_ids"]
    first = load_file(cache / "train" / "hs_0.safetensors")
    assert set(first) == {"token_ids", "hidden_states"} and first["token_ids"].dtype == torch.int64
    target_config = json.loads((tiny_target_dir / "config.json").read_text())
    hidden, layers = target_config["hidden_size"], target_config["num_hidden_layers"]
    assert first["hidden_states"].shape == (len(first["token_ids"]), len(drafter_ids) + 1, hidden)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse("loaded the target's weights"))
    monkeypatch.setattr(FeatureCapture, "__call__", refuse("ran the target"))
    summary = run(offline_recipe(tmp_path / "run", tiny_target_dir, cache, format="vllm"))
    reference_dir, reference = target_loaded
    assert logged(tmp_path / "run") == logged(reference_dir / "run")
    assert summary["val_simulated_tau"] == reference["val_simulated_tau"]
    ours, theirs = (
        load_file(tmp_path / "run" / "model" / "model.safetensors"),
        load_file(reference_dir / "run" / "model" / "model.safetensors"),
    )
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)

    # extracted with an extra layer in front, one the drafter does not read: the layer ids say which rows to read
    wider = tmp_path / "wider"
    for split in SPLITS:
        (wider / split).mkdir(parents=True)
        for path in (cache / split).glob("hs_*.safetensors"):
            t = load_file(path)
            extra = torch.randn(t["hidden_states"].shape[0], 1, t["hidden_states"].shape[2])
            save_file({**t, "hidden_states": torch.cat([extra, t["hidden_states"]], dim=1)}, wider / split / path.name)
    unread = min(set(range(1, layers)) - {i + 1 for i in drafter_ids})
    layer_ids = [unread, *(i + 1 for i in drafter_ids), layers]
    run(offline_recipe(tmp_path / "wide", tiny_target_dir, wider, format="vllm", vllm_layer_ids=layer_ids))
    wide = load_file(tmp_path / "wide" / "model" / "model.safetensors")
    assert all(torch.equal(wide[k], theirs[k]) for k in wide)
    with pytest.raises(RecipeError, match="were not extracted"):
        run(offline_recipe(tmp_path / "short", tiny_target_dir, wider, format="vllm", vllm_layer_ids=[unread, layers]))
    t = load_file(wider / "train" / "hs_0.safetensors")
    save_file({**t, "token_ids": t["token_ids"].flip(0)}, wider / "train" / "hs_0.safetensors")
    with pytest.raises(RecipeError, match="are not window 0's tokens"):
        run(offline_recipe(tmp_path / "other", tiny_target_dir, wider, format="vllm", vllm_layer_ids=layer_ids))
