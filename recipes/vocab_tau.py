"""Acceptance against draft vocabulary: a drafter's tau with its whole head, a static draft vocabulary
and per-step vocabularies, on the same prompts and seeds.

    python -m recipes.vocab_tau --drafter distill/assets/testbed_dflash --temperature 1 --seeds 4 \
        --vocab full 1024 512:512 0:1024

Each ``--vocab`` entry is ``full``, ``N`` (the N tokens the target's answers use most,
:func:`recipes.evaluate.draft_vocabulary`) or ``N:K[:R]`` (a per-step vocabulary: those N
plus the K likeliest under a rank-R approximation, R = ``decoding.vocab.rank``'s default,
:class:`drafters.vocab.CandidateHead`).
Every draft is verified (no budget: tau depends on acceptance only, not on timing), over the eval
recipe's held-out prompts (``recipes/configs/eval_testbed.yaml`` unless ``--recipe``) times ``--seeds``
sampling seeds; at T = 0 one seed is enough. Prints tau and its share of the first entry's.
"""

from __future__ import annotations

import argparse

from distill.base.decoding import VocabSection

DEFAULT_RANK = VocabSection.model_fields["rank"].default


def parse_vocab(entry: str) -> tuple[int, int, int] | None:
    """``full`` -> None; ``N`` -> (N, 0, DEFAULT_RANK); ``N:K[:R]`` -> (N, K, R)."""
    if entry == "full":
        return None
    parts = [int(p) for p in entry.split(":")]
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"--vocab {entry!r}: full, N, N:K or N:K:R")
    return parts[0], parts[1] if len(parts) > 1 else 0, parts[2] if len(parts) > 2 else DEFAULT_RANK


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--recipe", default="recipes/configs/eval_testbed.yaml")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, default=4, help="sampling seeds per prompt")
    parser.add_argument("--vocab", nargs="+", default=["full", "1024", "512:512", "0:1024"])
    parser.add_argument("--prompts", type=int, help="the first N held-out prompts (default: the recipe's all)")
    parser.add_argument("--max-new-tokens", type=int, help="default: the recipe's")
    args = parser.parse_args(argv)
    try:
        entries = [(v, parse_vocab(v)) for v in args.vocab]
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")

    import torch

    from distill.models import load_target
    from distill.regenerate import encoded_prompts
    from distill.runtime import set_threads
    from recipes.evaluate import draft_vocabulary, load_drafter
    from recipes.registry import load_recipe
    from serve_eval import loop
    from serve_eval.sampling import Sampler

    recipe = load_recipe(
        args.recipe,
        [f"drafter={args.drafter}", f"decoding.temperature={args.temperature}"]
        + ([f"decoding.max_new_tokens={args.max_new_tokens}"] if args.max_new_tokens else []),
    )
    dec = recipe.decoding
    set_threads(dec.torch_threads)
    target, tokenizer = load_target(recipe.target, "cpu")
    prompts = encoded_prompts(
        recipe.prompts, recipe.data, recipe.seed, tokenizer, "cpu", recipe.target.chat_template_kwargs
    )[: args.prompts]
    rows = []
    for name, vocab in entries:
        drafter = load_drafter(recipe.drafter, target, "cpu")  # afresh: each entry changes its head
        record = {}
        if vocab is not None:
            record = draft_vocabulary(
                drafter,
                target,
                tokenizer,
                vocab[0],
                dec.vocab.prompts,
                recipe.data,
                recipe.seed,
                recipe.prompts.prompt_tokens,
                dec.max_new_tokens,
                dec.temperature,
                dec.top_p,
                dec.top_k,
                vocab[1],
                vocab[2],
            )
        tokens = forwards = 0
        for seed in range(args.seeds if dec.temperature > 0 else 1):
            for i, prompt in enumerate(prompts):
                sampler = Sampler(dec.temperature, dec.top_k, dec.top_p, torch.Generator().manual_seed(1000 * seed + i))
                _, stats = loop.speculative_generate(target, drafter, prompt, dec.max_new_tokens, None, sampler)
                tokens, forwards = tokens + stats.tokens, forwards + stats.target_forwards - 1  # the prefill emits one
        tau = tokens / forwards
        rows.append(
            {
                "vocab": name,
                "tau": round(tau, 4),
                "share": round(tau / rows[0]["tau"], 4) if rows else 1.0,
                **{k: record[k] for k in ("coverage", "per_step") if k in record},
            }
        )
        coverage = f"  static coverage {record['coverage']:.3f}" if "coverage" in record else ""
        print(f"{name:>10s}  tau {tau:.3f}  ({rows[-1]['share']:.1%} of {entries[0][0]}){coverage}", flush=True)
    return rows


if __name__ == "__main__":
    main()
