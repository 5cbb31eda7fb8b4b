"""Recipe ``regenerate``: the target answers prompts itself; the answers become drafter training data.

A thin entry point over :mod:`distill.regenerate` (which drafter recipes also run in-process, cached,
through their ``regenerate:`` section). Prompts come from a JSONL file (a ``prompt`` string or chat
``messages`` per line) or are cut from the corpus (testbed: snippets of held-in stdlib source).

Output: ``<output_dir>/data.jsonl``, one record per prompt with the text and the exact token ids (see
:mod:`distill.regenerate`), loadable with ``data.source: files, data.format: prompt_response`` (or
``messages``). Resumable: a re-run after a kill continues and writes exactly what an uninterrupted
run would. With a ``server:`` section the answers come from an OpenAI-compatible endpoint (vLLM,
SGLang, ``transformers serve``) instead, same records and resume rules: the way to regenerate at 8B
scale, where the reference trainers use a vLLM / SGLang server. Launched as several processes
(``torchrun`` / ``accelerate launch``), every rank answers its share of the batches with its own copy
of the target on its own device, and the main rank joins them: the same file as one process writes.

    draftsmith run recipes/configs/regenerate_testbed.yaml
    torchrun --nproc_per_node 8 -m recipes.cli run recipes/configs/regenerate_testbed.yaml
    vllm serve Qwen/Qwen3-8B --port 8000 &
    draftsmith run recipes/configs/regenerate_testbed.yaml target.path=Qwen/Qwen3-8B \
        server.base_url=http://127.0.0.1:8000/v1 server.model=Qwen/Qwen3-8B 'server.extra_body={return_token_ids: true}'
"""

from __future__ import annotations

from pathlib import Path

from distill.checkpoint import Ranks
from distill.config import RegenerateRecipe
from distill.models import load_target
from distill.provenance import write_json_atomic, write_run_header
from distill.regenerate import answer_prompts, load_prompts, render
from distill.runtime import set_threads

SCHEMA = RegenerateRecipe


def main(recipe: RegenerateRecipe, dry_run: bool = False) -> dict:
    import torch
    from accelerate import PartialState

    set_threads(recipe.torch_threads)
    # under torchrun / accelerate launch: this rank and its device (without CUDA, gloo ranks on the CPU)
    state = PartialState(cpu=not torch.cuda.is_available())
    ranks = Ranks.of(state)
    # through a server, only the tokenizer is needed here (the model is built on the meta device)
    target, tokenizer = load_target(recipe.target, state.device, weights=recipe.server is None and not dry_run)
    prompts = load_prompts(recipe.prompts, recipe.data, recipe.seed, tokenizer)
    if dry_run:
        return {
            "prompts": len(prompts),
            "example": render(prompts[0], tokenizer, recipe.target.chat_template_kwargs)[:200],
        }

    out = Path(recipe.output_dir)
    if ranks.is_main:
        write_run_header(out, recipe, world_size=ranks.world)
    gen = recipe.generation
    stats = answer_prompts(
        target,
        tokenizer,
        prompts,
        out / "data.jsonl",
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        batch_size=gen.batch_size,
        seed=recipe.seed,
        server=recipe.server,
        ranks=ranks,
        template_kwargs=recipe.target.chat_template_kwargs,
        reasoning=gen.reasoning,
    )
    summary = {"data": str(out / "data.jsonl"), "world_size": ranks.world, **stats}
    if ranks.is_main:
        write_json_atomic(out / "summary.json", summary)
        print(
            f"wrote {stats['records']} records, {stats['turns']} answers ({stats['response_tokens']} tokens, "
            f"{stats['tokens_per_s']} tokens/s; {stats['truncated']} cut at max_new_tokens, {stats['failed']} "
            f"failed, {stats['skipped']} skipped after a failure) to {out / 'data.jsonl'}"
        )
    return summary
