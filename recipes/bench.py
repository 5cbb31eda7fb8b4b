"""Recipe ``bench``: a drafter on the prompt sets everyone reports, per set and category.

For every condition (each of ``temperatures``, and with thinking on and off where the target's chat
template reads ``enable_thinking``) and every set (:mod:`distill.prompt_sets`: HumanEval, MT-Bench,
JSONL files), each question's turns are asked one after the other: turn ``t + 1`` follows the target's
own answer to turn ``t`` (the one the loop served, which is the target's: the loop is lossless). Each
turn of each question is decoded plainly and speculatively, back to back, as ``eval`` does
(:func:`serve_eval.measure.measure`), and the per-prompt rows add up per set, per category and per turn
(:func:`serve_eval.measure.summarize`).

Report (``report.json``): ``sets: {name: {questions, prompts, tau, speedup, lossless, acceptance_by_position,
tokens_per_s, baseline_tokens_per_s, conditions: [{temperature, thinking, ..., categories, by_turn}]}}``, the
set's own numbers being its first condition's; ``warnings`` (a drafter trained with other chat template
settings); ``compared: {folder: {drafter_kind, warnings, sets}}``, the same for each of ``compare`` (other
drafters on the same prompts: a published one in vLLM's ``speculators`` format beside one trained here);
every decoded prompt in ``per_prompt.jsonl``; ``bench.png``, the speedup per set (and MT-Bench category),
drafter and condition.

    draftsmith bench --drafter distill/assets/testbed_dflash --sets humaneval,mtbench --limit 20
    draftsmith run recipes/configs/bench_testbed.yaml
"""

from __future__ import annotations

from pathlib import Path

import torch

from distill.config import BenchRecipe, RecipeError
from distill.models import load_target
from distill.prompt_sets import PromptSet, load_set
from distill.provenance import write_json_atomic, write_jsonl_atomic, write_run_header
from distill.regenerate import prompt_token_ids
from distill.runtime import set_threads
from recipes.evaluate import load_drafter, template_warnings, warm_up
from recipes.plots import saved_figure
from serve_eval.backend import decoding_backend
from serve_eval.measure import measure, summarize
from serve_eval.sampling import Sampler

SCHEMA = BenchRecipe


def conditions(recipe: BenchRecipe, tokenizer) -> list[dict]:
    """Each ``{temperature, thinking}`` measured; ``thinking`` is None where the template has no switch."""
    switch = "enable_thinking" in str(getattr(tokenizer, "chat_template", None) or "")
    return [
        {"temperature": t, "thinking": thinking}
        for t in recipe.temperatures
        for thinking in (recipe.thinking if switch else [None])
    ]


def template_kwargs(recipe: BenchRecipe, condition: dict) -> dict:
    thinking = condition["thinking"]
    return {**recipe.target.chat_template_kwargs, **({} if thinking is None else {"enable_thinking": thinking})}


def run_set(target, drafter, tokenizer, prompt_set: PromptSet, dec, kwargs: dict, eos, backend, seed: int) -> list:
    """Every turn of every question of ``prompt_set``, measured; a per-prompt row each (with the
    question, its category and the turn)."""
    device = next(target.parameters()).device
    questions = prompt_set.questions
    histories = [list(q.context) for q in questions]
    budget = dec.tree_budgets[0] if dec.mode == "tree" else None
    rows: list[dict] = []
    for turn in range(max(len(q.turns) for q in questions)):
        asked = [i for i, q in enumerate(questions) if turn < len(q.turns)]
        for i in asked:
            histories[i].append({"role": "user", "content": questions[i].turns[turn]})
        encoded = [
            torch.tensor(prompt_token_ids({"messages": histories[i]}, tokenizer, kwargs), device=device) for i in asked
        ]

        def sampler(k: int, turn: int = turn, asked: list = asked) -> Sampler:  # the same seeds for both loops
            generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + turn * 10_007 + asked[k])
            return Sampler(dec.temperature, dec.top_k, dec.top_p, generator)

        served: list[dict] = []
        run = measure(target, drafter, encoded, dec, eos, sampler, budget, None, served, backend)
        for k, i in enumerate(asked):
            answer = tokenizer.decode(served[k]["response_ids"], skip_special_tokens=True)
            histories[i].append({"role": "assistant", "content": answer})
            q = questions[i]
            rows.append({"set": prompt_set.name, "question": q.id, "category": q.category, "turn": turn + 1})
            rows[-1].update({key: v for key, v in run["per_prompt"][k].items() if key != "prompt"})
    return rows


