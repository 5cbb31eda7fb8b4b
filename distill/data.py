"""Text in, fixed-length token windows out, in an order that a resumed run can reproduce exactly.

Pipeline: ``load_text_splits`` (stdlib testbed corpus, local files or a hub dataset, all through
``datasets`` except the stdlib walk) -> ``build_tokenizer`` -> ``tokenize_stream`` (documents joined
with EOS into one token stream, cached on disk by fingerprint) -> :class:`PackedWindows`.

Sample order
    The stream is cut into ``n`` non-overlapping windows of ``seq_len + 1`` tokens (inputs and
    shifted labels). Epoch ``e`` visits them in the permutation drawn from ``(seed, e)``. Global
    sample ``k`` is window ``perm_{k // n}[k % n]``, so a run's whole data order is a pure function of
    the number of samples consumed: resuming needs that one integer, not a replay.

Memory
    Hub datasets and dataset files (json/jsonl, parquet, csv, text) stay in ``datasets``' Arrow
    tables, memory-mapped from disk: a split is a :class:`DatasetColumn`, never a Python list of the
    corpus. Tokenizing reads the records in batches and writes the token stream (or the example
    windows) straight to files on disk, batch by batch; training memory-maps the result and reads the
    windows it needs. Memory stays bounded by a batch, whatever the corpus size.

Preparation on every rank
    Tokenizing is divided among the ranks (``ranks``, :class:`~distill.checkpoint.Ranks`): the records
    are cut into contiguous shards of at most :data:`SHARD_RECORDS` (at least one a rank), dealt
    round-robin; each rank writes its shards under ``.<name>-<key>.parts/`` (each published atomically)
    and the main rank concatenates them, in record order, into the cached file: the same bytes whatever
    the number of ranks. A killed run keeps its finished shards.

Sharding
    Every rank memory-maps the same token file and reads only the windows of its own micro-batches.
    An optimizer step consumes ``micro_batch * grad_accum * world_size`` samples. Micro-batch ``m``
    of rank ``r`` takes the ``(m * world_size + r)``-th block of ``micro_batch`` samples, so two
    processes with accumulation 1 see exactly the samples one process sees with accumulation 2.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .chat import conversation_pieces, read_conversation, tokenized
from .checkpoint import Ranks, fsync_path, run_sharded, shard_bounds, write_file_atomically
from .checks import jsonl_records
from .config import DATA_SUFFIXES, DataConfig, RecipeError, TokenizerConfig
from .testbed import (
    Document,
    atomic_dir,
    cache_dir,
    fingerprint_texts,
    split_documents,
    stdlib_documents,
    train_bpe_tokenizer,
)


class DatasetColumn(Sequence):
    """One split of a ``datasets.Dataset`` as a read-only sequence of its texts (format ``text``) or
    records (the ``columns`` of each row): what recipes index (prompt snippets) and iterate, while
    Arrow keeps the rows on disk. ``fingerprint`` is the dataset's own (it follows its files and every
    transform), so caches keyed by it need no pass over the data."""

    def __init__(self, dataset, columns: list[str], text: bool):
        self.dataset, self.columns, self.text = dataset, columns, text

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        if not isinstance(i, (int, np.integer)):
            raise TypeError("a DatasetColumn is indexed by one position at a time")
        row = self.dataset[int(i)]
        return row[self.columns[0]] if self.text else {c: row[c] for c in self.columns}

    def __iter__(self):
        for batch in self.dataset.iter(batch_size=1024):
            rows = zip(*(batch[c] for c in self.columns))
            yield from (r[0] for r in rows) if self.text else (dict(zip(self.columns, r)) for r in rows)

    @property
    def fingerprint(self) -> str:
        return f"{self.dataset._fingerprint}/{','.join(self.columns)}"


@dataclass
class TextSplits:
    train: Sequence  # str documents (format "text") or dict records (prompt/response or messages): a list,
    val: Sequence  # or a DatasetColumn for hub datasets and dataset files
    fingerprint: str  # of the raw data, both splits
    description: str


#: columns kept when present: the exact tokens of regenerated records (:mod:`distill.regenerate`), and
#: the tool definitions a conversation is rendered with
EXTRA_COLUMNS = ("prompt_ids", "response_ids", "eos", "turns", "tools")


def _columns_needed(cfg: DataConfig) -> list[str]:
    return {
        "text": [cfg.text_field],
        "prompt_response": [cfg.prompt_field, cfg.response_field],
        "messages": [cfg.turns_field],
    }[cfg.format]


def load_text_splits(cfg: DataConfig, seed: int = 0) -> TextSplits:
    """The train and held-out records of the data section (documents, or chat records)."""
    if cfg.source == "stdlib":
        docs = stdlib_documents(cfg.max_documents)
        train, val = split_documents(docs, cfg.val_fraction)
        train_r, val_r = [d.text for d in train], [d.text for d in val]
        desc = f"stdlib source: {len(train)} train / {len(val)} held-out files"
    elif cfg.source == "files" and DATA_SUFFIXES[Path(cfg.train_files[0]).suffix] == "document":
        if any(DATA_SUFFIXES[Path(f).suffix] != "document" for f in cfg.train_files + cfg.val_files):
            raise RecipeError(f"data files mix whole documents with datasets: {cfg.train_files + cfg.val_files}")
        read = lambda files: [Document(f, Path(f).read_text(encoding="utf-8", errors="replace")) for f in files]  # noqa: E731
        train, val = (
            (read(cfg.train_files), read(cfg.val_files))
            if cfg.val_files
            else split_documents(read(cfg.train_files), cfg.val_fraction)
        )
        if cfg.max_documents:
            train = train[: cfg.max_documents]
        train_r, val_r = [d.text for d in train], [d.text for d in val]
        desc = f"files (one document each): {len(train)} train / {len(val)} held-out files"
    else:
        from datasets import load_dataset

        if cfg.source == "files":

            def load(files):
                kind = DATA_SUFFIXES[Path(files[0]).suffix]
                if any(DATA_SUFFIXES[Path(f).suffix] != kind for f in files):
                    raise RecipeError(f"data files mix formats: {files}")
                try:
                    return load_dataset(kind, data_files=files, split="train")
                except Exception as e:  # datasets wraps a malformed file in its own generation error
                    cause = e.__cause__ or e
                    raise RecipeError(
                        f"data files {files}: could not be read as {kind} "
                        f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})"
                    ) from None

            ds = load(cfg.train_files)
            val_ds = load(cfg.val_files) if cfg.val_files else None
        else:
            ds = load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split)
            val_ds = None
        for column in _columns_needed(cfg):
            if column not in ds.column_names:
                raise RecipeError(
                    f"data: column '{column}' (format '{cfg.format}') is not in the data "
                    f"(columns: {ds.column_names}); set data.text_field / prompt_field / response_field / messages_field (or data.chat_schema)"
                )
        if cfg.max_documents:
            ds = ds.select(range(min(cfg.max_documents, len(ds))))
        if val_ds is None:
            parts = ds.train_test_split(test_size=cfg.val_fraction, seed=seed, shuffle=True)
            ds, val_ds = parts["train"], parts["test"]
        cols = _columns_needed(cfg)
        if cfg.format != "text":
            cols += [c for c in EXTRA_COLUMNS if c in ds.column_names and c in val_ds.column_names]
        train_r, val_r = (DatasetColumn(d, cols, cfg.format == "text") for d in (ds, val_ds))
        desc = f"{cfg.source} ({cfg.format}): {len(train_r)} train / {len(val_r)} held-out records"
        fp = fingerprint_texts(
            [train_r.fingerprint, val_r.fingerprint],
            f"val_fraction={cfg.val_fraction}",
            f"format={cfg.format}",
            f"seed={seed}",
        )
        return TextSplits(train_r, val_r, fp, desc)
    as_text = lambda r: r if isinstance(r, str) else json.dumps(r, sort_keys=True)  # noqa: E731
    fp = fingerprint_texts(
        [as_text(r) for r in train_r] + ["\x00split\x00"] + [as_text(r) for r in val_r],
        f"val_fraction={cfg.val_fraction}",
        f"format={cfg.format}",
    )
    return TextSplits(train_r, val_r, fp, desc)


def _records_key(records: Sequence, *extra: str) -> str:
    """A cache key for a split: its dataset's fingerprint, or a hash of every record of a list."""
    if isinstance(records, DatasetColumn):
        return fingerprint_texts([records.fingerprint], *extra)
    return fingerprint_texts([r if isinstance(r, str) else json.dumps(r, sort_keys=True) for r in records], *extra)


