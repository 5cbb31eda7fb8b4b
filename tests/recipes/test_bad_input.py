"""Bad input is one clear error: the CLI prints what was wrong, which file or key and what was
expected, exits with status 2, writes nothing and starts no compute (no model is loaded: every case
but the unreachable hub fails while the recipe is validated)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from distill.testbed import SHIPPED_TARGET
from recipes.cli import main

from ..conftest import REPO

DRAFTER = REPO / "distill/assets/testbed_dflash"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def _prompts(tmp: Path, text: str) -> list[str]:
    (tmp / "prompts.jsonl").write_text(text)
    return ["--prompts", str(tmp / "prompts.jsonl")]


def _drafter(tmp: Path, change) -> list[str]:
    folder = _copy(DRAFTER, tmp / "drafter")
    change(folder)
    return ["--drafter", str(folder)]


def _target(tmp: Path, change) -> list[str]:
    folder = _copy(SHIPPED_TARGET, tmp / "target")
    change(folder)
    return ["--target", str(folder)]


def _recipe(tmp: Path, text: str) -> list[str]:
    (tmp / "recipe.yaml").write_text(text)
    return ["run", str(tmp / "recipe.yaml")]


# (case, argv builder (tmp -> argv), what the message must say)
CASES = [
    (
        "prompt line without the key",
        lambda t: _prompts(t, '{"prompt": "def f("}\n{"text": "x"}\n'),
        "line 2: expected an object with a 'prompt' or 'messages' key",
    ),
    ("prompt line not JSON", lambda t: _prompts(t, '{"prompt": "a" "b"}\n'), "line 1: not valid JSON"),
    ("prompt that is not a string", lambda t: _prompts(t, '{"prompt": 3}\n'), "'prompt' must be a string"),
    ("empty prompts file", lambda t: _prompts(t, "\n\n"), "holds no prompts"),
    (
        "truncated drafter weights",
        lambda t: _drafter(t, lambda f: _truncate(f / "model.safetensors")),
        "model.safetensors (1,548,308 bytes) is truncated or corrupted",
    ),
    (
        "drafter config not JSON",
        lambda t: _drafter(t, lambda f: (f / "config.json").write_text("{vocab_size: 4096")),
        "config.json is not valid JSON",
    ),
    ("drafter without weights", lambda t: _drafter(t, lambda f: (f / "model.safetensors").unlink()), "has no weights"),
    (
        "drafter for another vocabulary",
        lambda t: _drafter(t, lambda f: _edit_config(f, vocab_size=151936)),
        "its vocabulary has 151936 tokens, the target's 4096 (it was trained for another target)",
    ),
    (
        "drafter reading wider features",
        lambda t: _drafter(t, lambda f: _edit_config(f, target_hidden_size=4096)),
        "it reads 4096-wide target features, the target's hidden size is 320",
    ),
    (
        "drafter reading missing layers",
        lambda t: _drafter(t, lambda f: _edit_config(f, target_layer_ids=[1, 3, 35])),
        "it reads target layers [35], the target has 8 (0..7)",
    ),
    (
        "truncated target weights",
        lambda t: _target(t, lambda f: _truncate(f / "model.safetensors")),
        "target '{tmp}/target': model.safetensors",
    ),
    (
        "target without a tokenizer",
        lambda t: _target(t, lambda f: [p.unlink() for p in f.glob("tokenizer*")]),
        "has no tokenizer",
    ),
    (
        "ssd with a drafter that reads target features",
        lambda t: ["--ssd-enabled", "--no-budget-adaptive"],
        "decoding.ssd.enabled drafts ahead of the target's features, so it needs a drafter that reads tokens only",
    ),
    (
        "ssd on trees",
        lambda t: ["--ssd-enabled", "--mode", "tree"],
        "ssd verifies every draft of a chain the speculation made",
    ),
    (
        "an int8 head for the target drafting for itself",
        lambda t: ["--drafter", str(REPO / "distill/assets/testbed_target"), "--cpu-int8", "head"],
        "is the target itself, which must stay as it is",
    ),
    ("recipe YAML that does not parse", lambda t: _recipe(t, "recipe: eval\ndecoding: [1,\n"), "recipe.yaml"),
    (
        "recipe key misspelt",
        lambda t: _recipe(t, f"recipe: eval\ndrafter: {DRAFTER}\nprompts: {{from_corpus: 2}}\ndecodng: {{{{}}}}\n"),
        "decodng",
    ),
    (
        "override without a value",
        lambda t: ["run", str(REPO / "recipes/configs/eval_testbed.yaml"), "decoding.mode"],
        "decoding.mode",
    ),
    ("a batch of no rows", lambda t: ["--batches-sizes", "4", "0"], "batch sizes must be >= 1, got [4, 0]"),
    (
        "a fixed draft length under a budget",
        lambda t: ["run", str(REPO / "recipes/configs/eval_testbed.yaml"), "decoding.budget.verify_drafts=3"],
        "verify_drafts 3: a fixed draft length is a chain's without a budget: it needs mode: chain, budget.adaptive: false",
    ),
    (
        "a flat decoding key of a recipe",
        lambda t: _recipe(
            t,
            f"recipe: eval\noutput_dir: {t / 'out'}\ndrafter: {DRAFTER}\n"
            "prompts: {from_corpus: 2}\ndecoding: {kv_cache: int8}\n",
        ),
        "decoding.kv_cache is now decoding.kv.format",
    ),
    (
        "a flat decoding key as an override",
        lambda t: ["run", str(REPO / "recipes/configs/eval_testbed.yaml"), "decoding.lookup=7"],
        "decoding.lookup is now decoding.lookup.tokens",
    ),
    (
        "a flat decoding key as an eval override",
        lambda t: ["decoding.batch_sizes=[4]", "decoding.drafter_int8=off"],
        "decoding.batch_sizes is now decoding.batches.sizes; decoding.drafter_int8 is now decoding.cpu.int8",
    ),
    (
        "a CPU kernel with the torch backend",
        lambda t: ["--backend", "torch", "--cpu-prepack", "on", "--cpu-int8", "off"],
        "decoding.cpu.prepack = 'on': a CPU kernel, which decoding.backend = 'torch' does not serve",
    ),
    (
        "a CPU kernel with the torch backend, by override",
        lambda t: ["--backend", "torch", "decoding.cpu.compile=on"],
        "decoding.cpu.compile = 'on': a CPU kernel, which decoding.backend = 'torch' does not serve",
    ),
]


@pytest.mark.parametrize("case,argv,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_error(tmp_path, capsys, case, argv, message):
    args = argv(tmp_path)
    out = tmp_path / "out"
    if args[0] != "run":
        args = [
            "eval",
            *(["--drafter", str(DRAFTER)] if "--drafter" not in args else []),
            *args,
            "--output-dir",
            str(out),
        ]
    assert main(args) == 2  # returned, not raised: no traceback
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message.format(tmp=tmp_path) in err, err
    assert not out.exists()


def test_an_unreachable_hub_target_is_one_clear_error(tmp_path, capsys, monkeypatch):
    """A hub id with the network unreachable and HF_HUB_OFFLINE unset: transformers' OSError (it
    retries for ~30 s before giving up, simulated here) becomes one line that says what to do."""
    import transformers

    def unreachable(*args, **kwargs):
        raise OSError(
            "We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the "
            "cached files.\nCheck your internet connection"
        )

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", unreachable)
    out = tmp_path / "out"
    assert main(["eval", "--drafter", str(DRAFTER), "--target", "someone/missing-model", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "target.path: 'someone/missing-model' could not be loaded from the hub" in err and "HF_HUB_OFFLINE=1" in err
    assert not out.exists()


def test_a_data_file_that_does_not_parse_names_itself(tmp_path):
    from distill.config import DataConfig, RecipeError
    from distill.data import load_text_splits

    bad = tmp_path / "train.jsonl"
    bad.write_text('{"text": "def f(): pass"}\n{"text": "x" "y"}\n')
    with pytest.raises(RecipeError, match=r"data files \[.*train.jsonl'\]: could not be read as json"):
        load_text_splits(DataConfig(source="files", train_files=[str(bad)], format="text"))


def test_a_truncated_feature_cache_shard_is_refused_when_opened(tmp_path):
    """A feature cache whose shard was cut short (a full disk, a copy that stopped) fails when the
    cache is opened, naming the shard and what to do, not at the first batch that reads it."""
    import torch
    from safetensors.torch import save_file

    from distill.config import RecipeError
    from distill.feature_cache import FORMAT_VERSION, CachedFeatureWindows

    folder = tmp_path / "cache"
    folder.mkdir()
    save_file(
        {"input_ids": torch.zeros(4, 9, dtype=torch.int32), "aux": torch.zeros(4, 9, 6), "last": torch.zeros(4, 9, 2)},
        str(folder / "shard_00000.safetensors"),
    )
    (folder / "manifest.json").write_text(
        json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "seq_len": 8,
                "num_windows": 4,
                "shards": [{"file": "shard_00000.safetensors", "windows": 4}],
            }
        )
    )
    assert CachedFeatureWindows(folder, {}).num_windows == 4
    _truncate(folder / "shard_00000.safetensors")
    with pytest.raises(RecipeError, match=r"shard_00000.safetensors .* is truncated or corrupted: .*delete the folder"):
        CachedFeatureWindows(folder, {})
    (folder / "manifest.json").write_text("{")
    with pytest.raises(RecipeError, match="manifest.json is not valid JSON"):
        CachedFeatureWindows(folder, {})


def test_corrupted_regenerated_answers_say_how_to_regenerate(tmp_path):
    from distill.config import RecipeError
    from distill.data import regenerated_text_splits

    answers = tmp_path / "train_t0.jsonl"
    answers.write_text('{"prompt_ids": [1], "response_ids": [2], "eos": true}\n{"prompt_ids": [1], "resp\n')
    record = {"key": "k", "folder": str(tmp_path), "train_files": [str(answers)], "val_files": [str(answers)]}
    with pytest.raises(RecipeError, match=rf"train_t0.jsonl line 2: not valid JSON .*delete {tmp_path} to regenerate"):
        regenerated_text_splits(record)