def set_result(rows: list[dict], condition: dict) -> dict:
    """One condition's measurement of a set: the whole, each category and each turn."""
    categories = sorted({r["category"] for r in rows if r["category"]})
    turns = sorted({r["turn"] for r in rows})
    return {
        **condition,
        **summarize(rows),
        "categories": {c: summarize([r for r in rows if r["category"] == c]) for c in categories},
        "by_turn": {str(t): summarize([r for r in rows if r["turn"] == t]) for t in turns} if len(turns) > 1 else {},
    }


def longest_prompt(sets: list[PromptSet], tokenizer, kwargs_of: list[dict], max_new_tokens: int) -> int:
    """A bound on the tokens any turn's prompt holds (earlier answers at most ``max_new_tokens`` each,
    plus slack for their text tokenizing differently), what the backend sizes its caches and graphs for."""
    longest = 0
    for prompt_set in sets:
        for q in prompt_set.questions:
            messages = list(q.context)
            for turn in q.turns:
                messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
            for kwargs in kwargs_of:
                rendered = prompt_token_ids({"messages": messages[:-1]}, tokenizer, kwargs)
                longest = max(longest, len(rendered) + (len(q.turns) - 1) * (max_new_tokens + 16))
    return longest


@torch.no_grad()
def main(recipe: BenchRecipe, dry_run: bool = False) -> dict:
    dec = recipe.decoding
    set_threads(dec.torch_threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sets = [load_set(s.name, s.file, recipe.limit) for s in recipe.sets]  # a missing package fails here, first
    target, tokenizer = load_target(recipe.target, device)
    folders = [recipe.drafter, *recipe.compare]
    loaded = {folder: load_drafter(folder, target, device) for folder in folders}
    conds = conditions(recipe, tokenizer)
    try:
        backends = {folder: decoding_backend(dec, device, drafter) for folder, drafter in loaded.items()}
    except ValueError as e:
        raise RecipeError(str(e)) from None
    if dry_run:
        return {"sets": {s.name: len(s.questions) for s in sets}, "conditions": conds, "drafters": folders}
    out = Path(recipe.output_dir)
    write_run_header(out, recipe)
    measured = {
        folder: bench_drafter(recipe, target, tokenizer, drafter, folder, backends[folder], sets, conds)
        for folder, drafter in loaded.items()
    }
    main_run = measured[recipe.drafter]
    report = {
        "target": recipe.target.path,
        "drafter": recipe.drafter,
        "drafter_kind": main_run["drafter_kind"],
        "mode": dec.mode,
        "tree_budget": dec.tree_budgets[0] if dec.mode == "tree" else None,
        "max_new_tokens": dec.max_new_tokens,
        "limit": recipe.limit,
        "chat_template_kwargs": recipe.target.chat_template_kwargs,
        "conditions": conds,
        "warnings": main_run["warnings"],
        "sets": main_run["sets"],
        "compared": {
            folder: {k: run[k] for k in ("drafter_kind", "warnings", "sets")}
            for folder, run in measured.items()
            if folder != recipe.drafter
        },
        "torch_threads": torch.get_num_threads(),
        "device": device,
        **main_run["backend"],
    }
    write_json_atomic(out / "report.json", report)
    write_jsonl_atomic(out / "per_prompt.jsonl", [row for run in measured.values() for row in run["per_prompt"]])
    plot_bench(report, out / "bench.png")
    print_table(report)
    print(f"wrote {out / 'report.json'}, {out / 'per_prompt.jsonl'} and {out / 'bench.png'}")
    return report


def bench_drafter(recipe: BenchRecipe, target, tokenizer, drafter, folder: str, backend, sets, conds) -> dict:
    """One drafter over every condition and set: its per-set results, warnings, per-prompt rows and
    what the backend records."""
    dec, device = recipe.decoding, next(target.parameters()).device
    eos = tokenizer.eos_token_id
    longest = longest_prompt(sets, tokenizer, [template_kwargs(recipe, c) for c in conds], dec.max_new_tokens)
    sizing = [torch.zeros(longest, dtype=torch.long, device=device)]
    records = backend.prepare(target, drafter, sizing, dec.max_new_tokens, max(recipe.temperatures) > 0, ())
    first = sets[0].questions[0]
    asked = {"messages": [*first.context, {"role": "user", "content": first.turns[0]}]}
    prompt = torch.tensor(prompt_token_ids(asked, tokenizer, template_kwargs(recipe, conds[0])), device=device)
    warm_up(target, drafter, prompt, eos, dec, backend)
    kind = drafter.config.model_type.removeprefix("draftsmith_")
    results: dict[str, list[dict]] = {s.name: [] for s in sets}
    per_prompt: list[dict] = []
    warnings: list[str] = []
    for condition in conds:
        kwargs = template_kwargs(recipe, condition)
        warnings += [w for w in template_warnings(folder, kwargs) if w not in warnings]
        at = dec.model_copy(update={"temperature": condition["temperature"]})
        for prompt_set in sets:
            rows = run_set(target, drafter, tokenizer, prompt_set, at, kwargs, eos, backend, recipe.seed)
            results[prompt_set.name].append(set_result(rows, condition))
            per_prompt += [{"drafter": folder, **condition, **row} for row in rows]
            print(f"  {kind:<8} {table_row(prompt_set.name, results[prompt_set.name][-1])}", flush=True)
    sets_report = {
        s.name: {
            "source": s.source,
            "questions": len(s.questions),
            **{k: v for k, v in results[s.name][0].items() if k not in ("categories", "by_turn")},
            "conditions": results[s.name],
        }
        for s in sets
    }
    return {
        "drafter_kind": kind,
        "warnings": warnings,
        "sets": sets_report,
        "per_prompt": per_prompt,
        "backend": records,
    }


def condition_label(result: dict) -> str:
    thinking = {None: "", True: ", thinking", False: ", no thinking"}[result["thinking"]]
    return f"T={result['temperature']:g}{thinking}"


def table_row(name: str, result: dict) -> str:
    lossless = {True: "yes", False: "NO", None: "sampled"}[result["lossless"]]
    return (
        f"{name:<22} {condition_label(result):<22} {result['prompts']:>7} {result['tau']:>6.2f} "
        f"{result['speedup']:>7.2f}x {lossless:>8}"
    )


def runs(report: dict) -> dict[str, dict]:
    """Each drafter's part of a report (the main drafter first), by folder."""
    return {report["drafter"]: report, **report["compared"]}


def print_table(report: dict) -> None:
    print(
        f"\n== bench ({report['drafter_kind']}, {report['mode']}, {report['max_new_tokens']} new tokens, "
        f"{report['torch_threads']} thread(s), {report['device']}) =="
    )
    for folder, run in runs(report).items():
        if report["compared"]:
            print(f"  -- {run['drafter_kind']}: {folder}")
        print(f"  {'set':<22} {'condition':<22} {'prompts':>7} {'tau':>6} {'speedup':>8} {'lossless':>8}")
        for name, entry in run["sets"].items():
            for result in entry["conditions"]:
                print(f"  {table_row(name, result)}")
                for category, part in result["categories"].items():
                    print(f"  {table_row('  ' + category, {**result, **part})}")
                for turn, part in result["by_turn"].items():
                    print(f"  {table_row('  turn ' + turn, {**result, **part})}")
        for warning in run["warnings"]:
            print(f"  warning: {warning}")


def plot_bench(report: dict, path: Path) -> None:
    """Speedup per set (and category), one bar per drafter and condition, tau written on each bar."""
    several = bool(report["compared"])
    groups = []  # (label, [result per drafter and condition])
    for name, entry in report["sets"].items():
        results = [r for run in runs(report).values() for r in run["sets"][name]["conditions"]]
        groups.append((name, results))
        for category in entry["conditions"][0]["categories"]:
            groups.append((f"{name}/{category}", [r["categories"][category] for r in results]))
    labels = [
        (f"{run['drafter_kind']} {Path(folder).name}, " if several else "") + condition_label(r)
        for folder, run in runs(report).items()
        for r in next(iter(run["sets"].values()))["conditions"]
    ]
    width = 0.8 / len(labels)
    with saved_figure(path, figsize=(max(6.0, 0.6 * len(groups) * len(labels) ** 0.5 + 2), 3.6)) as (fig, ax):
        for c, label in enumerate(labels):
            xs = [g + (c - (len(labels) - 1) / 2) * width for g in range(len(groups))]
            bars = ax.bar(xs, [results[c]["speedup"] for _, results in groups], width, label=label)
            for bar, (_, results) in zip(bars, groups):
                ax.annotate(
                    f"{results[c]['tau']:.1f}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(groups)), [g for g, _ in groups], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title(
            f"{'drafters' if several else report['drafter_kind']} {report['mode']} (tau on the bars)", fontsize=9
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