def regenerated_text_splits(regenerated: dict) -> TextSplits:
    """The records of a :func:`distill.regenerate.regenerated_splits` result as train / held-out splits."""
    hint = f"; delete {regenerated.get('folder', 'the cache folder')} to regenerate the answers"
    read = lambda files: [row for f in files for _, row in jsonl_records(f, "regenerated answers", hint)]  # noqa: E731
    train, val = read(regenerated["train_files"]), read(regenerated["val_files"])
    return TextSplits(
        train,
        val,
        regenerated["key"],
        f"the target's answers ({regenerated['key']}): {len(train)} train / {len(val)} held-out records",
    )


def build_tokenizer(cfg: TokenizerConfig, splits: TextSplits):
    """The recipe's tokenizer: an existing one by path, or a byte-level BPE trained on the train split."""
    from transformers import AutoTokenizer

    if cfg.path:
        return AutoTokenizer.from_pretrained(cfg.path)
    if splits.train and not isinstance(splits.train[0], str):
        raise ValueError("training a BPE needs plain-text data: give tokenizer.path for prompt/response data")
    key = _records_key(splits.train, f"bpe-v1/{cfg.vocab_size}")
    folder = cache_dir() / "tokenizers" / f"bpe-{key}"
    if not (folder / "tokenizer.json").exists():
        with atomic_dir(folder) as tmp:
            train_bpe_tokenizer(splits.train, cfg.vocab_size, tmp)
    return AutoTokenizer.from_pretrained(folder)


