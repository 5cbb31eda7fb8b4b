"""The target answers prompts itself: drafter training data in the target's own distribution.

A drafter is judged by how often the *target* agrees with it, so it should learn what the target
writes, not what the corpus says: the reference trainers regenerate responses with the target before
training (DeepSpec, speculators). Prompts are read from a JSONL file or cut from a corpus split
(:func:`corpus_prompts`); :func:`answer_prompts` lets the target continue them in batches.

Records (one JSON object per line)::

    {"id", "prompt" | "messages", "response", "prompt_ids", "response_ids", "eos", "temperature"}

``prompt_ids`` / ``response_ids`` are the exact tokens the target read and wrote (re-tokenizing the
decoded text need not give them back); ``eos`` says whether the target ended the response itself, so
a response cut at ``max_new_tokens`` is not taught to end there.

Resumable and divided among ranks: prompts are cut into fixed batches, and each finished batch is
written to its own file under ``<file>.parts/`` (temporary name, fsync, rename). With ``ranks`` (a
launch of several processes, :class:`~distill.checkpoint.Ranks`) the batches still to answer are dealt
round-robin and every rank answers its own with its copy of the target; the main rank then joins the
batch files, in prompt order, into ``<file>`` (written and renamed into place). A re-run keeps the
finished batches and answers the rest; complete batches of records found in ``<file>.partial`` (one
record a line, as an append log holds them; a torn line ends it) count as finished too. Each batch
samples with its own seed, so a resumed run, or one with any number of ranks, writes exactly what an
uninterrupted single process would.

:func:`regenerated_splits` is the in-process stage of drafter recipes (``regenerate:``): train-split
prompts answered at each of several temperatures, held-out prompts answered greedily (what serving
at T=0 sees, so the simulated tau measures it), cached under ``$DRAFTSMITH_CACHE/regenerated/<key>``
where the key covers the target's weights, the tokenizer, the corpus and every setting: a later run
with the same settings reuses the answers, any change makes new ones.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from . import chat
from .checkpoint import Ranks, run_sharded, write_file_atomically
from .testbed import cache_dir, fingerprint_texts

REGENERATION_VERSION = 1


def corpus_prompts(docs: list[str], count: int, prompt_tokens: int, tokenizer, seed: int) -> list[dict]:
    """``count`` snippets of ``prompt_tokens`` tokens at seeded offsets in ``docs`` (token ids kept)."""
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(docs), size=count, replace=count > len(docs))
    unique = sorted(set(chosen.tolist()))  # each document tokenized once, in one batched call
    tokens = dict(zip(unique, tokenizer([docs[i] for i in unique], add_special_tokens=False)["input_ids"]))
    prompts = []
    for i in chosen:
        ids = tokens[int(i)]
        start = int(rng.integers(0, max(1, len(ids) - prompt_tokens)))
        snippet = ids[start : start + prompt_tokens]
        prompts.append({"prompt": tokenizer.decode(snippet), "prompt_ids": snippet})
    return prompts


def file_prompts(path: str, field: str) -> list[dict]:
    from .checks import read_prompts

    return [{"messages": r["messages"]} if "messages" in r else {"prompt": r[field]} for r in read_prompts(path, field)]


def load_prompts(section, data_cfg, seed: int, tokenizer) -> list[dict]:
    """The prompts a ``PromptsSection`` names: its file, or ``from_corpus`` snippets of ``data_cfg``'s
    ``section.split`` (the same for every recipe that names the same section, data and seed)."""
    from .data import load_text_splits

    if section.file:
        return file_prompts(section.file, section.field)
    splits = load_text_splits(data_cfg, seed)
    docs = splits.train if section.split == "train" else splits.val
    return corpus_prompts(docs, section.from_corpus, section.prompt_tokens, tokenizer, seed)


def encoded_prompts(
    section, data_cfg, seed: int, tokenizer, device="cpu", template_kwargs: dict | None = None
) -> list[torch.Tensor]:
    """:func:`load_prompts` as the token ids the target reads, one 1-D tensor each."""
    return [
        torch.tensor(prompt_token_ids(p, tokenizer, template_kwargs), device=device)
        for p in load_prompts(section, data_cfg, seed, tokenizer)
    ]


def render(prompt: dict, tokenizer, template_kwargs: dict | None = None) -> str:
    """The text the target continues: the conversation by its chat template (with ``template_kwargs``,
    ``target.chat_template_kwargs``) and the generation prompt, else the raw prompt."""
    messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
    return chat.render(tokenizer, messages, template_kwargs, generation_prompt=True)


def prompt_token_ids(prompt: dict, tokenizer, template_kwargs: dict | None = None) -> list[int]:
    """The tokens the target reads for ``prompt``: the cut corpus tokens themselves when there is no
    chat template, else the rendered conversation's."""
    if "prompt_ids" in prompt and not chat.has_template(tokenizer):
        return list(prompt["prompt_ids"])
    return tokenizer(render(prompt, tokenizer, template_kwargs), add_special_tokens=False)["input_ids"]


