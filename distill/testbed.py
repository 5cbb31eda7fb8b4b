"""The testbed: real text and a real tokenizer that every machine has, with no download.

Corpus
    Every ``.py`` file of the running interpreter's standard library (found with ``sysconfig``),
    minus test folders (``test/``, ``tests/``, ``idle_test/``) and installed packages. Files are
    read in sorted order, so the corpus is a deterministic function of the Python build. A file goes
    to the held-out split when a hash of its relative path falls in the held-out share, so the split
    is stable when files are added or removed, and no file is split across train and validation.

Tokenizer
    A byte-level BPE (``tokenizers``) trained on the training split only, saved as a
    ``PreTrainedTokenizerFast`` with the special tokens later stages need: ``<|endoftext|>``
    (document separator / EOS), ``<|pad|>``, ``<|mask|>`` (block drafters) and chat markers.

Everything is cached under ``$DRAFTSMITH_CACHE`` (default ``~/.cache/draftsmith``), keyed by a
fingerprint of what produced it, and written atomically (temporary name, then rename).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from drafters import DRAFTERS

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|mask|>", "<|im_start|>", "<|im_end|>"]
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
ASSETS = Path(__file__).resolve().parent / "assets"
SHIPPED_TARGET = ASSETS / "testbed_target"
#: drafters trained once for the shipped target by their recipes, shipped without the target's
#: embeddings and LM head (they load from the target): ``shipped_drafter("dflash")``
SHIPPED_DRAFTERS = {kind: ASSETS / f"testbed_{kind}" for kind in DRAFTERS}


def cache_dir() -> Path:
    root = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@dataclass(frozen=True)
class Document:
    path: str  # relative to the stdlib root
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(max_documents: int | None = None) -> list[Document]:
    """The standard library's own source files, test folders excluded, in sorted order."""
    root = stdlib_root()
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document(rel.as_posix(), text))
        if max_documents and len(docs) >= max_documents:
            break
    if not docs:
        raise RuntimeError(f"no Python source found under the standard library at {root}")
    return docs


def is_held_out(key: str, val_fraction: float) -> bool:
    """Stable assignment of a document to the held-out split by a hash of its key."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return (h % 1_000_000) < val_fraction * 1_000_000


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    train = [d for d in docs if not is_held_out(d.path, val_fraction)]
    val = [d for d in docs if is_held_out(d.path, val_fraction)]
    if not val or not train:  # tiny corpora (tests): keep at least one document on each side
        train, val = docs[:-1] or docs, docs[-1:]
    return train, val


def fingerprint_texts(texts, *extra: str) -> str:
    h = hashlib.sha256()
    for part in extra:
        h.update(part.encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()[:16]


def atomic_dir(final: Path):
    """Context manager yielding a temporary sibling folder that is renamed to ``final`` on success."""
    return _AtomicDir(final)


class _AtomicDir:
    def __init__(self, final: Path):
        self.final = Path(final)

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.tmp-", dir=self.final.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        if self.final.exists():  # another process finished first: keep its copy
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            os.replace(self.tmp, self.final)
        return False


def train_bpe_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE on ``texts`` and save it as a ``PreTrainedTokenizerFast`` folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.model_max_length = 1 << 20
    fast.save_pretrained(out_dir)
    return fast