def tokenizer_fingerprint(tokenizer) -> str:
    return (
        fingerprint_texts([tokenizer.backend_tokenizer.to_str()])
        if hasattr(tokenizer, "backend_tokenizer")
        else tokenizer.name_or_path
    )


#: records (documents or examples) per tokenizing shard: one rank's unit of work, and what a killed run keeps
SHARD_RECORDS = 8192
#: records tokenized in one call of the tokenizer (and held in memory at once)
TOKENIZE_BATCH = 256


def _record_batches(records: Sequence, lo: int, hi: int):
    """Records ``lo .. hi-1`` in lists of :data:`TOKENIZE_BATCH`, read in batches from Arrow for a
    :class:`DatasetColumn` (never the whole range at once)."""
    if isinstance(records, DatasetColumn):
        items = iter(DatasetColumn(records.dataset.select(range(lo, hi)), records.columns, records.text))
    else:
        items = (records[i] for i in range(lo, hi))
    while batch := list(itertools.islice(items, TOKENIZE_BATCH)):
        yield batch


def _parts_folder(final: Path) -> Path:
    return final.with_name(f".{final.name.removesuffix('.npy')}.parts")


def _shard_files(parts: Path, bounds: list[tuple[int, int]], suffix: str) -> list[Path]:
    return [parts / f"{i:05d}-of-{len(bounds):05d}{suffix}" for i in range(len(bounds))]


def _token_dtype(tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.uint32)


def tokenize_stream(texts: Sequence[str], tokenizer, name: str = "stream", ranks: Ranks | None = None) -> np.ndarray:
    """Documents joined by EOS into one token array (uint16 when the vocabulary fits), cached on disk
    and memory-mapped. With ``ranks`` every rank tokenizes its shards (module doc); every rank returns
    the whole array."""
    return _tokenized_stream(texts, tokenizer, name, ranks)[0]