@dataclass
class AnswerJob:
    """One file of answers: ``prompts`` answered at ``temperature``; the batch starting at prompt ``i``
    samples with seed ``seed * 1_000_003 + i``."""

    out_file: Path
    prompts: list[dict]
    temperature: float
    seed: int
    desc: str = "regenerating"

    def batches(self, size: int) -> list[range]:
        """The fixed batches over all prompts (a resumed run pads and seeds each as the first run did)."""
        return [range(b, min(b + size, len(self.prompts))) for b in range(0, len(self.prompts), size)]

    @property
    def parts(self) -> Path:
        return self.out_file.with_name(self.out_file.name + ".parts")

    @property
    def log(self) -> Path:
        return self.out_file.with_name(self.out_file.name + ".partial")

    def batch_file(self, batch: range) -> Path:
        return self.parts / f"{batch.start:08d}-{batch.stop:08d}.jsonl"

    def adopt_log(self, size: int) -> None:
        """Complete batches of the records in :attr:`log` (by prompt id; a torn line ends it) written as
        batch files, unless there already."""
        if not self.log.exists():
            return
        records = {}
        with open(self.log) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                records[record["id"]] = record
        for batch in self.batches(size):
            if all(i in records for i in batch) and not self.batch_file(batch).exists():
                lines = "".join(json.dumps(records[i]) + "\n" for i in batch)
                write_file_atomically(self.batch_file(batch), lambda tmp, text=lines: tmp.write_text(text))

    def merge(self, size: int) -> None:
        """The batch files end to end, in prompt order, as :attr:`out_file`; the pieces go."""

        def join(tmp: Path) -> None:
            with open(tmp, "wb") as out:
                for batch in self.batches(size):
                    with open(self.batch_file(batch), "rb") as part:
                        shutil.copyfileobj(part, out)

        write_file_atomically(self.out_file, join)
        shutil.rmtree(self.parts, ignore_errors=True)
        self.log.unlink(missing_ok=True)

    def stats(self) -> dict:
        """Of the finished file: records, response tokens (EOS counted where the target wrote it), turns
        answered, answers cut at ``max_new_tokens`` (truncated), turns a server failed to answer, and
        turns skipped after a failed one."""
        counts = dict.fromkeys(("records", "response_tokens", "turns", "truncated", "failed", "skipped"), 0)
        with open(self.out_file) as f:
            for line in f:
                record = json.loads(line)
                turns = turn_records(record) or []
                counts["records"] += 1
                counts["response_tokens"] += response_tokens(record)
                counts["turns"] += len(turns)
                counts["truncated"] += sum(not t["eos"] for t in turns)
                counts["failed"] += record.get("failed_turns", 0)
                counts["skipped"] += record.get("skipped_turns", 0)
        return counts


