"""The loop's efficiency against the target's size: the same target function, its weights made larger.

    python -m recipes.bench_scale [--recipe recipes/configs/eval_testbed.yaml] [--factors 1 2 4 8] [--output runs/bench_scale] [KEY=VALUE ...]

A speculative step costs ``t_verify(n) + t_draft + bookkeeping`` against a plain step's ``t_verify(1)``,
so ``speedup / tau`` (the efficiency ratio) reads how those costs compare, and whether they
compare differently on a larger target is a question about the hardware's limits, not the drafter.
To ask it without training anything, each factor ``f`` pads every layer's MLP of the recipe's target
with ``(f - 1) x intermediate_size`` channels whose ``gate`` / ``up`` rows and ``down`` columns are
zero: ``silu(0) * 0 = 0``, so each padded channel adds exactly ``+0`` to every sum and the padded
target computes the original's function (checked per factor: its logits against the original's on the
recipe's first prompts, bit for bit, the models' own forward in fp32). The drafter reads the same
features and proposes the same drafts; only what a step costs grows (the MLP, ~60% of the testbed's
matmul weights, ``f`` times the bytes and FLOPs). The padded copies are written once under
``OUTPUT/targets`` (write, then rename) and reused while their source and factor are the same. Any
causal LM whose config names its MLP width (``intermediate_size``) pads; the logits check says whether
the copy kept the function.

Per factor the recipe's eval runs with ``target.path`` at the copy (1 thread, plain decoding measured
back to back): speedup, tau, their ratio, tokens/s, the verify cost table ``t(n) / t(1)`` and the
draft's cost in plain steps, and with ``decoding.batches.sizes`` each batch size's speedup over batched plain
decoding. Writes ``scale.json`` and ``scale.png``. A benchmark: run it on an
otherwise idle core (``taskset -c 1``); each factor is one eval (~30-60 s on the testbed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch


def pad_mlp(source: str | os.PathLike, folder: str | os.PathLike, factor: int) -> Path:
    """A copy of the causal LM at ``source`` in ``folder`` whose MLPs have ``factor`` times the channels,
    the new ones zero (the same function; see the module docstring), saved in the source's dtype with the
    source's tokenizer and generation config and a note of what it was padded from (a copy of the same
    source and factor is reused). Written under a temporary name, then renamed."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from distill.testbed import atomic_dir

    folder, made = Path(folder), {"source": str(Path(source).resolve()), "factor": factor}
    marker = folder / "padded_from.json"
    if marker.exists() and json.loads(marker.read_text()) == made:
        return folder
    config = AutoConfig.from_pretrained(source)
    if not isinstance(getattr(config, "intermediate_size", None), int):
        raise ValueError(f"{source}: a config without an MLP width (intermediate_size) to pad")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=config.dtype)
    config.intermediate_size *= factor
    padded = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    weights = model.state_dict()
    state = {}
    for name, like in padded.state_dict().items():
        old = weights[name]
        if old.shape != like.shape:  # gate / up: more rows; down: more columns; all of them zero
            grown = torch.zeros_like(like)
            grown[tuple(slice(0, size) for size in old.shape)] = old
            old = grown
        state[name] = old
    padded.load_state_dict(state)
    shutil.rmtree(folder, ignore_errors=True)  # a copy of another source or factor
    with atomic_dir(folder) as tmp:
        padded.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
        if (Path(source) / "generation_config.json").exists():  # (the source's provenance stays with the source)
            shutil.copy(Path(source) / "generation_config.json", tmp / "generation_config.json")
        (tmp / marker.name).write_text(json.dumps(made))
    return folder


