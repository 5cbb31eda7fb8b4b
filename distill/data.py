"""Text in, fixed-length token windows out, in an order that a resumed run can reproduce exactly.

Pipeline: ``load_text_splits`` (stdlib testbed corpus, local files or a hub dataset, all through
``datasets`` except the stdlib walk) -> ``build_tokenizer`` -> ``tokenize_stream`` (documents joined
with EOS into one token stream, cached on disk by fingerprint) -> :class:`PackedWindows`.

Sample order
    The stream is cut into ``n`` non-overlapping windows of ``seq_len + 1`` tokens (inputs and
    shifted labels). Epoch ``e`` visits them in the permutation drawn from ``(seed, e)``. Global
    sample ``k`` is window ``perm_{k // n}[k % n]``, so a run's whole data order is a pure function of
    the number of samples consumed: resuming needs that one integer, not a replay.

Sharding
    An optimizer step consumes ``micro_batch * grad_accum * world_size`` samples. Micro-batch ``m``
    of rank ``r`` takes the ``(m * world_size + r)``-th block of ``micro_batch`` samples, so two
    processes with accumulation 1 see exactly the samples one process sees with accumulation 2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import DATA_SUFFIXES, DataConfig, TokenizerConfig
from .testbed import atomic_dir, cache_dir, fingerprint_texts, split_documents, stdlib_documents, train_bpe_tokenizer


@dataclass
class TextSplits:
    train: list[str]
    val: list[str]
    fingerprint: str  # of the raw text, both splits
    description: str


def load_text_splits(cfg: DataConfig, seed: int = 0) -> TextSplits:
    if cfg.source == "stdlib":
        docs = stdlib_documents(cfg.max_documents)
        train, val = split_documents(docs, cfg.val_fraction)
        train_t, val_t = [d.text for d in train], [d.text for d in val]
        desc = f"stdlib source: {len(train)} train / {len(val)} held-out files"
    else:
        from datasets import load_dataset

        if cfg.source == "files":
            def load(files):
                kind = DATA_SUFFIXES[Path(files[0]).suffix]
                if any(DATA_SUFFIXES[Path(f).suffix] != kind for f in files):
                    raise ValueError(f"data files mix formats: {files}")
                return load_dataset(kind, data_files=files, split="train")
            ds = load(cfg.train_files)
            val_ds = load(cfg.val_files) if cfg.val_files else None
        else:
            ds = load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split)
            val_ds = None
        if cfg.text_field not in ds.column_names:
            raise ValueError(f"data.text_field '{cfg.text_field}' is not a column of the data (columns: {ds.column_names})")
        if cfg.max_documents:
            ds = ds.select(range(min(cfg.max_documents, len(ds))))
        if val_ds is None:
            parts = ds.train_test_split(test_size=cfg.val_fraction, seed=seed, shuffle=True)
            ds, val_ds = parts["train"], parts["test"]
        train_t, val_t = list(ds[cfg.text_field]), list(val_ds[cfg.text_field])
        desc = f"{cfg.source}: {len(train_t)} train / {len(val_t)} held-out documents"
    fp = fingerprint_texts(train_t + ["\x00split\x00"] + val_t, f"val_fraction={cfg.val_fraction}")
    return TextSplits(train_t, val_t, fp, desc)


def build_tokenizer(cfg: TokenizerConfig, splits: TextSplits):
    """The recipe's tokenizer: an existing one by path, or a byte-level BPE trained on the train split."""
    from transformers import AutoTokenizer

    if cfg.path:
        return AutoTokenizer.from_pretrained(cfg.path)
    key = fingerprint_texts(splits.train, f"bpe-v1/{cfg.vocab_size}")
    folder = cache_dir() / "tokenizers" / f"bpe-{key}"
    if not (folder / "tokenizer.json").exists():
        with atomic_dir(folder) as tmp:
            train_bpe_tokenizer(splits.train, cfg.vocab_size, tmp)
    return AutoTokenizer.from_pretrained(folder)


def tokenizer_fingerprint(tokenizer) -> str:
    return fingerprint_texts([tokenizer.backend_tokenizer.to_str()]) if hasattr(tokenizer, "backend_tokenizer") else tokenizer.name_or_path


def tokenize_stream(texts: list[str], tokenizer, name: str = "stream") -> np.ndarray:
    """Documents joined by EOS into one token array (uint16 when the vocabulary fits), cached."""
    key = fingerprint_texts(texts, tokenizer_fingerprint(tokenizer))
    path = cache_dir() / "tokens" / f"{name}-{key}.npy"
    if path.exists():
        return np.load(path, mmap_mode="r")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token; documents could not be separated")
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.uint32
    chunks = []
    for start in range(0, len(texts), 256):
        for ids in tokenizer(texts[start:start + 256], add_special_tokens=False)["input_ids"]:
            chunks.append(np.asarray(ids + [eos], dtype=dtype))
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, stream)
    os.replace(tmp, path)
    return stream


@dataclass
class Batch:
    """What the trainer hands a loss function.

    ``input_ids`` [B, L+1] token windows; ``loss_mask`` [B, L+1] marks the tokens to score (1) where
    only some are (responses, not prompts or padding), None when all are; ``aux`` / ``last`` are the
    target's features when they come from a cache (:mod:`distill.feature_cache`) rather than live.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    last: torch.Tensor | None = None

    def to(self, device) -> "Batch":
        move = lambda t, f=False: None if t is None else (t.to(device).float() if f else t.to(device))  # noqa: E731
        return Batch(move(self.input_ids), move(self.loss_mask), move(self.aux, True), move(self.last, True))

    def __len__(self) -> int:
        return self.input_ids.shape[0]


class PackedWindows:
    """Non-overlapping ``seq_len + 1``-token windows of a token stream, visited in seeded epochs."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, shuffle: bool = True,
                 max_windows: int | None = None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_windows = (len(tokens) - 1) // seq_len
        if max_windows:
            self.num_windows = min(self.num_windows, max_windows)
        if self.num_windows < 1:
            raise ValueError(f"only {len(tokens)} tokens: not even one window of seq_len={seq_len}")
        self._perm_epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.num_windows

    @property
    def num_tokens(self) -> int:
        return self.num_windows * self.seq_len

    def window_index(self, k: int) -> int:
        epoch, i = divmod(k, self.num_windows)
        if not self.shuffle:
            return i
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return int(self._perm[i])

    def window(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))

    def batch(self, first_sample: int, size: int) -> Batch:
        """Samples ``first_sample .. first_sample + size - 1``."""
        return self.collate([self.window_index(k) for k in range(first_sample, first_sample + size)])

    def collate(self, indices: list[int]) -> Batch:
        return Batch(torch.stack([self.window(i) for i in indices]))

    def micro_batch(self, samples_before_step: int, micro: int, rank: int, world: int, size: int) -> Batch:
        return self.batch(samples_before_step + (micro * world + rank) * size, size)

    def epoch_of(self, samples: int) -> float:
        return samples / self.num_windows