def answer_prompts(
    target,
    tokenizer,
    prompts: list[dict],
    out_file: Path,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 8,
    seed: int = 0,
    desc: str = "regenerating",
    server=None,
    ranks: Ranks | None = None,
    template_kwargs: dict | None = None,
    reasoning: str = "keep",
) -> dict:
    """The target's answers to ``prompts`` in ``out_file`` (resumable, see the module doc), in-process
    or through ``server`` (a :class:`~distill.config.ServerSection`; ``target`` may then be None), the
    prompts rendered with ``template_kwargs``. Returns :func:`answer_jobs`' record of the file."""
    job = AnswerJob(Path(out_file), prompts, temperature, seed, desc)
    return answer_jobs(
        target,
        tokenizer,
        [job],
        max_new_tokens=max_new_tokens,
        top_p=top_p,
        top_k=top_k,
        batch_size=batch_size,
        server=server,
        ranks=ranks,
        template_kwargs=template_kwargs,
        reasoning=reasoning,
    )[0]


@torch.no_grad()
def answer_jobs(
    target,
    tokenizer,
    jobs: list[AnswerJob],
    *,
    max_new_tokens: int,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 8,
    server=None,
    ranks: Ranks | None = None,
    template_kwargs: dict | None = None,
    reasoning: str = "keep",
) -> list[dict]:
    """Every job's file of answers, the batches of all unfinished files divided among ``ranks`` (module
    doc); every rank must call this with the same jobs. Returns per job ``{"records", "response_tokens",
    "tokens_per_s", "batches_by_rank"}``: tokens/s of this call's generation only (the ranks' tokens over
    the longest a rank spent on the file; None when nothing was generated) and the batches each rank
    answered in this call."""
    ranks = ranks or Ranks()
    pending = [job for job in jobs if not job.out_file.exists()]
    for job in jobs:
        if ranks.is_main and job.out_file.exists():  # pieces left by a kill between a merge and its cleanup
            shutil.rmtree(job.parts, ignore_errors=True)
    units = [(j, batch) for j, job in enumerate(pending) for batch in job.batches(batch_size)]
    for job in pending:
        job.parts.mkdir(parents=True, exist_ok=True)
        if ranks.is_main:
            job.adopt_log(batch_size)
    answer, progress = None, tqdm(desc=", ".join(job.desc for job in pending), unit="batch", disable=not pending)

    def write(i: int) -> tuple[int, int, float]:
        nonlocal answer
        j, batch = units[i]
        job = pending[j]
        if answer is None:
            answer = (
                ServerAnswers(server, tokenizer, template_kwargs)
                if server is not None
                else InProcessAnswers(target, tokenizer, template_kwargs)
            )
        t0 = time.perf_counter()
        records = converse(
            answer,
            tokenizer,
            [job.prompts[k] for k in batch],
            max_new_tokens,
            job.temperature,
            top_p,
            top_k,
            job.seed * 1_000_003 + batch.start,  # per-batch seed: resumes and any number of ranks reproduce
            reasoning,
        )
        seconds = time.perf_counter() - t0
        new_tokens = sum(response_tokens(r) for r in records)
        lines = [json.dumps({"id": k, **r, "temperature": job.temperature}) + "\n" for k, r in zip(batch, records)]
        write_file_atomically(job.batch_file(batch), lambda tmp: tmp.write_text("".join(lines)))
        progress.update(1)
        return j, new_tokens, seconds

    def merge() -> None:
        for job in pending:
            job.merge(batch_size)

    device = next(target.parameters()).device if server is None and target is not None else torch.device("cpu")
    # the per-batch seeds must not leak into the caller's RNG: a training run that regenerates and one
    # that reuses cached answers then draw the same anchors and data order
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        done = run_sharded(
            ranks,
            len(units),
            lambda i: pending[units[i][0]].batch_file(units[i][1]).exists(),
            write,
            merge,
            "regenerating " + ", ".join(str(job.out_file) for job in pending),
        )
    progress.close()
    return [_job_record(job, pending, done) for job in jobs]


