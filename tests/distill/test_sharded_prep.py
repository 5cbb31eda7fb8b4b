"""Data preparation divided among ranks: tokenizing, regenerating answers and caching features.

Each job's units are dealt among the ranks, each rank publishes its shard files atomically, and the
main rank merges them into the artefact one process writes: the same bytes whatever the world size,
a killed run's finished shards kept. The unit tests run simulated worlds in-process (one thread a
rank, with its own tokenizer and target: a barrier and a gather between threads); the launch test runs
a drafter recipe (regeneration, tokenizing, an offline feature cache) on 2 real gloo ranks under
``torchrun`` against the same recipe in one process."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from distill import data as data_module
from distill.checkpoint import Ranks, run_sharded, shard_bounds
from distill.config import DataConfig

from ..conftest import run_cli, write_recipe

pytestmark = pytest.mark.xdist_group("distributed")


def simulated_world(n: int) -> list[Ranks]:
    """``n`` ranks as threads of this process: a shared barrier, and a gather through shared slots."""
    barrier = threading.Barrier(n, timeout=120)
    slots: list = [None] * n

    def ranks(r: int) -> Ranks:
        def gather(obj) -> list:
            slots[r] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()  # nobody overwrites a slot before every rank has read them all
            return out

        return Ranks(r, n, barrier.wait, gather)

    return [ranks(r) for r in range(n)]


def run_world(n: int, fn) -> list:
    """``fn(ranks)`` on every rank of a simulated world of ``n``; the results in rank order (a rank's error is raised)."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(fn, ranks) for ranks in simulated_world(n)]
        return [f.result() for f in futures]


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` by relative path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def leftovers(folder: Path) -> list[str]:
    """Work folders or temporary files left anywhere under ``folder``."""
    return [str(p) for p in folder.rglob("*") if ".parts" in p.name or ".tmp-" in p.name]


@pytest.fixture(scope="module")
def tokenizer_dir():
    from distill.testbed import SHIPPED_TARGET

    return SHIPPED_TARGET


def tokenizer_of(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class Killed(Exception):
    """A stand-in for SIGKILL in the middle of a shard."""


# --------------------------------------------------------------------------------------------------
# The dealing and merging itself
# --------------------------------------------------------------------------------------------------


def test_shard_bounds_cover_the_items_in_order_evenly():
    for n, world, per in [(11, 3, 100), (11, 3, 3), (2, 3, 100), (0, 3, 5), (8192 * 2 + 1, 2, 8192), (5, 1, 2)]:
        bounds = shard_bounds(n, world, per)
        assert [lo for lo, _ in bounds] == [0, *(hi for _, hi in bounds[:-1])][: len(bounds)] and (
            bounds[-1][1] if bounds else 0
        ) == n
        sizes = [hi - lo for lo, hi in bounds]
        assert all(0 < s <= per for s in sizes) and (not sizes or max(sizes) - min(sizes) <= 1), (n, world, per, sizes)
        assert len(bounds) >= min(world, n)
    assert shard_bounds(11, 3, 100) == [(0, 3), (3, 7), (7, 11)]
    assert shard_bounds(100, 1, 30) == shard_bounds(
        100, 3, 30
    )  # enough items: the layout is the world's business no more


def test_run_sharded_deals_what_is_left_and_merges_once(tmp_path):
    """7 units over 3 ranks (3, 2, 2), unit 4 already there from a killed run: only the other 6 are
    written (each exactly once, by the rank dealt it), then one merge by the main rank, which every rank
    waits for."""
    shards = [tmp_path / f"{i}.txt" for i in range(7)]
    shards[4].write_text("4")
    merges, written = [], []

    def job(ranks: Ranks):
        def write(i):
            written.append((ranks.rank, i))
            shards[i].write_text(str(i))
            return i

        result = run_sharded(
            ranks,
            7,
            lambda i: shards[i].exists(),
            write,
            lambda: merges.append("".join(p.read_text() for p in shards)),
            "test",
        )
        return result, list(merges)

    results = run_world(3, job)
    todo = [0, 1, 2, 3, 5, 6]
    assert sorted(written) == sorted((k % 3, i) for k, i in enumerate(todo))
    assert all(result == [[0, 3], [1, 5], [2, 6]] for result, _ in results)
    assert merges == ["0123456"] and all(seen == ["0123456"] for _, seen in results)  # merged before anyone went on


def test_run_sharded_refuses_units_a_rank_cannot_see(tmp_path):
    """A rank that does not see another's finished unit (no shared filesystem) raises, and so do the others."""

    def job(ranks: Ranks):
        mine = tmp_path / f"rank{ranks.rank}"
        mine.mkdir(exist_ok=True)
        return run_sharded(
            ranks, 2, lambda i: (mine / str(i)).exists(), lambda i: (mine / str(i)).touch(), lambda: None, "test"
        )

    with pytest.raises(RuntimeError, match="missing on others"):
        run_world(2, job)


# --------------------------------------------------------------------------------------------------
# Tokenizing
# --------------------------------------------------------------------------------------------------

TEXTS = [f"def f{i}(x):\n    return x * {i}  # " + "word " * (i % 5) for i in range(11)]


def stream_in(cache: Path, monkeypatch, world: int, texts=TEXTS, tokenizer_dir=None) -> list:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache))
    return run_world(world, lambda ranks: data_module._tokenized_stream(texts, tokenizer_of(tokenizer_dir), "s", ranks))


def test_token_stream_of_three_uneven_ranks_is_one_ranks_bytes(tmp_path, monkeypatch, tokenizer_dir):
    """11 documents as 3 shards (3, 4, 4 documents), a list and the same rows in Arrow: byte for byte
    the stream one process writes, every rank tokenized one shard, every rank returns the whole stream."""
    [(one, _)] = stream_in(tmp_path / "one", monkeypatch, 1, tokenizer_dir=tokenizer_dir)
    three = stream_in(tmp_path / "three", monkeypatch, 3, tokenizer_dir=tokenizer_dir)
    for tokens, counts in three:
        assert counts == [1, 1, 1]
        np.testing.assert_array_equal(tokens, one)
    assert tree_digest(tmp_path / "one" / "tokens") == tree_digest(tmp_path / "three" / "tokens")
    assert not leftovers(tmp_path)

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    arrow = data_module.load_text_splits(DataConfig(source="files", train_files=[str(path)], val_files=[str(path)]))
    assert isinstance(arrow.train, data_module.DatasetColumn)
    for tokens, counts in stream_in(tmp_path / "arrow", monkeypatch, 3, arrow.train, tokenizer_dir):
        assert counts == [1, 1, 1]
        np.testing.assert_array_equal(tokens, one)


def test_a_killed_tokenizing_run_keeps_its_shards(tmp_path, monkeypatch, tokenizer_dir):
    """Shards of 3 documents (4 of them); one process is killed in its second shard: the first stays,
    nothing half-written does. Three ranks finish the other three (one each) to the same bytes."""
    [(reference, _)] = stream_in(tmp_path / "reference", monkeypatch, 1, tokenizer_dir=tokenizer_dir)
    monkeypatch.setattr(data_module, "SHARD_RECORDS", 3)
    real, calls = data_module._record_batches, []

    def dies_in_the_second_shard(*args):
        calls.append(args)
        if len(calls) == 2:
            raise Killed
        yield from real(*args)

    monkeypatch.setattr(data_module, "_record_batches", dies_in_the_second_shard)
    with pytest.raises(Killed):
        stream_in(tmp_path / "killed", monkeypatch, 1, tokenizer_dir=tokenizer_dir)
    parts = next((tmp_path / "killed" / "tokens").glob(".s-*.parts"))
    assert [p.name for p in parts.iterdir()] == ["00000-of-00004.bin"]  # no temporary file, no final file
    assert not list((tmp_path / "killed" / "tokens").glob("*.npy"))
    monkeypatch.setattr(data_module, "_record_batches", real)
    for tokens, counts in stream_in(tmp_path / "killed", monkeypatch, 3, tokenizer_dir=tokenizer_dir):
        assert counts == [1, 1, 1]
        np.testing.assert_array_equal(tokens, reference)
    assert not leftovers(tmp_path / "killed")


def test_examples_of_three_ranks_are_one_ranks_bytes(tmp_path, monkeypatch, tokenizer_dir):
    records = [{"prompt": f"# task {i}\n", "response": "pass  " * (i % 4 + 1)} for i in range(7)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(source="files", train_files=[str(tmp_path / "r.jsonl")], format="prompt_response", seq_len=12)
    out = {}
    for world in (1, 3):
        monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / str(world)))
        out[world] = run_world(
            world,
            lambda ranks: data_module._tokenized_examples(records, tokenizer_of(tokenizer_dir), cfg, "ex", ranks, None),
        )
    assert [counts for *_, counts in out[3]] == [[1, 1, 1]] * 3
    assert tree_digest(tmp_path / "1" / "examples") == tree_digest(tmp_path / "3" / "examples")
    ids, mask, _ = out[1][0]
    assert ids.shape == mask.shape == (7, 13) and mask.sum() > 0 and not leftovers(tmp_path)
    for got_ids, got_mask, _ in out[3]:  # every rank reads the whole arrays
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_mask, mask)


# --------------------------------------------------------------------------------------------------
# Regenerating
# --------------------------------------------------------------------------------------------------


class ScriptedAnswers:
    """Answers drawn from the batch's seed alone (what the sharding must preserve), no model."""

    fail_at: int | None = None
    calls = 0

    def __init__(self, target, tokenizer, template_kwargs=None):
        self.device = torch.device("cpu")

    def __call__(self, prompts, max_new_tokens, temperature, top_p, top_k, seed):
        type(self).calls += 1
        if type(self).calls == self.fail_at:
            raise Killed
        rng = np.random.default_rng(seed)
        return [
            (
                p["prompt_ids"],
                rng.integers(5, 60, size=int(rng.integers(1, max_new_tokens + 1))).tolist(),
                bool(rng.integers(2)),
                {},
            )
            for p in prompts
        ]


def answer_in(folder: Path, world: int, tokenizer_dir) -> list[list[dict]]:
    """Three files of uneven length (7, 3 and 1 prompts, batches of 2: 4 + 2 + 1 batches) answered by ``world`` ranks."""
    from distill.regenerate import AnswerJob, answer_jobs

    prompts = [{"prompt": f"p{i}", "prompt_ids": [7, 8, i]} for i in range(7)]
    jobs = [
        AnswerJob(folder / "a.jsonl", prompts, 0.7, 1),
        AnswerJob(folder / "b.jsonl", prompts[:3], 0.0, 2),
        AnswerJob(folder / "c.jsonl", prompts[:1], 1.0, 3),
    ]
    return run_world(
        world,
        lambda ranks: answer_jobs(None, tokenizer_of(tokenizer_dir), jobs, max_new_tokens=6, batch_size=2, ranks=ranks),
    )


def test_regeneration_of_three_ranks_writes_one_processes_files_and_resumes(tmp_path, monkeypatch, tokenizer_dir):
    """7 batches over 3 ranks (3, 2, 2): the three files are one process' bytes, and every rank returns
    the same record. Then a run killed at its third batch, with an append log holding one more complete
    batch and a torn line: three ranks answer only what is left, to the same bytes."""
    from distill import regenerate

    monkeypatch.setattr(regenerate, "InProcessAnswers", ScriptedAnswers)
    monkeypatch.setattr(ScriptedAnswers, "calls", 0)
    answer_in(tmp_path / "one", 1, tokenizer_dir)
    reference = tree_digest(tmp_path / "one")
    assert sorted(reference) == ["a.jsonl", "b.jsonl", "c.jsonl"]
    records = answer_in(tmp_path / "three", 3, tokenizer_dir)
    assert tree_digest(tmp_path / "three") == reference
    assert records[0] == records[1] == records[2]
    assert [sum(col) for col in zip(*(r["batches_by_rank"] for r in records[0]))] == [3, 2, 2]
    assert [r["records"] for r in records[0]] == [7, 3, 1]

    killed = tmp_path / "killed"
    monkeypatch.setattr(ScriptedAnswers, "calls", 0)
    monkeypatch.setattr(ScriptedAnswers, "fail_at", 3)
    with pytest.raises(Killed):
        answer_in(killed, 1, tokenizer_dir)
    assert sorted(p.name for p in (killed / "a.jsonl.parts").iterdir()) == [
        "00000000-00000002.jsonl",
        "00000002-00000004.jsonl",
    ]
    lines = (tmp_path / "one" / "a.jsonl").read_text().splitlines()
    (killed / "a.jsonl.partial").write_text("\n".join(lines[4:6]) + "\n" + lines[6][:10])  # batch 4-5 complete, 6 torn
    monkeypatch.setattr(ScriptedAnswers, "fail_at", None)
    resumed = answer_in(killed, 3, tokenizer_dir)
    assert tree_digest(killed) == reference  # no batch files, no log left
    assert [sum(col) for col in zip(*(r["batches_by_rank"] for r in resumed[0]))] == [2, 1, 1]  # 7 - 3 batches
    assert [r["tokens_per_s"] is not None for r in resumed[0]] == [True, True, True]


# --------------------------------------------------------------------------------------------------
# Caching features
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    from distill.models import build_causal_lm, tiny_target

    folder = tmp_path_factory.mktemp("random-target")
    torch.manual_seed(0)
    build_causal_lm(tiny_target().model_copy(update={"num_layers": 3}), 97).save_pretrained(folder)
    return folder


def cache_in(folder: Path, world: int, target_dir: Path, fail_at: int | None = None) -> list[list[int]]:
    """Train (50 windows) and val (10) caches in shards of 9 windows (shard_windows 8 rounded up to
    batches of 3): 6 + 2 shards, each rank with its own copy of the target."""
    from transformers import AutoModelForCausalLM

    from distill.base.features import FeatureCapture
    from distill.data import PackedWindows
    from distill.feature_cache import write_feature_caches

    tokens = np.random.default_rng(0).integers(0, 97, 451).astype(np.uint16)
    caches = [
        (PackedWindows(tokens, 9, shuffle=False), folder / "train", {"split": "train"}),
        (PackedWindows(tokens[:91], 9, shuffle=False), folder / "val", {"split": "val"}),
    ]

    # each rank's copy loaded here, one after another: transformers' loading patches process-wide state
    # (its init-skipping contexts) and is not thread-safe; loaded inside the threads, later loads in the
    # process lost their tied heads
    targets = [AutoModelForCausalLM.from_pretrained(target_dir).eval() for _ in range(world)]

    def job(ranks: Ranks):
        capture = FeatureCapture(targets[ranks.rank], [0, 2])
        if fail_at is not None:
            calls, run = [], capture.__call__
            capture = type(
                "Dying",
                (),
                {
                    "layer_ids": capture.layer_ids,
                    "__call__": lambda self, ids: (
                        calls.append(1) or (len(calls) == fail_at and (_ for _ in ()).throw(Killed())) or run(ids)
                    ),
                },
            )()
        with torch.no_grad():
            return write_feature_caches(capture, caches, torch.float32, batch_size=3, shard_windows=8, ranks=ranks)

    return run_world(world, job)


def test_feature_caches_of_three_ranks_are_one_ranks_bytes_and_resume(tmp_path, random_target):
    """8 shards of two caches over 3 ranks (3, 3, 2): the same folders, byte for byte, as one process
    writes. One process killed in its third shard (the seventh batch) leaves two shards and no cache;
    three ranks finish the other six (2 each) to the same bytes."""
    from distill.feature_cache import CachedFeatureWindows

    assert cache_in(tmp_path / "one", 1, random_target) == [[8]]
    reference = tree_digest(tmp_path / "one")
    assert sorted(reference) == ["train/manifest.json"] + [f"train/shard_{s:05d}.safetensors" for s in range(6)] + [
        "val/manifest.json",
        "val/shard_00000.safetensors",
        "val/shard_00001.safetensors",
    ]
    counts = cache_in(tmp_path / "three", 3, random_target)
    assert counts == [[3, 3, 2]] * 3 and tree_digest(tmp_path / "three") == reference
    manifest = json.loads((tmp_path / "three" / "train" / "manifest.json").read_text())
    assert [s["windows"] for s in manifest["shards"]] == [9, 9, 9, 9, 9, 5] and manifest["num_windows"] == 50
    read = CachedFeatureWindows(tmp_path / "three" / "train", {"num_windows": 50, "layer_ids": [0, 2]}, shuffle=False)
    assert torch.equal(
        read.collate([49]).input_ids[0], torch.from_numpy(np.random.default_rng(0).integers(0, 97, 451)[441:451])
    )

    killed = tmp_path / "killed"
    with pytest.raises(Killed):
        cache_in(killed, 1, random_target, fail_at=7)  # batches of 3: shard 0 is batches 1-3, shard 1 4-6
    assert not (killed / "train").exists()
    [parts] = killed.glob("train.parts-*")
    assert sorted(p.name for p in parts.iterdir()) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    assert cache_in(killed, 3, random_target) == [[2, 2, 2]] * 3
    assert tree_digest(killed) == reference and not leftovers(killed)


# --------------------------------------------------------------------------------------------------
# Two real ranks
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_regenerate_tokenize_and_cache_features_like_one(tmp_path, tiny_target_dir, monkeypatch):
    """A drafter recipe that regenerates its data (12 train prompts at two temperatures, 4 held out:
    5 batches) and trains from an offline feature cache, run in this process and on 2 gloo ranks under
    ``torchrun``: the answers, the tokenized examples and the feature caches are the same files, byte
    for byte; provenance says both ranks worked at each stage."""
    from recipes import train_drafter
    from recipes.registry import parse_recipe

    from ..conftest import drafter_recipe

    def recipe(name: str) -> dict:
        raw = drafter_recipe(
            tmp_path / name, tiny_target_dir, "dflash", max_steps=2, eval_every=2, save_every=2, eval_batches=1
        ).model_dump(mode="json")
        raw["regenerate"] = {
            "train_prompts": 12,
            "val_prompts": 4,
            "prompt_tokens": 12,
            "max_new_tokens": 16,
            "temperatures": [0.0, 0.7],
            "batch_size": 4,
        }
        raw["features"] = {"mode": "offline", "cache_dir": str(tmp_path / name / "features"), "dtype": "float32"}
        return raw

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache1"))
    train_drafter.main(parse_recipe(recipe("one")))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29523"]
    done = run_cli(
        "run",
        str(write_recipe(tmp_path / "two.yaml", recipe("two"))),
        launcher=torchrun,
        env={"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "DRAFTSMITH_CACHE": str(tmp_path / "cache2")},
    )
    assert done.returncode == 0, done.stderr[-3000:]

    one, two = (json.loads((tmp_path / run / "provenance.json").read_text()) for run in ("one", "two"))
    assert one["world_size"] == 1 and two["world_size"] == 2, "torchrun did not give 2 real ranks"
    assert two["data"]["regenerated"]["batches_by_rank"] == [3, 2] and one["data"]["regenerated"][
        "batches_by_rank"
    ] == [5]
    assert two["data"]["tokenized_by_rank"] == {"train": [1, 1], "val": [1, 1]}
    assert two["data"]["features_by_rank"] == [1, 1] and one["data"]["features_by_rank"] == [2]
    key = two["data"]["regenerated"]["key"]
    assert key == one["data"]["regenerated"]["key"]
    for a, b in [
        (tmp_path / "cache1" / "regenerated" / key, tmp_path / "cache2" / "regenerated" / key),
        (tmp_path / "cache1" / "examples", tmp_path / "cache2" / "examples"),
        (tmp_path / "one" / "features", tmp_path / "two" / "features"),
    ]:
        answers = tree_digest(a)
        answers.pop("manifest.json", None)  # it records tokens/s and who did what
        expected = tree_digest(b)
        expected.pop("manifest.json", None)
        assert answers == expected and len(answers) >= 3, (a, b)
    assert not leftovers(tmp_path / "cache2") and not leftovers(tmp_path / "two")


@pytest.mark.slow
def test_the_regenerate_recipe_on_two_ranks_writes_one_processes_file(tmp_path, tiny_target_dir):
    """``recipes/regenerate`` (10 prompts sampled at T = 1 in batches of 2) on 2 gloo ranks under ``torchrun``
    and in this process: the same ``data.jsonl``, byte for byte, the batches dealt 3 and 2."""
    from recipes import regenerate
    from recipes.registry import parse_recipe

    def recipe(name: str) -> dict:
        return {
            "recipe": "regenerate",
            "output_dir": str(tmp_path / name),
            "seed": 1,
            "target": {"path": str(tiny_target_dir)},
            "prompts": {"from_corpus": 10, "prompt_tokens": 12},
            "generation": {"max_new_tokens": 10, "batch_size": 2, "temperature": 1.0},
            "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
            "torch_threads": 1,
        }

    regenerate.main(parse_recipe(recipe("one")))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29524"]
    done = run_cli(
        "run",
        str(write_recipe(tmp_path / "two.yaml", recipe("two"))),
        launcher=torchrun,
        env={"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["batches_by_rank"] == [3, 2] and summary["records"] == 10
    assert (tmp_path / "two" / "data.jsonl").read_bytes() == (tmp_path / "one" / "data.jsonl").read_bytes()
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "data.jsonl",
        "provenance.json",
        "recipe.yaml",
        "summary.json",
    ]
