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

Resumable: prompts are cut into fixed batches; each finished batch is appended (and flushed) to
``<file>.partial``; a re-run keeps the complete batches, drops a torn or half-written one, and
continues; the file is renamed into place when every prompt is answered. Each batch samples with its
own seed, so a resumed run writes exactly what an uninterrupted one would.

:func:`regenerated_splits` is the in-process stage of drafter recipes (``regenerate:``): train-split
prompts answered at each of several temperatures, held-out prompts answered greedily (what serving
at T=0 sees, so the simulated tau measures it), cached under ``$DRAFTSMITH_CACHE/regenerated/<key>``
where the key covers the target's weights, the tokenizer, the corpus and every setting: a later run
with the same settings reuses the answers, any change makes new ones.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

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
        snippet = ids[start:start + prompt_tokens]
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


def encoded_prompts(section, data_cfg, seed: int, tokenizer, device="cpu") -> list[torch.Tensor]:
    """:func:`load_prompts` as the token ids the target reads, one 1-D tensor each."""
    return [torch.tensor(prompt_token_ids(p, tokenizer), device=device) for p in load_prompts(section, data_cfg, seed, tokenizer)]


def render(prompt: dict, tokenizer) -> str:
    """The text the target continues: its chat template when it has one, else the raw prompt."""
    messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(m["content"] for m in messages)


def prompt_token_ids(prompt: dict, tokenizer) -> list[int]:
    """The tokens the target reads for ``prompt``: the cut corpus tokens themselves when there is no
    chat template, else the rendered conversation's."""
    if "prompt_ids" in prompt and not getattr(tokenizer, "chat_template", None):
        return list(prompt["prompt_ids"])
    return tokenizer(render(prompt, tokenizer), add_special_tokens=False)["input_ids"]


def read_done(partial: Path, batches: list[list[int]]) -> dict[int, dict]:
    """Records of the batches that were completely written. A torn last line or a half-written batch
    (a kill mid-write) is dropped, and the file rewritten to hold exactly the complete batches."""
    done = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            done[record["id"]] = record
        done = {i: done[i] for batch in batches if all(j in done for j in batch) for i in batch}
        tmp = partial.with_name(partial.name + ".tmp")
        tmp.write_text("".join(json.dumps(done[i]) + "\n" for i in sorted(done)))
        os.replace(tmp, partial)
    return done