def _job_record(job: AnswerJob, pending: list[AnswerJob], done: list[list[tuple[int, int, float]]]) -> dict:
    """:func:`answer_jobs`' record of one job from its file and what each rank did for it."""
    j = next((j for j, p in enumerate(pending) if p is job), None)
    mine = [[(tokens, seconds) for jj, tokens, seconds in rank if jj == j] for rank in done]
    tokens = sum(t for rank in mine for t, _ in rank)
    seconds = max((sum(s for _, s in rank) for rank in mine), default=0.0)
    return {
        **job.stats(),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "batches_by_rank": [len(rank) for rank in mine],
    }


#: the seed of a batch's turn t is its first turn's plus t strides: no other batch's first turns reach it
TURN_SEED_STRIDE = 100_003


def turn_records(record: dict) -> list[dict] | None:
    """A regenerated record's answered turns, each ``{prompt_ids, response_ids, eos}``: its ``turns`` (a
    conversation answered turn by turn), or the record itself (one prompt); None for a record the target
    did not write (a table gives every record every column: None where a record has none)."""
    if record.get("turns") is not None:
        return record["turns"]
    return [record] if record.get("response_ids") is not None else None


def response_tokens(record: dict) -> int:
    return sum(len(t["response_ids"]) + bool(t["eos"]) for t in turn_records(record) or [])


def _turn_ends(messages: list[dict]) -> list[int]:
    """Where each answer goes: the index of every assistant turn, and the end when the last turn is the user's."""
    ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return ends + [len(messages)] if messages[-1]["role"] != "assistant" else ends


def _answer_message(text: str, reasoning: str) -> dict:
    """An answer's text as an assistant message: a leading ``<think>`` block as ``reasoning_content``
    (``reasoning="keep"``) or gone (``"drop"``)."""
    if "</think>" not in text:
        return {"role": "assistant", "content": text}
    thought, content = text.split("</think>", 1)
    message = {"role": "assistant", "content": content.lstrip("\n")}
    if reasoning == "keep":
        message["reasoning_content"] = thought.split("<think>", 1)[-1].strip("\n")
    return message


def converse(
    answer, tokenizer, prompts, max_new_tokens, temperature, top_p, top_k, seed, reasoning: str = "keep"
) -> list[dict]:
    """Each prompt answered by ``answer`` (:class:`InProcessAnswers`, :class:`ServerAnswers`). A prompt
    (``prompt``, or ``messages`` ending with the user's turn) gets one answer: its record adds
    ``prompt_ids``, ``response``, ``response_ids`` and ``eos``. A conversation with assistant turns gets
    every one of them answered again, in order, each given the conversation so far with the target's
    own earlier answers (system, user and tool turns kept): its record holds the new ``messages`` and
    per answered turn ``{prompt_ids, response_ids, eos}`` in ``turns``; a turn the server failed to
    answer ends the conversation there (``failed_turns``, ``skipped_turns``). Turn ``t`` of the batch
    samples with seed ``seed + TURN_SEED_STRIDE * t``; the first turn of every prompt is answered in one call."""
    originals = [list(p.get("messages") or [{"role": "user", "content": p["prompt"]}]) for p in prompts]
    ends = [_turn_ends(m) for m in originals]
    histories: list[list[dict]] = [[] for _ in prompts]
    turns: list[list[dict]] = [[] for _ in prompts]
    failed = [False] * len(prompts)
    for t in range(max(map(len, ends))):
        active = [i for i in range(len(prompts)) if t < len(ends[i]) and not failed[i]]
        if not active:
            break
        for i in active:
            start = ends[i][t - 1] + 1 if t else 0
            histories[i] += originals[i][start : ends[i][t]]
        # a first turn asked as given (corpus prompts carry the exact tokens they were cut from)
        asked = [prompts[i] if t == 0 and "messages" not in prompts[i] else {"messages": histories[i]} for i in active]
        rows = answer(asked, max_new_tokens, temperature, top_p, top_k, seed + TURN_SEED_STRIDE * t)
        for i, row in zip(active, rows):
            if row is None:
                failed[i] = True
                continue
            prompt_ids, new, ended, extra = row
            text = tokenizer.decode(new, skip_special_tokens=True)
            histories[i].append(_answer_message(text, reasoning))
            turns[i].append({"prompt_ids": prompt_ids, "response": text, "response_ids": new, "eos": ended, **extra})
    records = []
    for i, prompt in enumerate(prompts):
        if len(ends[i]) == 1 and turns[i]:  # one prompt, one answer: the record as it always was
            records.append({**prompt, **turns[i][0]})
            continue
        answered = len(turns[i])
        records.append(
            {
                **{k: v for k, v in prompt.items() if k not in ("messages", "prompt")},
                "messages": histories[i] + (originals[i][ends[i][-1] + 1 :] if not failed[i] else []),
                "turns": turns[i],
                **({"failed_turns": 1, "skipped_turns": len(ends[i]) - answered - 1} if failed[i] else {}),
            }
        )
    return records


