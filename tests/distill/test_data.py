"""The testbed corpus, tokenizer and window order: deterministic, disjoint, resumable, shardable."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from distill.config import DataConfig, TokenizerConfig
from distill.data import PackedWindows, build_tokenizer, load_text_splits, tokenize_stream
from distill.testbed import SPECIAL_TOKENS, is_held_out, stdlib_documents


@pytest.fixture(scope="module")
def small():
    cfg = DataConfig(source="stdlib", max_documents=30, val_fraction=0.1, seq_len=32)
    splits = load_text_splits(cfg)
    tok = build_tokenizer(TokenizerConfig(vocab_size=400), splits)
    return cfg, splits, tok


def test_stdlib_corpus_excludes_tests_and_is_sorted():
    docs = stdlib_documents()
    paths = [d.path for d in docs]
    assert len(docs) > 300 and paths == sorted(paths)
    assert not any(part in ("test", "tests", "idle_test") for p in paths for part in p.split("/")[:-1])
    assert "os.py" in paths


def test_split_is_stable_and_disjoint(small):
    _, splits, _ = small
    assert splits.train and splits.val and not set(splits.train) & set(splits.val)
    assert (
        load_text_splits(DataConfig(source="stdlib", max_documents=30, val_fraction=0.1)).fingerprint
        == splits.fingerprint
    )
    assert is_held_out("a/b.py", 0.5) == is_held_out("a/b.py", 0.5)


def test_tokenizer_round_trips_and_has_special_tokens(small):
    _, splits, tok = small
    text = splits.train[0][:500]
    assert tok.decode(tok(text)["input_ids"]) == text
    for special in SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(special) is not None
    assert tok.eos_token == "<|endoftext|>" and tok.mask_token == "<|mask|>" and tok.pad_token == "<|pad|>"
    assert len(tok) == 400


def test_tokenizer_training_is_deterministic(small, tmp_path, monkeypatch):
    _, splits, tok = small
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))  # force a retrain
    again = build_tokenizer(TokenizerConfig(vocab_size=400), splits)
    assert json.loads(again.backend_tokenizer.to_str()) == json.loads(tok.backend_tokenizer.to_str())


def test_token_stream_is_cached_and_eos_separated(small):
    _, splits, tok = small
    a = tokenize_stream(splits.val, tok, "val")
    b = tokenize_stream(splits.val, tok, "val")
    assert np.array_equal(a, b) and a.dtype == np.uint16
    assert (np.asarray(a) == tok.eos_token_id).sum() == len(splits.val)


def test_window_order_is_a_function_of_samples_consumed():
    tokens = np.arange(1000, dtype=np.uint16)
    w = PackedWindows(tokens, 9, seed=3)
    n = len(w)
    first_epoch = [w.window_index(k) for k in range(n)]
    assert sorted(first_epoch) == list(range(n))  # a permutation
    assert [w.window_index(k) for k in range(n, 2 * n)] != first_epoch  # reshuffled per epoch
    fresh = PackedWindows(tokens, 9, seed=3)
    assert torch.equal(fresh.batch(n + 5, 4).input_ids, w.batch(n + 5, 4).input_ids)  # O(1) seek = resume
    x = w.window(0)
    assert x.shape == (10,) and torch.equal(x, torch.arange(10))


def test_two_ranks_see_what_one_rank_sees_with_double_accumulation():
    w = PackedWindows(np.arange(5000, dtype=np.uint16), 16, seed=0)
    B, before = 3, 36
    one = torch.cat([w.micro_batch(before, m, 0, 1, B).input_ids for m in range(2)])
    two = torch.cat([w.micro_batch(before, 0, r, 2, B).input_ids for r in range(2)])
    assert torch.equal(one, two)


def test_local_jsonl_through_datasets(tmp_path):
    rows = [{"text": f"def f{i}(x):\n    return x + {i}\n"} for i in range(50)]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    splits = load_text_splits(DataConfig(source="files", train_files=[str(path)], val_fraction=0.1))
    assert len(splits.train) == 45 and len(splits.val) == 5
    with pytest.raises(ValueError, match="column 'content'"):
        load_text_splits(DataConfig(source="files", train_files=[str(path)], text_field="content"))


def test_dataset_files_stay_in_arrow_and_tokenize_like_a_list(tmp_path, small):
    """A dataset file's split is a DatasetColumn (no Python list of the corpus) whose token stream is
    exactly the one the list path writes, read back memory-mapped; records tokenize alike too."""
    from distill.data import DatasetColumn, make_windows, tokenize_examples

    _, _, tok = small
    rows = [
        {"text": f"def f{i}(x):\n    return x * {i}\n", "prompt": f"# {i}\n", "response": f"pass  # {i}"}
        for i in range(60)
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(source="files", train_files=[str(path)], val_fraction=0.1, seq_len=16)
    splits = load_text_splits(cfg)
    assert isinstance(splits.train, DatasetColumn) and isinstance(splits.train[3], str)
    as_list = list(splits.train)
    assert as_list[3] == splits.train[3] and len(as_list) == len(splits.train) == 54
    streamed = tokenize_stream(splits.train, tok, "arrow-test")
    assert isinstance(streamed, np.memmap)
    np.testing.assert_array_equal(streamed, tokenize_stream(as_list, tok, "list-test"))
    assert load_text_splits(cfg).fingerprint == splits.fingerprint  # the dataset's own fingerprint: stable
    records = load_text_splits(cfg.model_copy(update={"format": "prompt_response"}))
    ids, mask = tokenize_examples(records.train, tok, cfg.model_copy(update={"format": "prompt_response"}), "rec")
    ids_list, mask_list = tokenize_examples(
        list(records.train), tok, cfg.model_copy(update={"format": "prompt_response"}), "rec-list"
    )
    np.testing.assert_array_equal(ids, ids_list)
    np.testing.assert_array_equal(mask, mask_list)
    windows = make_windows(splits.train, tok, cfg, "train")
    assert windows.batch(0, 4).input_ids.shape == (4, 17)


def test_memory_stays_bounded_on_a_dataset_much_larger_than_a_batch(tmp_path):
    """Parquet corpora of 4,000 and 16,000 documents (2 and 7 MB of text) to training windows with the
    testbed target's tokenizer: the Python heap's peak is the same for both (a batch's worth) and well
    under the larger corpus' text, which a list of its documents alone exceeds. (datasets' JSON reader
    reads 10 MB blocks: bounded too, by that.)"""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from distill.data import make_windows
    from distill.testbed import ASSETS

    tok = AutoTokenizer.from_pretrained(ASSETS / "testbed_target")
    rng = np.random.default_rng(0)
    words = np.array(["import", "def", "return", "self", "value", "for", "in", "range", "if", "else", "None", "print"])
    texts = [" ".join(rng.choice(words, 90)) + f" {i}\n" for i in range(16_000)]
    peaks = []
    for n in (4_000, 16_000):
        path = tmp_path / f"corpus{n}.parquet"
        pq.write_table(pa.table({"text": texts[:n]}), path, row_group_size=1000)
        cfg = DataConfig(source="files", train_files=[str(path)], val_fraction=0.01, seq_len=64)
        load_text_splits(cfg)  # the Arrow cache built, modules imported: not the data's memory
        tracemalloc.start()
        windows = make_windows(load_text_splits(cfg).train, tok, cfg, "train")
        batch = windows.batch(0, 8)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert len(windows) > 100 * 8 and batch.input_ids.shape == (8, 65)  # many batches' worth of windows
    text_bytes = sum(len(t) for t in texts)
    assert peaks[1] < 1.1 * peaks[0] and peaks[1] < 0.75 * text_bytes, (peaks, text_bytes)
    tracemalloc.start()
    as_list = list(texts)  # what a Python list of the corpus costs (the strings themselves and the list)
    as_list = [t.encode().decode() for t in as_list]
    list_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert list_peak > text_bytes > peaks[1], (list_peak, text_bytes, peaks)
