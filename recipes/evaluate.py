"""Recipe ``eval``: speculative decoding vs plain decoding of the same target, on the same prompts.

For every prompt the baseline (greedy, KV cache) and the speculative loop run back to back, in the
same process and thread count, so machine noise hits both alike; the ratio of their throughputs is
the speedup. At temperature 0 ``lossless`` checks every speculative output against the baseline token
for token; at temperature > 0 outputs differ draw by draw (``lossless`` is null) and exactness is the
distribution test in ``tests/test_sampling.py``.

Report (``report.json``): ``tau`` (tokens emitted per target forward, bonus included), ``adaptive``
(with ``decoding.budget.adaptive``: the measured verify costs, the mean tokens verified per step and the
acceptance calibration, the cost model's predicted tau / step time / tokens per second beside the
measured ones, :mod:`serve_eval.budget`), ``by_batch`` (with ``decoding.batches.sizes``: batched
speculative vs batched plain decoding per batch size, :mod:`serve_eval.measure`),
``acceptance_by_position`` (P(draft k accepted | drafts 1..k-1 accepted)), ``tokens_per_s``,
``baseline_tokens_per_s``, ``speedup``, the time split (draft / verify / other), ``lossless``, and
per-prompt numbers; ``acceptance_by_position.png`` plots the acceptance curve. ``record_served``
writes ``served.jsonl``: every prompt with the answer the loop served (the target's own, since the loop
is lossless) in the records a drafter recipe trains on, so a drafter can keep learning from what it
served (online adaptation, ``recipes/configs/adapt_testbed.yaml``). With a quantized KV
cache (``decoding.kv.format``) both loops use it, so ``speedup`` and ``lossless`` compare like with like,
and ``kv_quality`` measures the quantized target against the full-precision one: cache bytes per
token, NLL of the held-out prompts, how long greedy outputs agree, plain decoding tokens/s. How the
models were served: ``backend`` (``torch`` or ``cpu``, :mod:`serve_eval.backend`), ``target_forward``, and on the
CPU backend ``drafter_int8``, ``draft_attention``, ``target_prepack``, ``target_attention`` and ``draft_compiled``
(the graph, the cache length it was built for, and ``graph_drafts``: the drafts it made), ``off`` where off.

    draftsmith eval --drafter runs/quickstart/drafter/checkpoints/best --target testbed --prompts-from-corpus 16
    draftsmith run recipes/configs/eval_testbed.yaml drafter=runs/dflash_testbed/checkpoints/best
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import drafters
from distill.checks import check_drafter_fits
from distill.config import EvalRecipe, RecipeError
from distill.config.paths import same_folder
from distill.models import load_target
from distill.provenance import write_json_atomic, write_jsonl_atomic, write_run_header
from distill.regenerate import encoded_prompts
from distill.runtime import set_threads
from recipes.plots import saved_figure
from serve_eval.backend import decoding_backend
from serve_eval.budget import Calibration
from serve_eval.kv import cache_nbytes, inplace_cache, kv_quant
from serve_eval.loop import plain_generate, speculative_generate
from serve_eval.measure import measure, measure_batches
from serve_eval.proposers import make_proposer
from serve_eval.sampling import Sampler


def load_drafter(folder: str, target, device):
    """A DFlash / DSpark / EAGLE-3 drafter, or any causal LM (a student, a Parcae model) by folder; a
    folder in vLLM's ``speculators`` format (a published drafter) is read into a draftsmith drafter
    (:func:`drafters.export.read_speculators`: its layer ids, attention and draft vocabulary). A drafter
    folder without the target's embeddings and LM head (a shipped one, a speculators one) gets them from
    ``target``."""
    import json

    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    import parcae  # noqa: F401  (and Parcae with AutoModelForCausalLM)

    dtype = next(target.parameters()).dtype  # the target's: a bf16 target on a GPU gets a bf16 drafter
    raw = json.loads((Path(folder) / "config.json").read_text())
    if "speculators_model_type" in raw:
        from drafters.export import read_speculators

        check_drafter_fits(raw, target.config.to_dict(), folder, target.config.name_or_path)
        drafter, _ = read_speculators(Path(folder), target)
        return drafter.to(device=device, dtype=dtype).eval()
    config = AutoConfig.from_pretrained(folder)
    # recipe validation checked this already for a target on disk; a hub target is known only now
    check_drafter_fits(config.to_dict(), target.config.to_dict(), folder, target.config.name_or_path)
    if drafters.kind_of(config) is None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    shared = drafters.shares_target_io(folder)  # shipped without the target's embeddings and head
    drafter = AutoModel.from_pretrained(folder, dtype=dtype).to(device).eval()
    return drafter.share_target_io(target) if shared else drafter


def warm_up(target, drafter, prompt, eos, dec, backend) -> None:
    """A few tokens of plain and speculative decoding: first calls pay for allocations and lazy
    initialisation, which no measurement should."""
    plain_generate(target, prompt, 4, eos, backend=backend)
    proposer = make_proposer(
        drafter,
        draft_length=dec.drafter.draft_length,
        draft_recurrence=dec.drafter.draft_recurrence,
        parallel=dec.drafter.parallel_drafts,
        backend=backend,
    )
    speculative_generate(target, drafter, prompt, 4, eos, backend=backend, proposer=proposer)


def template_warnings(drafter_folder: str, template_kwargs: dict) -> list[str]:
    """A warning per chat template setting the drafter was trained with (its run's ``recipe.yaml``,
    ``target.chat_template_kwargs``) that differs from ``template_kwargs``, the ones evaluated with:
    a drafter trained with thinking on drafts thinking, which a target with thinking off does not write."""
    trained = trained_template_kwargs(drafter_folder)
    if trained is None:
        return []
    return [
        f"the drafter was trained with chat_template_kwargs {key}={trained.get(key, 'unset')!r} and is "
        f"evaluated with {key}={template_kwargs.get(key, 'unset')!r}: its acceptance here understates it"
        for key in sorted(set(trained) | set(template_kwargs))
        if trained.get(key) != template_kwargs.get(key)
    ]


def trained_template_kwargs(folder: str) -> dict | None:
    """``target.chat_template_kwargs`` of the training run that wrote a drafter folder (its ``recipe.yaml``
    beside it or up to two folders above: ``run/model``, ``run/checkpoints/best``); None when unknown."""
    import yaml

    for where in (Path(folder), *list(Path(folder).resolve().parents)[:2]):
        recipe = where / "recipe.yaml"
        if recipe.is_file():
            raw = yaml.safe_load(recipe.read_text()) or {}
            if raw.get("recipe") in ("train_drafter", "distill_student"):
                return dict((raw.get("target") or {}).get("chat_template_kwargs") or {})
    return None


def draft_vocabulary(
    drafter,
    target,
    tokenizer,
    size: int,
    prompts: int,
    data,
    seed: int,
    prompt_tokens: int,
    new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    candidates: int = 0,
    rank: int = 64,
) -> dict:
    """Restrict the drafter's heads to the ``size`` tokens the target emits most (EAGLE-3's way,
    :mod:`drafters.vocab`): counted over its answers to ``prompts`` prompts cut from ``data``'s train
    split (never the evaluation prompts), sampled as the evaluation samples (greedy at T = 0: a
    sampled target emits many tokens its greedy answers never do), answered once and cached under
    ``$DRAFTSMITH_CACHE/draft_vocab/``. Returns what a report records: the size, where the counts
    come from, and the share of those answer tokens the draft vocabulary covers.

    With ``candidates`` the vocabulary is chosen per step instead (:class:`drafters.vocab.CandidateHead`):
    those ``size`` tokens (none at ``size`` 0: nothing is counted) plus the ``candidates`` likeliest in
    any drafted row under a rank-``rank`` approximation of the head; the record says so under
    ``"per_step"`` (:meth:`drafters.vocab.CandidateHead.summary`)."""
    import hashlib
    import json

    from distill.data import load_text_splits
    from distill.feature_cache import target_fingerprint
    from distill.regenerate import answer_prompts, corpus_prompts
    from distill.testbed import cache_dir
    from drafters.vocab import coverage, frequent_tokens, restrict_vocab, speculate_vocab

    if size == 0:
        return {
            "size": 0,
            "of": drafter.config.vocab_size,
            "per_step": speculate_vocab(drafter, None, candidates, rank).summary(),
        }
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    key = hashlib.sha256(
        json.dumps(
            [
                target_fingerprint(target),
                data.model_dump(mode="json"),
                seed,
                prompts,
                prompt_tokens,
                new_tokens,
                sampling,
            ]
        ).encode()
    ).hexdigest()[:16]
    answers = cache_dir() / "draft_vocab" / f"{key}.jsonl"
    if not answers.exists():
        cut = corpus_prompts(load_text_splits(data, seed).train, prompts, prompt_tokens, tokenizer, seed + 1)
        answer_prompts(
            target,
            tokenizer,
            cut,
            answers,
            max_new_tokens=new_tokens,
            batch_size=32,
            seed=seed,
            desc="draft vocabulary: the target answers train-split prompts",
            **sampling,
        )
    tokens = [t for line in answers.read_text().splitlines() for t in json.loads(line)["response_ids"]]
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=drafter.config.vocab_size)
    ids = frequent_tokens(counts, size)
    record = {
        "size": len(ids),
        "of": drafter.config.vocab_size,
        "counted_tokens": len(tokens),
        "source": f"the target's answers to {prompts} train-split prompts at T = {temperature}",
        "coverage": round(coverage(ids, counts), 4),
    }
    if candidates:
        return {**record, "per_step": speculate_vocab(drafter, ids, candidates, rank).summary()}
    restrict_vocab(drafter, ids)
    return record


def plot_acceptance(acceptance: list[float], tau: float, path: Path, title: str) -> None:
    with saved_figure(path, figsize=(5, 3.2)) as (_, ax):
        ax.bar(range(1, len(acceptance) + 1), acceptance, color="#3b7dd8")
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | 1..k-1 accepted)")
        ax.set_ylim(0, 1)
        ax.set_title(f"{title}  (tau = {tau:.2f})", fontsize=9)


SCHEMA = EvalRecipe


@torch.no_grad()
def main(recipe: EvalRecipe, dry_run: bool = False) -> dict:  # noqa: PLR0912, PLR0915 the recipe's steps, in order
    dec = recipe.decoding
    set_threads(dec.torch_threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, tokenizer = load_target(recipe.target, device)
    same = same_folder(recipe.drafter, recipe.target.path)
    drafter = target if same else load_drafter(recipe.drafter, target, device)  # self-speculation shares weights
    encoded = encoded_prompts(
        recipe.prompts, recipe.data, recipe.seed, tokenizer, device, recipe.target.chat_template_kwargs
    )
    vocab = dec.vocab
    if (vocab.size or vocab.candidates) and not isinstance(getattr(drafter, "lm_head", None), torch.nn.Linear):
        key = f"decoding.vocab.{'size' if vocab.size else 'candidates'}"  # the target drafting for itself: refused with the recipe
        raise RecipeError(
            f"{key}: a draft vocabulary restricts a drafter's own output head (an lm_head Linear); this "
            f"drafter, {drafter.config.model_type!r}, has none"
        )
    if vocab.size > len(tokenizer):
        raise RecipeError(
            f"decoding.vocab.size = {vocab.size} exceeds the target's vocabulary ({len(tokenizer)} tokens)"
        )
    if vocab.candidates:
        head = drafter.lm_head.weight.shape
        if vocab.candidates > head[0] or vocab.rank > min(head):
            raise RecipeError(
                f"decoding.vocab.candidates = {vocab.candidates} / decoding.vocab.rank = {vocab.rank} do "
                f"not fit the drafter's {head[0]} x {head[1]} output head"
            )
    try:  # what a device or a drafter cannot serve; a target drafting for itself with head / all was refused with the recipe
        backend = decoding_backend(dec, device, drafter, same)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    if dec.ssd.enabled and dec.ssd.concurrent and device != "cpu":
        raise RecipeError(
            "decoding.ssd.concurrent runs the drafter in a CPU worker process on a core of its own; on "
            f"{device} set decoding.ssd.concurrent: false (inline)"
        )
    if dec.batches.sizes and max(dec.batches.sizes) > len(encoded):
        raise RecipeError(
            f"decoding.batches.sizes: {max(dec.batches.sizes)} rows need at least as many prompts, "
            f"the recipe has {len(encoded)}"
        )
    if dry_run:
        return {"prompts": len(encoded), "drafter": drafter.config.model_type}
    out = Path(recipe.output_dir)
    write_run_header(out, recipe)
    eos = tokenizer.eos_token_id
    vocab_record = (
        draft_vocabulary(
            drafter,
            target,
            tokenizer,
            vocab.size,
            vocab.prompts,
            recipe.data,
            recipe.seed,
            recipe.prompts.prompt_tokens,
            dec.max_new_tokens,
            dec.temperature,
            dec.top_p,
            dec.top_k,
            vocab.candidates,
            vocab.rank,
        )
        if vocab.size or vocab.candidates
        else None
    )
    if vocab_record is None and getattr(drafter.config, "draft_vocab_size", None):  # trained or exported with one
        vocab_record = {
            "size": drafter.config.draft_vocab_size,
            "of": drafter.config.vocab_size,
            "source": "the drafter's own (saved with it)",
        }
    records = backend.prepare(
        target, drafter, encoded, dec.max_new_tokens, dec.temperature > 0, tuple(dec.batches.sizes)
    )

    warm_up(target, drafter, encoded[0], eos, dec, backend)

    def sampler(prompt_index: int) -> Sampler:  # the same seeds for both loops
        gen = torch.Generator(device=device).manual_seed(recipe.seed * 1_000_003 + prompt_index)
        return Sampler(dec.temperature, dec.top_k, dec.top_p, gen)

    budgets = dec.tree_budgets if dec.mode == "tree" else [None]
    calibration = (
        Calibration() if dec.batches.sizes and dec.budget.adaptive else None
    )  # the chain's, lent to the batches
    served = [] if recipe.record_served else None  # what the first configuration served (online adaptation)
    runs = [
        measure(target, drafter, encoded, dec, eos, sampler, budget, calibration, served if i == 0 else None, backend)
        for i, budget in enumerate(budgets)
    ]
    if served is not None:  # with the texts, as regenerate writes them (the token ids are what training reads)
        write_jsonl_atomic(
            out / "served.jsonl",
            [
                {
                    **row,
                    "prompt": tokenizer.decode(row["prompt_ids"]),
                    "response": tokenizer.decode(row["response_ids"], skip_special_tokens=True),
                }
                for row in served
            ],
        )
    warnings = template_warnings(recipe.drafter, recipe.target.chat_template_kwargs)
    report = {
        "target": recipe.target.path,
        "drafter": recipe.drafter,
        "drafter_kind": drafter.config.model_type.removeprefix("draftsmith_"),
        "mode": dec.mode,
        **({"verify_drafts": dec.budget.verify_drafts} if dec.budget.verify_drafts else {}),
        "temperature": dec.temperature,
        "prompts": len(encoded),
        "max_new_tokens": dec.max_new_tokens,
        **runs[0],
        "torch_threads": torch.get_num_threads(),
        "device": device,
        **({"draft_vocab": vocab_record} if vocab_record else {}),
        **records,
        "chat_template_kwargs": recipe.target.chat_template_kwargs,
        "warnings": warnings,
    }
    graph = backend.draft_graph(drafter)
    if graph is not None:  # how many drafts the graph made (the rest: first drafts after a prompt, eager)
        report["draft_compiled"]["graph_drafts"] = graph.calls
    if backend.compiled_graphs() is not None:  # one per (function, rows, length) shape: bounded, and counted
        report["compiled_graphs"] = backend.compiled_graphs()
    if dec.kv.format != "full":
        report["kv_quality"] = measure_kv_quality(target, encoded, dec, eos, sampler, backend)
    if len(runs) > 1:
        report["by_budget"] = [{k: r[k] for k in ("tree_budget", "tau", "speedup", "tokens_per_s")} for r in runs]
    if dec.batches.sizes:
        report["by_batch"] = measure_batches(
            target, drafter, encoded, dec, eos, sampler, dec.batches.sizes, calibration, backend
        )
    if recipe.peer_assistant and dec.temperature == 0:
        report["peer_transformers_assisted"] = measure_assisted(
            target, recipe.peer_assistant, encoded, dec, eos, device
        )
    if recipe.peer_prompt_lookup and dec.temperature == 0:  # drafter-free: n-grams of the prompt and output so far
        report["peer_prompt_lookup"] = {
            "tokens": recipe.peer_prompt_lookup,
            **measure_generate_peer(target, encoded, dec, eos, prompt_lookup_num_tokens=recipe.peer_prompt_lookup),
        }
    for key in ("peer_transformers_assisted", "peer_prompt_lookup"):
        if key in report:  # our loop's tokens/s over the peer's, measured in this run
            report[key]["ours_over_peer"] = round(report["tokens_per_s"] / report[key]["tokens_per_s"], 4)
    write_json_atomic(out / "report.json", report)
    plot_acceptance(
        report["acceptance_by_position"],
        report["tau"],
        out / "acceptance_by_position.png",
        f"{report['drafter_kind']}, {dec.mode}",
    )
    if len(runs) > 1:
        plot_budgets(report["by_budget"], out / "tau_speedup_by_budget.png")
    print(
        f"\n== eval ({report['drafter_kind']}, {dec.mode}, T={dec.temperature}, {len(encoded)} prompts, "
        f"{dec.max_new_tokens} new tokens, {report['torch_threads']} thread(s), {device}) =="
    )
    for key in ("tau", "tokens_per_s", "baseline_tokens_per_s", "speedup", "lossless"):
        print(f"  {key:<22} {report[key]}")
    print(f"  {'acceptance_by_position':<22} {report['acceptance_by_position']}")
    split = report["time_split"]
    print(
        f"  {'time split':<22} draft {split['draft_fraction']:.0%}, verify {split['verify_fraction']:.0%}, "
        f"other {1 - split['draft_fraction'] - split['verify_fraction']:.0%}"
    )
    if report.get("adaptive"):
        budget = report["adaptive"]
        print(
            f"  {'per-step budget':<22} {budget['mean_verified']} tokens verified per step on average "
            f"(steps by tokens verified: {budget['verified_histogram']}); draft {budget['draft_ms']} ms"
        )
        for key in ("predicted", "measured"):
            row = budget[key]
            print(f"  {'  ' + key:<22} tau {row['tau']}, {row['step_ms']} ms a step, {row['tokens_per_s']} tokens/s")
    for key, name in (("peer_transformers_assisted", "transformers assisted"), ("peer_prompt_lookup", "prompt lookup")):
        if key in report:
            peer = report[key]
            print(
                f"  {name:<22} speedup {peer['speedup']} over generate, tokens/s {peer['tokens_per_s']} "
                f"(ours {peer['ours_over_peer']}x that), same as greedy: {peer['same_as_greedy']}"
            )
    if "kv_quality" in report:
        q = report["kv_quality"]
        print(
            f"  {'kv cache ' + q['format']:<22} {q['bytes_per_token']['quantized']} vs {q['bytes_per_token']['full']} bytes "
            f"a token; NLL {q['nll']['quantized']} vs {q['nll']['full']}; outputs equal to full precision's for "
            f"{q['same_tokens_share']:.1%} of tokens; plain decoding {q['plain_tokens_per_s']['quantized']} vs "
            f"{q['plain_tokens_per_s']['full']} tokens/s"
        )
    if "ssd" in report:
        ssd, sd = report["ssd"], report["ssd"]["speculative_decoding"]
        print(
            f"  {'ssd':<22} {'concurrent' if ssd['concurrent'] else 'inline'}: hit rate {ssd['hit_rate']:.0%} "
            f"({ssd['mean_drafts_on_hit']} drafts a hit), {ssd['over_speculative_decoding']}x plain speculative "
            f"decoding (tau {sd['tau']}, speedup {sd['speedup']}); bonus in the top F: {ssd['bonus_in_top_f']}"
        )
        if "modeled_separate_device_speedup" in ssd:
            print(
                f"  {'  drafter apart':<22} modeled speedup {ssd['modeled_separate_device_speedup']} "
                f"(verify {ssd['verify_ms']} ms, speculate {ssd['speculate_ms']} ms a step)"
            )
    for row in report.get("by_batch", []):
        scheduler = row["scheduler"] or {}
        print(
            f"  batch {row['batch']:>4}: tau {row['tau']:.3f}, {row['tokens_per_s']:.1f} vs {row['baseline_tokens_per_s']:.1f} "
            f"tokens/s batched plain, speedup {row['speedup']:.3f} ({row['rounds']} x ABBA; halves "
            f"{' / '.join(map(str, row['speedup_halves']))}), "
            f"lossless {row['lossless']}"
            + (f", drafted {scheduler['drafted_fraction']:.0%} of steps" if scheduler else "")
            + (
                f", a copy read in {scheduler['copied_fraction']:.0%} of row-steps"
                if "copied_fraction" in scheduler
                else ""
            )
            + (
                f" (predicted {scheduler['predicted_speedup']:.2f}, margin {scheduler['up_front_margin']})"
                if "up_front_margin" in scheduler
                else ""
            )
        )
    for row in report.get("by_budget", []):
        print(f"  budget {row['tree_budget']:>4}: tau {row['tau']:.3f}, speedup {row['speedup']:.3f}")
    for warning in warnings:
        print(f"  warning: {warning}")
    print(f"wrote {out / 'report.json'}")
    return report


@torch.no_grad()
def measure_kv_quality(target, encoded, dec, eos, sampler, backend) -> dict:
    """The target with ``dec``'s quantized KV cache against itself in full precision (a quantized
    cache changes the target): bytes the cache holds per token; mean NLL of the held-out prompts'
    tokens, teacher-forced (every position attends through the cache, :mod:`serve_eval.kv`); the
    share of new tokens before each prompt's first divergence from the full-precision output (same
    sampler seeds), and of prompts with identical outputs; plain decoding tokens/s of both."""
    kv = kv_quant(dec.kv.format, dec.kv.rotate)
    nll, nbytes, positions = {"full": 0.0, "quantized": 0.0}, {"full": 0, "quantized": 0}, 0
    for prompt in encoded:
        for name, spec in (("full", None), ("quantized", kv)):
            cache = inplace_cache(target.config, spec)
            logits = target(input_ids=prompt[None], cache=cache, use_cache=True).logits[0, :-1].float()
            nll[name] += float(torch.nn.functional.cross_entropy(logits, prompt[1:], reduction="sum"))
            nbytes[name] += cache_nbytes(cache)
        positions += len(prompt)
    same = identical = tokens = 0
    seconds, counts = {"full": 0.0, "quantized": 0.0}, {"full": 0, "quantized": 0}
    for i, prompt in enumerate(encoded):
        outs = {}
        for name, spec in (("full", None), ("quantized", kv)):
            outs[name], stats = plain_generate(target, prompt, dec.max_new_tokens, eos, sampler(i), spec, backend)
            seconds[name] += stats.total_seconds
            counts[name] += stats.tokens
        full, quantized = outs["full"], outs["quantized"]
        agree = next((j for j, (a, b) in enumerate(zip(full, quantized)) if a != b), min(len(full), len(quantized)))
        same, tokens, identical = same + agree, tokens + len(full), identical + (full == quantized)
    scored = positions - len(encoded)
    return {
        "format": dec.kv.format,
        "rotate": dec.kv.rotate,
        "bytes_per_token": {k: round(v / positions, 1) for k, v in nbytes.items()},
        "nll": {k: round(v / scored, 4) for k, v in nll.items()},
        "same_tokens_share": round(same / max(1, tokens), 4),
        "identical_outputs": f"{identical}/{len(encoded)}",
        "plain_tokens_per_s": {k: round(counts[k] / seconds[k], 2) for k in seconds},
    }


def measure_assisted(target, assistant_path: str, encoded, dec, eos, device) -> dict:
    """transformers' own assisted generation (an autoregressive assistant, its default dynamic schedule)."""
    from transformers import AutoModelForCausalLM

    assistant = AutoModelForCausalLM.from_pretrained(assistant_path, dtype=target.dtype).to(device).eval()
    return {"assistant": assistant_path, **measure_generate_peer(target, encoded, dec, eos, assistant_model=assistant)}