@torch.no_grad()
def answer_prompts(target, tokenizer, prompts: list[dict], out_file: Path, *, max_new_tokens: int,
                   temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, batch_size: int = 8,
                   seed: int = 0, desc: str = "regenerating", server=None) -> dict:
    """The target's answers to ``prompts`` in ``out_file`` (resumable, see the module doc), in-process
    or through ``server`` (a :class:`~distill.config.ServerSection`; ``target`` may then be None).
    Returns ``{"records", "response_tokens", "tokens_per_s"}`` (tokens/s of this call's generation only)."""
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    partial = out_file.with_name(out_file.name + ".partial")
    # fixed batches over all prompts, so a resumed run pads and seeds every batch as the first run did
    batches = [list(range(b, min(b + batch_size, len(prompts)))) for b in range(0, len(prompts), batch_size)]
    done = {} if out_file.exists() else read_done(partial, batches)
    todo = [] if out_file.exists() else [batch for batch in batches if batch[0] not in done]
    answer = (ServerAnswers(server, tokenizer) if server is not None else InProcessAnswers(target, tokenizer)) if todo else None
    new_tokens, seconds = 0, 0.0
    devices = [answer.device] if answer is not None and answer.device.type == "cuda" else []
    # the per-batch seeds below must not leak into the caller's RNG: a training run that regenerates
    # and one that reuses cached answers then draw the same anchors and data order
    with open(partial, "a") as sink, torch.random.fork_rng(devices=devices):
        for batch in tqdm(todo, desc=desc, unit="batch"):
            batch_seed = seed * 1_000_003 + batch[0]  # per-batch seed: resumes reproduce
            t0 = time.perf_counter()
            rows = answer([prompts[i] for i in batch], max_new_tokens, temperature, top_p, top_k, batch_seed)
            seconds += time.perf_counter() - t0
            for i, (prompt_ids, new, ended, extra) in zip(batch, rows):
                new_tokens += len(new) + ended
                record = {"id": i, **prompts[i], "prompt_ids": prompt_ids, "response": tokenizer.decode(new, skip_special_tokens=True),
                          "response_ids": new, "eos": ended, "temperature": temperature, **extra}
                sink.write(json.dumps(record) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
    if not out_file.exists():
        os.replace(partial, out_file)
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    return {"records": len(records), "response_tokens": sum(len(r["response_ids"]) + r["eos"] for r in records),
            "tokens_per_s": round(new_tokens / seconds, 1) if seconds else None}


class InProcessAnswers:
    """A batch of answers by ``target.generate`` (left-padded), seeded per batch."""

    def __init__(self, target, tokenizer):
        self.target, self.tokenizer = target, tokenizer
        self.device = next(target.parameters()).device

    def __call__(self, prompts, max_new_tokens, temperature, top_p, top_k, seed):
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        torch.manual_seed(seed)
        ids = [prompt_token_ids(p, tok) for p in prompts]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=self.device)  # left padding
        attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)
        sampled = temperature > 0
        outputs = self.target.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=sampled,
            pad_token_id=pad, **({"temperature": temperature, "top_p": top_p, "top_k": top_k} if sampled else {}))
        rows = []
        for row, prompt_ids in enumerate(ids):
            new = outputs[row, width:].tolist()
            ended = tok.eos_token_id in new
            rows.append((prompt_ids, new[:new.index(tok.eos_token_id)] if ended else new, ended, {}))
        return rows


class ServerAnswers:
    """A batch of answers from an OpenAI-compatible completions endpoint, ``concurrency`` requests in
    flight. Each prompt goes as the text the target would read (:func:`render`); its ``prompt_ids``
    are that text tokenized. The response's token ids are the server's when it returns them (vLLM's
    ``return_token_ids``), else its text re-tokenized (``retokenized: true`` in the record); ``eos``
    is a ``stop`` finish. The endpoint is asked for its models first: an unreachable server or an
    unknown model is an error before any prompt is sent."""

    def __init__(self, server, tokenizer):
        from openai import OpenAI

        from .config import RecipeError

        self.server, self.tokenizer, self.device = server, tokenizer, torch.device("cpu")
        key = os.environ.get(server.api_key_env or "", "") or "EMPTY"
        self.client = OpenAI(base_url=server.base_url, api_key=key, timeout=server.timeout_s, max_retries=3)
        try:
            served = [m.id for m in self.client.models.list()]
        except Exception as e:  # connection refused, DNS, TLS, auth: all mean the same to the user
            raise RecipeError(f"server.base_url: no OpenAI-compatible server answered at {server.base_url} "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); start it, or fix the URL") from None
        if server.model not in served:
            raise RecipeError(f"server.model: '{server.model}' is not served at {server.base_url} (it serves {served})")

    def __call__(self, prompts, max_new_tokens, temperature, top_p, top_k, seed):
        from concurrent.futures import ThreadPoolExecutor

        tok, server = self.tokenizer, self.server
        extra = {**server.extra_body, **({"top_k": top_k} if top_k and temperature > 0 else {})}

        def one(j: int):
            text = render(prompts[j], tok)
            sampling = {"temperature": temperature, "top_p": top_p, "seed": seed + j} if temperature > 0 else {"temperature": 0.0}
            response = self.client.completions.create(model=server.model, prompt=text, max_tokens=max_new_tokens,
                                                      extra_body=extra or None, **sampling)
            choice = response.choices[0]
            ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
            retokenized = ids is None
            if retokenized:
                ids = tok(choice.text, add_special_tokens=False)["input_ids"]
            ids = [int(t) for t in ids if int(t) != tok.eos_token_id]
            prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
            return prompt_ids, ids, choice.finish_reason == "stop", {"retokenized": True} if retokenized else {}

        with ThreadPoolExecutor(max_workers=min(server.concurrency, len(prompts))) as pool:
            return list(pool.map(one, range(len(prompts))))