class InProcessAnswers:
    """A batch of answers by ``target.generate`` (left-padded), seeded per batch."""

    def __init__(self, target, tokenizer, template_kwargs: dict | None = None):
        self.target, self.tokenizer, self.template_kwargs = target, tokenizer, template_kwargs
        self.device = next(target.parameters()).device

    def __call__(self, prompts, max_new_tokens, temperature, top_p, top_k, seed):
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        torch.manual_seed(seed)
        ids = [prompt_token_ids(p, tok, self.template_kwargs) for p in prompts]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=self.device)  # left padding
        attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)
        sampled = temperature > 0
        outputs = self.target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=sampled,
            pad_token_id=pad,
            **({"temperature": temperature, "top_p": top_p, "top_k": top_k} if sampled else {}),
        )
        # generate stops at the generation config's end tokens (a chat target's end of turn), the
        # tokenizer's EOS among them or not; a stop other than the tokenizer's EOS is kept as stop_id
        stops = self.target.generation_config.eos_token_id
        stops = {tok.eos_token_id, *(stops if isinstance(stops, list) else [stops] if stops is not None else [])}
        rows = []
        for row, prompt_ids in enumerate(ids):
            new = outputs[row, width:].tolist()
            end = next((k for k, t in enumerate(new) if t in stops), None)
            if end is None:
                rows.append((prompt_ids, new, False, {}))
            else:
                rows.append(
                    (prompt_ids, new[:end], True, {} if new[end] == tok.eos_token_id else {"stop_id": new[end]})
                )
        return rows


