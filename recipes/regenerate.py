"""Recipe ``regenerate``: the target answers prompts itself; the answers become drafter training data.

A drafter is judged by how often the *target* agrees with it, so it should learn the target's own
distribution, not the corpus's: the reference trainers regenerate responses with the target before
training (DeepSpec, speculators). Prompts come from a JSONL file (a ``prompt`` string or chat
``messages`` per line) or are cut from the corpus (testbed: snippets of held-in stdlib source).

Output: ``<output_dir>/data.jsonl``, one ``{"id", "prompt" | "messages", "response"}`` per line, loadable
with ``data.source: files, data.format: prompt_response`` (or ``messages``). Resumable: prompts are cut
into fixed batches; each finished batch is appended (and flushed) to ``data.jsonl.partial``; a re-run
keeps the complete batches, drops a torn or half-written one, and continues; the file is renamed to
``data.jsonl`` when every prompt is answered. Each batch samples with its own seed, so a resumed run
writes exactly what an uninterrupted one would.

    draftsmith run recipes/configs/regenerate_testbed.yaml
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from distill.config import RegenerateRecipe
from distill.data import load_text_splits
from distill.models import load_target
from distill.provenance import write_run_header
from distill.runtime import set_threads


def corpus_prompts(recipe, tokenizer) -> list[dict]:
    """``from_corpus`` snippets of ``prompt_tokens`` tokens at seeded offsets in documents of ``prompts.split``."""
    splits = load_text_splits(recipe.data, recipe.seed)
    docs = splits.train if recipe.prompts.split == "train" else splits.val
    rng = np.random.default_rng(recipe.seed)
    n, length = recipe.prompts.from_corpus, recipe.prompts.prompt_tokens
    prompts = []
    for i in rng.choice(len(docs), size=n, replace=n > len(docs)):
        ids = tokenizer(docs[i], add_special_tokens=False)["input_ids"]
        start = int(rng.integers(0, max(1, len(ids) - length)))
        prompts.append({"prompt": tokenizer.decode(ids[start:start + length])})
    return prompts


def load_prompts(recipe, tokenizer) -> list[dict]:
    return file_prompts(recipe) if recipe.prompts.file else corpus_prompts(recipe, tokenizer)


def file_prompts(recipe) -> list[dict]:
    rows = [json.loads(line) for line in Path(recipe.prompts.file).read_text().splitlines() if line.strip()]
    field = recipe.prompts.field
    for i, row in enumerate(rows):
        if field not in row and "messages" not in row:
            raise ValueError(f"{recipe.prompts.file} line {i + 1}: no '{field}' or 'messages' key")
    return [{"messages": r["messages"]} if "messages" in r else {"prompt": r[field]} for r in rows]


def render(prompt: dict, tokenizer) -> str:
    """The text the target continues: its chat template when it has one, else the raw prompt."""
    messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(m["content"] for m in messages)


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
def main(recipe: RegenerateRecipe, dry_run: bool = False) -> dict:
    set_threads(recipe.torch_threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, tokenizer = load_target(recipe.target, device)
    prompts = load_prompts(recipe, tokenizer)
    if dry_run:
        return {"prompts": len(prompts), "example": render(prompts[0], tokenizer)[:200]}

    out = Path(recipe.output_dir)
    write_run_header(out, recipe)
    final, partial = out / "data.jsonl", out / "data.jsonl.partial"
    gen = recipe.generation
    # fixed batches over all prompts, so a resumed run pads and seeds every batch as the first run did
    batches = [list(range(b, min(b + gen.batch_size, len(prompts)))) for b in range(0, len(prompts), gen.batch_size)]
    done = {} if final.exists() else read_done(partial, batches)
    todo = [] if final.exists() else [batch for batch in batches if batch[0] not in done]
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with open(partial, "a") as sink:
        for batch in tqdm(todo, desc="regenerating", unit="batch"):
            torch.manual_seed(recipe.seed * 1_000_003 + batch[0])  # per-batch seed: resumes reproduce
            enc = tokenizer([render(prompts[i], tokenizer) for i in batch], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            sampled = gen.temperature > 0
            outputs = target.generate(
                **enc, max_new_tokens=gen.max_new_tokens, do_sample=sampled, pad_token_id=pad,
                **({"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k} if sampled else {}),
            )
            for row, i in enumerate(batch):
                new = outputs[row, enc["input_ids"].shape[1]:].tolist()
                if tokenizer.eos_token_id in new:
                    new = new[:new.index(tokenizer.eos_token_id)]
                record = {"id": i, **prompts[i], "response": tokenizer.decode(new, skip_special_tokens=True)}
                sink.write(json.dumps(record) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
    if not final.exists():
        os.replace(partial, final)
    count = sum(1 for _ in open(final))
    print(f"wrote {count} responses to {final}")
    return {"data": str(final), "records": count}