def regeneration_key(stage, target_fp: str, tokenizer_fp: str, data_fp: str, seed: int) -> str:
    # where the answers come from counts, not how the server is reached
    settings = stage.model_dump(mode="json", exclude={"server"})
    if getattr(stage, "server", None) is not None:
        settings["server_model"] = stage.server.model
    settings = json.dumps(settings, sort_keys=True)
    return fingerprint_texts([settings], f"v{REGENERATION_VERSION}", target_fp, tokenizer_fp, data_fp, f"seed={seed}")


def regenerated_splits(stage, target, tokenizer, splits, seed: int, target_fp: str, tokenizer_fp: str) -> dict:
    """Answer ``stage``'s train prompts (split over ``stage.temperatures``) and held-out prompts (greedy),
    or reuse the cached answers. Returns the record: files, key, counts, response tokens and tokens/s."""
    key = regeneration_key(stage, target_fp, tokenizer_fp, splits.fingerprint, seed)
    folder = cache_dir() / "regenerated" / key
    manifest = folder / "manifest.json"
    if manifest.exists():
        return {**json.loads(manifest.read_text()), "reused": True}
    jobs = []  # (file, prompts, temperature, seed)
    per_temp = -(-stage.train_prompts // len(stage.temperatures))
    train_prompts = corpus_prompts(splits.train, per_temp * len(stage.temperatures), stage.prompt_tokens, tokenizer, seed)
    for j, temperature in enumerate(stage.temperatures):
        jobs.append((folder / f"train_t{temperature:g}.jsonl", train_prompts[j * per_temp:(j + 1) * per_temp], temperature, seed + j))
    val_prompts = corpus_prompts(splits.val, stage.val_prompts, stage.prompt_tokens, tokenizer, seed + 1)
    jobs.append((folder / "val_t0.jsonl", val_prompts, 0.0, seed))
    stats = {}
    for file, prompts, temperature, job_seed in jobs:
        stats[file.name] = answer_prompts(
            target, tokenizer, prompts, file, max_new_tokens=stage.max_new_tokens, temperature=temperature,
            top_p=stage.top_p, top_k=stage.top_k, batch_size=stage.batch_size, seed=job_seed,
            desc=f"regenerating {file.stem}", server=stage.server)
    record = {"key": key, "folder": str(folder), "train_files": [str(j[0]) for j in jobs[:-1]], "val_files": [str(jobs[-1][0])],
              "files": stats, "train_response_tokens": sum(s["response_tokens"] for n, s in stats.items() if n.startswith("train")),
              "settings": stage.model_dump(mode="json")}
    tmp = manifest.with_name("manifest.json.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, manifest)
    return {**record, "reused": False}


def training_splits(data, stage, target, tokenizer, seed: int):
    """What a training recipe trains on: ``data``'s corpus, or with a ``regenerate:`` ``stage`` the
    target's own answers to prompts cut from it (regenerated now, or read back from their cache:
    recipes with the same stage, corpus, target and seed share one). Returns the text splits, the data
    config to cut them into windows with, and the run's data record."""
    from .data import load_text_splits, regenerated_text_splits, tokenizer_fingerprint
    from .feature_cache import target_fingerprint

    splits, regenerated = load_text_splits(data, seed), None
    if stage is not None:
        regenerated = regenerated_splits(stage, target, tokenizer, splits, seed, target_fingerprint(target),
                                         tokenizer_fingerprint(tokenizer))
        splits = regenerated_text_splits(regenerated)
        data = data.model_copy(update={"format": "prompt_response"})
    record = {"description": splits.description, "data_fingerprint": splits.fingerprint,
              "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}
    if regenerated is not None:
        record["regenerated"] = {k: regenerated[k] for k in ("key", "folder", "files", "train_response_tokens", "reused")}
    return splits, data, record