def measure_generate_peer(target, encoded, dec, eos, **peer_kwargs) -> dict:
    """transformers ``generate(**peer_kwargs)`` (assisted generation, prompt lookup) against ``generate``
    without them, greedy, on the same prompts: an outside reference point."""
    common = dict(max_new_tokens=dec.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    tokens = base_tokens = 0
    seconds = base_seconds = 0.0
    same = True
    for prompt in encoded:
        t0 = time.perf_counter()
        plain = target.generate(prompt[None], **common)[0, prompt.shape[0] :]
        t1 = time.perf_counter()
        peer = target.generate(prompt[None], **peer_kwargs, **common)[0, prompt.shape[0] :]
        t2 = time.perf_counter()
        same &= torch.equal(plain, peer)
        base_tokens, tokens = base_tokens + plain.numel(), tokens + peer.numel()
        base_seconds, seconds = base_seconds + t1 - t0, seconds + t2 - t1
    return {
        "tokens_per_s": round(tokens / seconds, 2),
        "generate_tokens_per_s": round(base_tokens / base_seconds, 2),
        "speedup": round((tokens / seconds) / (base_tokens / base_seconds), 4),
        "same_as_greedy": same,
    }


def plot_budgets(rows: list[dict], path: Path) -> None:
    budgets = [r["tree_budget"] for r in rows]
    with saved_figure(path, figsize=(5, 3.2)) as (fig, ax):
        ax.plot(budgets, [r["tau"] for r in rows], "o-", color="#3b7dd8", label="tau")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget (nodes)")
        ax.set_ylabel("tau (tokens / target forward)")
        twin = ax.twinx()
        twin.plot(budgets, [r["speedup"] for r in rows], "s--", color="#d8703b", label="speedup")
        twin.set_ylabel("speedup vs plain decoding")
        fig.legend(loc="lower right", fontsize=8)