def _tokenized_stream(texts: Sequence[str], tokenizer, name: str, ranks: Ranks | None) -> tuple[np.ndarray, list[int]]:
    """:func:`tokenize_stream` and the number of shards each rank tokenized (all 0: read from the cache)."""
    ranks = ranks or Ranks()
    key = _records_key(texts, tokenizer_fingerprint(tokenizer))
    path = cache_dir() / "tokens" / f"{name}-{key}.npy"
    if path.exists():
        shutil.rmtree(_parts_folder(path), ignore_errors=True)  # left by a kill between the merge and its cleanup
        return np.load(path, mmap_mode="r"), [0] * ranks.world
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token; documents could not be separated")
    dtype = _token_dtype(tokenizer)
    bounds = shard_bounds(len(texts), ranks.world, SHARD_RECORDS)
    parts = _parts_folder(path)
    parts.mkdir(parents=True, exist_ok=True)
    shards = _shard_files(parts, bounds, ".bin")

    def write(i: int) -> None:  # the shard's documents, each followed by EOS, as raw tokens
        def tokens(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                for batch in _record_batches(texts, *bounds[i]):
                    for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                        f.write(np.asarray(ids + [eos], dtype=dtype).tobytes())

        write_file_atomically(shards[i], tokens)

    def merge() -> None:  # the shards end to end, in record order
        def stream(tmp: Path) -> None:
            sizes = [shard.stat().st_size // dtype.itemsize for shard in shards]
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(sum(sizes),))
            at = 0
            for shard, size in zip(shards, sizes):
                if size:
                    out[at : at + size] = np.memmap(shard, dtype=dtype, mode="r", shape=(size,))
                at += size
            out.flush()
            del out

        write_file_atomically(path, stream)
        shutil.rmtree(parts, ignore_errors=True)

    counts = run_sharded(
        ranks, len(shards), lambda i: shards[i].exists(), write, merge, f"tokenizing {name} into {path}"
    )
    return np.load(path, mmap_mode="r"), [len(c) for c in counts]


@dataclass
class Batch:
    """What the trainer hands a loss function.

    ``input_ids`` [B, L+1] token windows; ``loss_mask`` [B, L+1] marks the tokens to score (1) where
    only some are (responses, not prompts or padding), None when all are; ``aux`` / ``last`` are the
    target's features when they come from a cache (:mod:`distill.feature_cache`) rather than live;
    ``first_sample`` is the data position of row 0 in training (a function of step, micro-batch and
    rank), for per-batch randomness that a resumed run reproduces.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    last: torch.Tensor | None = None
    first_sample: int | None = None

    def to(self, device) -> Batch:
        move = lambda t, f=False: None if t is None else (t.to(device).float() if f else t.to(device))  # noqa: E731
        return Batch(
            move(self.input_ids), move(self.loss_mask), move(self.aux, True), move(self.last, True), self.first_sample
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]


class PackedWindows:
    """Non-overlapping ``seq_len + 1``-token windows of a token stream, visited in seeded epochs."""

    #: the tokenizing shards each rank wrote for these windows (:func:`make_windows`), None if not made there
    prepared_by_rank: list[int] | None = None

    def __init__(
        self, tokens: np.ndarray, seq_len: int, seed: int = 0, shuffle: bool = True, max_windows: int | None = None
    ):
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

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the windows (what a draft vocabulary is counted from)."""
        used = self.tokens[: self.num_windows * self.seq_len + 1]
        return torch.bincount(torch.from_numpy(used.astype(np.int64)), minlength=vocab_size)

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
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    def batch(self, first_sample: int, size: int) -> Batch:
        """Samples ``first_sample .. first_sample + size - 1``."""
        batch = self.collate([self.window_index(k) for k in range(first_sample, first_sample + size)])
        batch.first_sample = first_sample
        return batch

    def collate(self, indices: list[int]) -> Batch:
        return Batch(torch.stack([self.window(i) for i in indices]))

    def micro_batch(self, samples_before_step: int, micro: int, rank: int, world: int, size: int) -> Batch:
        return self.batch(samples_before_step + (micro * world + rank) * size, size)

    def epoch_of(self, samples: int) -> float:
        return samples / self.num_windows


def chat_messages(record: dict, cfg: DataConfig) -> list[dict]:
    """A record's conversation as OpenAI-style messages (:func:`distill.chat.read_conversation`)."""
    if cfg.format == "messages":
        return read_conversation(record[cfg.turns_field], cfg.chat_schema)
    return [
        {"role": "user", "content": record[cfg.prompt_field]},
        {"role": "assistant", "content": record[cfg.response_field]},
    ]


def encode_example(
    record: dict, tokenizer, cfg: DataConfig, template_kwargs: dict | None = None
) -> list[tuple[list[int], list[int]]]:
    """The training examples of one record: token ids and a mask that is 1 on the tokens to score.

    Records of :mod:`distill.regenerate` carry the token ids the target read and wrote; those are used
    as they are (EOS only where the target ended the response; :func:`turn_examples`). Otherwise the
    conversation (a prompt and its response, or ``messages``) is rendered by the chat template with ``template_kwargs`` and every
    assistant turn is scored (``cfg.assistant_turns``), each in the context the target wrote it in: one
    example, or one per rewrite of the history (:func:`distill.chat.conversation_pieces`).
    """
    from .regenerate import turn_records

    turns = turn_records(record)
    if turns is not None:  # regenerated: the exact tokens the target read and wrote
        return turn_examples(turns, tokenizer.eos_token_id)
    messages = chat_messages(record, cfg)
    tools = record.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools  # tables often keep them as JSON text
    examples = conversation_pieces(tokenizer, messages, template_kwargs, cfg.assistant_turns, tools)
    return [tokenized(tokenizer, pieces) for pieces in examples]


def turn_examples(turns: Sequence[dict], eos: int) -> list[tuple[list[int], list[int]]]:
    """Regenerated turns (``{prompt_ids, response_ids, eos}``, :func:`distill.regenerate.converse`) as
    training examples of the exact tokens the target read and wrote, each response scored (with the
    token that ended it where the target did: ``stop_id``, else EOS). A turn whose prompt continues the
    example so far (its history as the target wrote it) extends that example; one that does not (the
    template rewrote the history, or the text of an earlier answer tokenizes differently) starts a new one."""
    examples: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    mask: list[int] = []
    for turn in turns:
        prompt = list(turn["prompt_ids"])
        stop = turn.get("stop_id")  # absent, or None where a table gave every turn the column
        response = list(turn["response_ids"]) + ([eos if stop is None else stop] if turn.get("eos", True) else [])
        if ids and prompt[: len(ids)] == ids:
            prompt = prompt[len(ids) :]
        elif ids:
            examples.append((ids, mask))
            ids, mask = [], []
        ids, mask = ids + prompt + response, mask + [0] * len(prompt) + [1] * len(response)
    return [*examples, (ids, mask)] if ids else examples


def tokenize_examples(
    records: Sequence[dict],
    tokenizer,
    cfg: DataConfig,
    name: str = "examples",
    ranks: Ranks | None = None,
    template_kwargs: dict | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Every example of the records (:func:`encode_example`: one per record, or one per rewrite of a
    conversation's history) as one window of ``seq_len + 1`` tokens (truncated or padded) and its loss
    mask, in record order; cached on disk and memory-mapped, written row by row (a
    :class:`DatasetColumn` is read in batches). With ``ranks`` every rank encodes its shards (module
    doc); every rank returns the whole arrays."""
    return _tokenized_examples(records, tokenizer, cfg, name, ranks, template_kwargs)[:2]


def _tokenized_examples(
    records: Sequence[dict], tokenizer, cfg: DataConfig, name: str, ranks: Ranks | None, template_kwargs: dict | None
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """:func:`tokenize_examples` and the number of shards each rank encoded (all 0: read from the cache)."""
    ranks = ranks or Ranks()
    width = cfg.seq_len + 1
    key = _records_key(
        records,
        tokenizer_fingerprint(tokenizer),
        f"{cfg.format}/{width}/{getattr(tokenizer, 'chat_template', None)}",
        f"{cfg.chat_schema}/{cfg.turns_field}/{cfg.assistant_turns}/{json.dumps(template_kwargs or {}, sort_keys=True)}",
    )
    folder = cache_dir() / "examples" / f"{name}-{key}"
    counts = [0] * ranks.world
    if not (folder / "mask.npy").exists():
        counts = _encode_examples(records, tokenizer, cfg, folder, ranks, template_kwargs)
    else:
        shutil.rmtree(_parts_folder(folder), ignore_errors=True)  # left by a kill between the merge and its cleanup
    return np.load(folder / "ids.npy", mmap_mode="r"), np.load(folder / "mask.npy", mmap_mode="r"), counts


def _encode_examples(
    records: Sequence[dict], tokenizer, cfg: DataConfig, folder: Path, ranks: Ranks, template_kwargs: dict | None
) -> list[int]:
    """Write ``folder/{ids,mask}.npy`` from per-rank shards (each a folder of its examples' ``ids.npy``
    and ``mask.npy``); the number of shards each rank encoded."""
    width = cfg.seq_len + 1
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bounds = shard_bounds(len(records), ranks.world, SHARD_RECORDS)
    parts = _parts_folder(folder)
    parts.mkdir(parents=True, exist_ok=True)
    shards = _shard_files(parts, bounds, "")

    def write(i: int) -> None:
        lo, hi = bounds[i]
        rows = [
            example
            for batch in _record_batches(records, lo, hi)
            for record in batch
            for example in encode_example(record, tokenizer, cfg, template_kwargs)
        ]
        write_file_atomically(shards[i], lambda tmp: _write_example_rows(rows, width, pad, tmp))

    def merge() -> None:
        sizes = [len(np.load(shard / "mask.npy", mmap_mode="r")) for shard in shards]
        with atomic_dir(folder) as tmp:
            ids, mask = _example_arrays(tmp, sum(sizes), width, pad)
            for at, size, shard in zip(itertools.accumulate([0, *sizes]), sizes, shards):
                ids[at : at + size] = np.load(shard / "ids.npy", mmap_mode="r")
                mask[at : at + size] = np.load(shard / "mask.npy", mmap_mode="r")
            ids.flush(), mask.flush()
            del ids, mask
            for f in ("ids.npy", "mask.npy"):
                fsync_path(tmp / f)
        shutil.rmtree(parts, ignore_errors=True)

    counts = run_sharded(
        ranks, len(shards), lambda i: shards[i].exists(), write, merge, f"tokenizing examples into {folder}"
    )
    return [len(c) for c in counts]


def _example_arrays(folder: Path, rows: int, width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """New memory-mapped ``folder/ids.npy`` (int64, all ``pad``) and ``folder/mask.npy`` (int8, all 0) of ``rows`` windows."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.lib.format.open_memmap(folder / "ids.npy", mode="w+", dtype=np.int64, shape=(rows, width))
    mask = np.lib.format.open_memmap(folder / "mask.npy", mode="w+", dtype=np.int8, shape=(rows, width))
    ids[:] = pad
    return ids, mask


def _write_example_rows(rows: list[tuple[list[int], list[int]]], width: int, pad: int, folder: Path) -> None:
    """Encoded examples (:func:`encode_example`), truncated or padded to ``width``, into ``folder/{ids,mask}.npy``."""
    ids, mask = _example_arrays(folder, len(rows), width, pad)
    for row, (tokens, scored) in enumerate(rows):
        ids[row, : min(width, len(tokens))] = tokens[:width]
        mask[row, : min(width, len(scored))] = scored[:width]
    ids.flush(), mask.flush()


class ExampleWindows(PackedWindows):
    """One window per prompt/response example, with a loss mask on the response tokens."""

    def __init__(
        self, ids: np.ndarray, mask: np.ndarray, seed: int = 0, shuffle: bool = True, max_windows: int | None = None
    ):
        self.ids, self.mask = ids, mask
        self.seq_len = ids.shape[1] - 1
        self.seed, self.shuffle = seed, shuffle
        self.num_windows = min(len(ids), max_windows) if max_windows else len(ids)
        if self.num_windows < 1:
            raise ValueError("no examples")
        self._perm_epoch, self._perm = -1, None

    def window(self, index: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.ids[index]))

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs among the scored (response) tokens."""
        ids, mask = np.asarray(self.ids[: self.num_windows]), np.asarray(self.mask[: self.num_windows]).astype(bool)
        return torch.bincount(torch.from_numpy(ids[mask].astype(np.int64)), minlength=vocab_size)

    def collate(self, indices: list[int]) -> Batch:
        return Batch(
            torch.stack([self.window(i) for i in indices]),
            torch.from_numpy(np.stack([self.mask[i] for i in indices]).astype(np.int64)),
        )


def make_windows(
    records: list,
    tokenizer,
    cfg: DataConfig,
    split: str,
    seed: int = 0,
    max_windows: int | None = None,
    ranks: Ranks | None = None,
    template_kwargs: dict | None = None,
) -> PackedWindows:
    """Training windows (shuffled per epoch) or held-out windows (in order) for one split, tokenized by
    every rank of ``ranks`` (module doc); chat data rendered with ``template_kwargs``
    (``target.chat_template_kwargs``). ``prepared_by_rank`` on the result: the shards each rank
    tokenized (all 0 when the split came from the cache)."""
    shuffle = split == "train"
    if cfg.format == "text":
        tokens, counts = _tokenized_stream(records, tokenizer, split, ranks)
        windows = PackedWindows(tokens, cfg.seq_len, seed, shuffle, max_windows)
    else:
        ids, mask, counts = _tokenized_examples(records, tokenizer, cfg, split, ranks, template_kwargs)
        windows = ExampleWindows(ids, mask, seed, shuffle, max_windows)
    windows.prepared_by_rank = counts
    return windows