class ServerAnswers:
    """A batch of answers from an OpenAI-compatible endpoint, ``concurrency`` requests in flight:
    ``/v1/completions`` with the text the target would read (:func:`render`; ``prompt_ids`` are that
    text tokenized) or, with ``server.api: chat``, ``/v1/chat/completions`` with the messages. The
    response's token ids are the server's when it returns them (vLLM's ``return_token_ids``), else its
    text re-tokenized (``retokenized: true`` in the record); ``eos`` is a ``stop`` finish. A request that
    still fails after the client's retries answers None (a failed turn). The endpoint is asked for its
    models first: an unreachable server or an unknown model is an error before any prompt is sent."""

    def __init__(self, server, tokenizer, template_kwargs: dict | None = None):
        from openai import OpenAI

        from .config import RecipeError

        self.server, self.tokenizer, self.device = server, tokenizer, torch.device("cpu")
        self.template_kwargs = template_kwargs
        key = os.environ.get(server.api_key_env or "", "") or "EMPTY"
        self.client = OpenAI(base_url=server.base_url, api_key=key, timeout=server.timeout_s, max_retries=3)
        try:
            served = [m.id for m in self.client.models.list()]
        except Exception as e:  # connection refused, DNS, TLS, auth: all mean the same to the user
            raise RecipeError(
                f"server.base_url: no OpenAI-compatible server answered at {server.base_url} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); start it, or fix the URL"
            ) from None
        if server.model not in served:
            raise RecipeError(f"server.model: '{server.model}' is not served at {server.base_url} (it serves {served})")

    def __call__(self, prompts, max_new_tokens, temperature, top_p, top_k, seed):
        from concurrent.futures import ThreadPoolExecutor

        import openai

        server = self.server
        extra = {**server.extra_body, **({"top_k": top_k} if top_k and temperature > 0 else {})}

        def one(j: int):
            sampling = (
                {"temperature": temperature, "top_p": top_p, "seed": seed + j}
                if temperature > 0
                else {"temperature": 0.0}
            )
            try:
                if server.api == "chat":
                    return self._chat(prompts[j], max_new_tokens, extra, sampling)
                return self._completion(prompts[j], max_new_tokens, extra, sampling)
            except openai.APIError:  # after the client's retries: this turn is failed, the run goes on
                return None

        with ThreadPoolExecutor(max_workers=min(server.concurrency, len(prompts))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def _ids(self, choice, text: str) -> tuple[list[int], dict]:
        """The response's token ids (the server's, else its text re-tokenized) without EOS."""
        tok = self.tokenizer
        ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
        retokenized = ids is None
        if retokenized:
            ids = tok(text, add_special_tokens=False)["input_ids"]
        return [int(t) for t in ids if int(t) != tok.eos_token_id], {"retokenized": True} if retokenized else {}

    def _completion(self, prompt: dict, max_new_tokens: int, extra: dict, sampling: dict):
        """``/v1/completions``: the prompt rendered here with the target's template."""
        text = render(prompt, self.tokenizer, self.template_kwargs)
        response = self.client.completions.create(
            model=self.server.model, prompt=text, max_tokens=max_new_tokens, extra_body=extra or None, **sampling
        )
        choice = response.choices[0]
        ids, flags = self._ids(choice, choice.text)
        prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return prompt_ids, ids, choice.finish_reason == "stop", flags

    def _chat(self, prompt: dict, max_new_tokens: int, extra: dict, sampling: dict):
        """``/v1/chat/completions``: the server applies the template (``chat_template_kwargs`` sent along,
        as vLLM and SGLang read them); reasoning the server returns apart is put back in front of the
        answer as a ``<think>`` block. ``prompt_ids`` are the server's when it returns them, else the
        conversation rendered here."""
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        body = {**extra, **({"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else {})}
        response = self.client.chat.completions.create(
            model=self.server.model,
            messages=messages,
            max_tokens=max_new_tokens,
            extra_body=body or None,
            **sampling,
        )
        choice = response.choices[0]
        message = choice.message
        thought = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning")
        text = (f"<think>\n{thought}\n</think>\n\n" if thought else "") + (message.content or "")
        ids, flags = self._ids(choice, text)
        served = getattr(response, "prompt_token_ids", None) or (response.model_extra or {}).get("prompt_token_ids")
        prompt_ids = list(served) if served else prompt_token_ids(prompt, self.tokenizer, self.template_kwargs)
        return prompt_ids, ids, choice.finish_reason == "stop", flags


def regeneration_key(
    stage, target_fp: str, tokenizer_fp: str, data_fp: str, seed: int, template_kwargs: dict | None = None
) -> str:
    # where the answers come from counts, not how the server is reached
    settings = stage.model_dump(mode="json", exclude={"server"})
    if template_kwargs:
        settings["chat_template_kwargs"] = template_kwargs
    if getattr(stage, "server", None) is not None:
        settings["server_model"] = stage.server.model
    settings = json.dumps(settings, sort_keys=True)
    return fingerprint_texts([settings], f"v{REGENERATION_VERSION}", target_fp, tokenizer_fp, data_fp, f"seed={seed}")


def regenerated_splits(
    stage,
    target,
    tokenizer,
    splits,
    seed: int,
    target_fp: str,
    tokenizer_fp: str,
    ranks: Ranks | None = None,
    template_kwargs: dict | None = None,
) -> dict:
    """Answer ``stage``'s train prompts (split over ``stage.temperatures``) and held-out prompts (greedy),
    or reuse the cached answers; with ``ranks`` every rank answers its share of all the files' batches
    (module doc) and returns the record. Returns the record: files, key, counts, response tokens,
    tokens/s and the batches each rank answered."""
    key = regeneration_key(stage, target_fp, tokenizer_fp, splits.fingerprint, seed, template_kwargs)
    folder = cache_dir() / "regenerated" / key
    manifest = folder / "manifest.json"
    if manifest.exists():
        return {**json.loads(manifest.read_text()), "reused": True}
    jobs = []
    per_temp = -(-stage.train_prompts // len(stage.temperatures))
    train_prompts = corpus_prompts(
        splits.train, per_temp * len(stage.temperatures), stage.prompt_tokens, tokenizer, seed
    )
    for j, temperature in enumerate(stage.temperatures):
        jobs.append(
            AnswerJob(
                folder / f"train_t{temperature:g}.jsonl",
                train_prompts[j * per_temp : (j + 1) * per_temp],
                temperature,
                seed + j,
                f"regenerating train_t{temperature:g}",
            )
        )
    val_prompts = corpus_prompts(splits.val, stage.val_prompts, stage.prompt_tokens, tokenizer, seed + 1)
    jobs.append(AnswerJob(folder / "val_t0.jsonl", val_prompts, 0.0, seed, "regenerating val_t0"))
    done = answer_jobs(
        target,
        tokenizer,
        jobs,
        max_new_tokens=stage.max_new_tokens,
        top_p=stage.top_p,
        top_k=stage.top_k,
        batch_size=stage.batch_size,
        server=stage.server,
        ranks=ranks,
        template_kwargs=template_kwargs,
    )
    stats = {job.out_file.name: record for job, record in zip(jobs, done)}
    record = {
        "key": key,
        "folder": str(folder),
        "train_files": [str(j.out_file) for j in jobs[:-1]],
        "val_files": [str(jobs[-1].out_file)],
        "files": stats,
        "train_response_tokens": sum(s["response_tokens"] for n, s in stats.items() if n.startswith("train")),
        "batches_by_rank": [sum(col) for col in zip(*(s["batches_by_rank"] for s in stats.values()))],
        "settings": stage.model_dump(mode="json"),
    }
    if ranks is None or ranks.is_main:
        write_file_atomically(manifest, lambda tmp: tmp.write_text(json.dumps(record, indent=2)))
    return {**record, "reused": False}


def training_splits(
    data, stage, target, tokenizer, seed: int, ranks: Ranks | None = None, template_kwargs: dict | None = None
):
    """What a training recipe trains on: ``data``'s corpus, or with a ``regenerate:`` ``stage`` the
    target's own answers to prompts cut from it (regenerated now by every rank of ``ranks``, or read
    back from their cache: recipes with the same stage, corpus, target and seed share one). Returns the
    text splits, the data config to cut them into windows with, and the run's data record."""
    from .data import load_text_splits, regenerated_text_splits, tokenizer_fingerprint
    from .feature_cache import target_fingerprint

    splits, regenerated = load_text_splits(data, seed), None
    if stage is not None:
        regenerated = regenerated_splits(
            stage,
            target,
            tokenizer,
            splits,
            seed,
            target_fingerprint(target),
            tokenizer_fingerprint(tokenizer),
            ranks,
            template_kwargs,
        )
        splits = regenerated_text_splits(regenerated)
        data = data.model_copy(update={"format": "prompt_response"})
    record = {
        "description": splits.description,
        "data_fingerprint": splits.fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
    }
    if regenerated is not None:
        record["regenerated"] = {
            k: regenerated.get(k)
            for k in ("key", "folder", "files", "train_response_tokens", "batches_by_rank", "reused")
        }
    return splits, data, record