@torch.inference_mode()
def logits_of(folder: str | os.PathLike, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The model at ``folder``'s logits over each of ``prompts`` (its own forward, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [model(input_ids=p[None]).logits for p in prompts]


def row_of(factor: int, report: dict, same: bool, checkpoint_bytes: int) -> dict:
    """What one factor's eval says about the step's costs (``plain_step_ms``: the cost table's one-token step)."""
    adaptive = report.get("adaptive") or {}
    verify = {int(n): ms for n, ms in adaptive.get("verify_ms", {}).items()}
    one = verify.get(1)
    return {
        "factor": factor,
        "checkpoint_mb": round(checkpoint_bytes / 2**20, 2),
        "same_logits": same,
        "lossless": report["lossless"],
        "tau": report["tau"],
        "speedup": report["speedup"],
        "speedup_over_tau": round(report["speedup"] / report["tau"], 4),
        "tokens_per_s": report["tokens_per_s"],
        "baseline_tokens_per_s": report["baseline_tokens_per_s"],
        "plain_step_ms": one,
        "verify_over_plain": {n: round(ms / one, 3) for n, ms in sorted(verify.items())} if one else {},
        "draft_over_plain": round(adaptive["draft_ms"] / one, 3) if one and adaptive.get("draft_ms") else None,
        "mean_verified": adaptive.get("mean_verified"),
        "batches": {row["batch"]: row["speedup"] for row in report.get("by_batch") or []},
    }  # with decoding.batches.sizes


def plot(rows: list[dict], path: Path) -> None:
    from recipes.plots import saved_figure

    with saved_figure(path, figsize=(9, 3.6)) as (fig, ax):
        ax.remove()
        left, right = fig.subplots(1, 2)
        mb = [r["checkpoint_mb"] for r in rows]
        left.plot(mb, [r["speedup_over_tau"] for r in rows], marker="o", label="speedup / tau")
        left.plot(mb, [r["draft_over_plain"] for r in rows], marker="s", label="drafting, in plain steps")
        left.axhline(0.7, color="gray", lw=0.8, ls="--")
        left.axhline(0.15, color="gray", lw=0.8, ls=":")
        left.set_xscale("log")
        left.set_xticks(mb, [f"{m:g}" for m in mb])
        left.minorticks_off()
        left.set_xlabel("the target's checkpoint (MB)")
        left.set_title("the same function, larger weights")
        left.legend(fontsize=8)
        for r in rows:
            curve = r["verify_over_plain"]
            right.plot(list(curve), list(curve.values()), marker=".", label=f"{r['checkpoint_mb']:g} MB")
        right.set_xlabel("tokens verified")
        right.set_ylabel("cost, in plain steps")
        right.set_title("the verify's cost table")
        right.legend(fontsize=8)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/configs/eval_testbed.yaml", help="an eval recipe")
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8], help="the MLP's channels, times")
    parser.add_argument("--output", default="runs/bench_scale")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of the recipe")
    args = parser.parse_args(argv)
    if min(args.factors) < 1:
        parser.error("--factors take positive whole numbers")

    from distill.config import RecipeError
    from distill.models import load_target, resolve_target_path
    from distill.provenance import write_json_atomic
    from distill.regenerate import encoded_prompts
    from recipes import evaluate
    from recipes.registry import load_recipe

    output = Path(args.output)
    try:
        base = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        parser.exit(2, f"error: {e}\n")
    if base.recipe != "eval":
        parser.exit(2, f"error: --recipe {args.recipe} is a {base.recipe!r} recipe; bench_scale runs an eval recipe\n")
    if not base.decoding.budget.adaptive:
        parser.exit(
            2,
            "error: decoding.budget.adaptive = false: bench_scale reads the eval's verify cost table, which the budgets measure\n",
        )
    source = resolve_target_path(base.target.path)
    _, tokenizer = load_target(base.target, "cpu", weights=False)
    prompts = encoded_prompts(base.prompts, base.data, base.seed, tokenizer, "cpu")[:2]
    reference = logits_of(source, prompts)  # each copy's, bit for bit, or it is not the same function
    rows = []
    for factor in sorted(set(args.factors)):
        try:
            path = source if factor == 1 else str(pad_mlp(source, output / "targets" / f"x{factor}", factor))
        except ValueError as e:
            parser.exit(2, f"error: target.path: {e}\n")
        same = factor == 1 or all(map(torch.equal, logits_of(path, prompts), reference))
        recipe = load_recipe(
            args.recipe, [*args.overrides, f"target.path={path}", f"output_dir={output / f'x{factor}'}"]
        )
        row = row_of(
            factor, evaluate.main(recipe), same, sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
        )
        rows.append(row)
        print(
            f"x{factor}: a {row['checkpoint_mb']:g} MB checkpoint, same logits {same}: speedup {row['speedup']:.3f} at tau "
            f"{row['tau']:.3f} = {row['speedup_over_tau']:.3f}; plain {row['plain_step_ms']} ms a step, drafting "
            f"{row['draft_over_plain']} plain steps; verify {row['verify_over_plain']}"
            + "".join(f"; batch {b} {x:.3f}x batched plain" for b, x in row["batches"].items()),
            flush=True,
        )
    write_json_atomic(output / "scale.json", rows)
    plot(rows, output / "scale.png")
    return rows


if __name__ == "__main__":
    main()
