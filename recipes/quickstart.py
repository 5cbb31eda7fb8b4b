"""Recipe ``quickstart``: the main job on the testbed, end to end on a CPU.

Stage 1, target: the shipped testbed target (``distill/assets/testbed_target``, trained once by
``recipes/configs/testbed_target.yaml``) or, with ``target.source=train``, a target trained now by
``target.train_recipe``. Either way it is evaluated here on the held-out split of the corpus it was
trained on (same tokenizer, same split, same window length as its training recipe recorded).

Stage 2, shipped drafter (shipped target only): the DFlash drafter trained once for the shipped
target by ``recipes/configs/dflash_testbed.yaml`` and shipped beside it (``distill/assets/testbed_dflash``),
measured now in the decoding loop against plain decoding: as a chain, and as a tree at the budget
that was fastest when it was shipped, each step verifying what measured costs say pays
(:mod:`serve_eval.budget`); and as a chain verifying every draft, beside the simulated tau.

Stage 3, drafter: ``drafter.recipe`` (DFlash by default) trained now against that target, on a short
budget, to show the pipeline (the target's answers regenerated in-process, then distillation); its
best checkpoint's simulated acceptance length is reported.

Stage 4, eval: that drafter in the speculative-decoding loop against plain greedy decoding on
held-out prompts (``eval.recipe``): measured tau, speedup and losslessness.

Stage 5, export: that drafter written for serving engines (``export.recipe``: draftsmith's
``transformers`` folder, the vLLM ``speculators`` folder, the SGLang folder for EAGLE-3, a model card),
reloaded and checked by the parity gate before it is published (:mod:`recipes.export`).

Writes ``<output_dir>/summary.json`` (sections ``target``, ``shipped_drafter``, ``drafter``, ``eval``, ``export``) and prints a
short table.

    make quickstart
    draftsmith run recipes/configs/quickstart.yaml target.source=train
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from distill.base.lm import evaluate_lm
from distill.config import DataConfig, QuickstartRecipe, TargetConfig
from distill.data import load_text_splits, make_windows
from distill.models import load_target, model_summary, resolve_target_path
from distill.provenance import write_json_atomic, write_run_header
from distill.runtime import set_threads
from distill.testbed import SHIPPED_DRAFTERS
from recipes.registry import load_recipe


def _training_record(target_dir: Path) -> tuple[dict, DataConfig]:
    """The target's training summary and data section, as its training run recorded them."""
    summary_file = next(
        (f for f in (target_dir / "training_summary.json", target_dir.parent / "summary.json") if f.exists()), None
    )
    recipe_file = next((f for f in (target_dir / "recipe.yaml", target_dir.parent / "recipe.yaml") if f.exists()), None)
    if summary_file is None or recipe_file is None:
        raise FileNotFoundError(f"{target_dir} has no training record (recipe.yaml and training_summary.json)")
    recipe = yaml.safe_load(recipe_file.read_text())
    return json.loads(summary_file.read_text()), DataConfig(**recipe["data"])


def stage_target(recipe: QuickstartRecipe, out: Path, dry_run: bool) -> tuple[Path, bool]:
    if recipe.target.source == "shipped":
        return Path(resolve_target_path("testbed")), False
    from recipes import train_lm

    train_recipe = load_recipe(recipe.target.train_recipe, [f"output_dir={out / 'target'}"])
    train_lm.main(train_recipe, dry_run=dry_run)
    return out / "target" / "model", True


SCHEMA = QuickstartRecipe


def main(recipe: QuickstartRecipe, dry_run: bool = False) -> dict:
    set_threads(recipe.torch_threads)
    out = Path(recipe.output_dir)

    ### Target: shipped or trained now
    target_dir, trained_now = stage_target(recipe, out, dry_run)
    if dry_run:
        if not trained_now:
            model, _ = load_target(TargetConfig(path=str(target_dir)))
            return {"target": {"checkpoint": str(target_dir), "model": model_summary(model)}}
        return {"target": {"source": "train", "recipe": recipe.target.train_recipe}}
    write_run_header(out, recipe)
    record, data_cfg = _training_record(target_dir)

    ### Evaluate it on its own held-out split
    t0 = time.perf_counter()
    model, tokenizer = load_target(TargetConfig(path=str(target_dir)))
    splits = load_text_splits(data_cfg)
    val = make_windows(splits.val, tokenizer, data_cfg, "val")
    metrics = evaluate_lm(model, val, 8, recipe.target.eval_batches)
    target = {
        "checkpoint": str(target_dir),
        "source": "trained in this run"
        if trained_now
        else "shipped (trained once by recipes/configs/testbed_target.yaml)",
        "parameters": model_summary(model)["parameters"],
        "val_loss": round(metrics["val_loss"], 4),
        "val_ppl": round(metrics["val_ppl"], 3),
        "val_acc": round(metrics["val_acc"], 4),
        "val_tokens": metrics["val_tokens"],
        "eval_seconds": round(time.perf_counter() - t0, 1),
        # from the run that trained these weights (this run, or the shipped provenance)
        "train_seconds": record["train_seconds"],
        "tokens_per_s": record["tokens_per_s"],
        "mfu": record["mfu"],
        "train_tokens_seen": record.get("train_tokens_seen"),
    }

    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary["target"] = target
    write_json_atomic(summary_path, summary)
    print_table("target", target)

    ### The drafter shipped for the testbed target, in the decoding loop (chain and tree)
    if recipe.shipped_drafter.enabled and not trained_now:
        summary["shipped_drafter"] = stage_shipped_drafter(recipe, out, target_dir)
        write_json_atomic(summary_path, summary)
        print_table("shipped drafter", {k: v for k, v in summary["shipped_drafter"].items() if not isinstance(v, dict)})

    ### Drafter, distilled from that target
    if recipe.drafter.enabled:
        summary["drafter"] = stage_drafter(recipe, out, target_dir)
        write_json_atomic(summary_path, summary)
        print_table("drafter", summary["drafter"])

    ### The drafter in the decoding loop, against plain decoding
    if recipe.drafter.enabled and recipe.eval.enabled:
        from recipes import evaluate

        overrides = [
            f"output_dir={out / 'eval'}",
            f"drafter={summary['drafter']['checkpoint']}",
            f"target.path={target_dir}",
            *recipe.eval.overrides,
        ]
        report = evaluate.main(load_recipe(recipe.eval.recipe, overrides))
        summary["eval"] = {k: v for k, v in report.items() if k != "per_prompt"}
        summary["eval"]["report"] = str(out / "eval" / "report.json")
        write_json_atomic(summary_path, summary)

    ### The drafter exported for serving engines, behind the parity gate
    if recipe.drafter.enabled and recipe.export.enabled:
        summary["export"] = stage_export(recipe, out, target_dir, summary)
        write_json_atomic(summary_path, summary)
        if summary["export"].get("refused"):
            raise RuntimeError(f"the quickstart's drafter failed the parity gate; see {summary_path} (export section)")
        print_table("export", {k: v for k, v in summary["export"].items() if k != "formats"})
    print(f"wrote {summary_path}")
    return summary


def stage_shipped_drafter(recipe: QuickstartRecipe, out: Path, target_dir: Path) -> dict:
    """The shipped drafter measured now: as a chain and as a tree (at its best shipped budget), each with
    per-step budgets (``decoding.budget.adaptive``), as a chain verifying every draft, to set beside the
    simulated tau recorded when it was trained, and as the chain and the tree with prompt-lookup drafts
    grafted on."""
    from recipes import evaluate

    stage = recipe.shipped_drafter
    folder = SHIPPED_DRAFTERS[stage.kind]
    if not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"no shipped {stage.kind} drafter at {folder}; train and ship it (see its recipe header) "
            f"or set shipped_drafter.enabled=false"
        )
    shipped = json.loads((folder / "results.json").read_text()) if (folder / "results.json").exists() else {}
    budget = stage.tree_budget or best_tree_budget(shipped)
    evaluation = json.loads((folder / "evaluation.json").read_text())  # on its held-out answers, at shipping
    section = {
        "checkpoint": str(folder),
        "kind": stage.kind,
        "simulated_tau": round(evaluation["val_simulated_tau"], 4),
        "block_tau": round(evaluation["val_block_tau"], 4),
        "tree_budget": budget,
    }
    # chain and tree with per-step budgets (the default); the chain once more verifying every draft, the
    # decoding the simulated tau replays, so the two compare
    tree = ["decoding.mode=tree", f"decoding.tree_budgets=[{budget}]"]
    runs = [("chain", []), ("tree", tree), ("chain_full_draft", ["decoding.budget.adaptive=false"])]
    if stage.lookup:  # the chain and the tree again, with prompt-lookup continuations grafted on (serve_eval.lookup)
        lookup = f"decoding.lookup.tokens={stage.lookup}"
        runs += [("chain_lookup", [lookup]), ("tree_lookup", [*tree, lookup])]
    for mode, extra in runs:
        overrides = [
            f"output_dir={out / 'shipped_drafter' / mode}",
            f"drafter={folder}",
            f"target.path={target_dir}",
            *extra,
            *stage.overrides,
        ]
        report = evaluate.main(load_recipe(stage.recipe, overrides))
        section[mode] = {
            k: report[k]
            for k in (
                "tau",
                "speedup",
                "tokens_per_s",
                "baseline_tokens_per_s",
                "lossless",
                "acceptance_by_position",
                "time_split",
                "prompts",
                "max_new_tokens",
                "torch_threads",
            )
        }
        section[f"{mode}_tau"], section[f"{mode}_speedup"] = report["tau"], report["speedup"]
    section["simulated_minus_measured_tau"] = round(section["simulated_tau"] - section["chain_full_draft_tau"], 4)
    return section


def best_tree_budget(results: dict, default: int = 16) -> int:
    """The tree budget whose measured speedup was best when the drafter was shipped (greedy, held-out
    prompts: the ``tree_t0`` report of its ``results.json``)."""
    report = results.get("tree_t0", {})
    rows = report.get("by_budget") or ([report] if report.get("tree_budget") else [])
    return max(rows, key=lambda r: r["speedup"])["tree_budget"] if rows else default


def stage_drafter(recipe: QuickstartRecipe, out: Path, target_dir: Path) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from recipes import train_drafter

    overrides = [f"output_dir={out / 'drafter'}", f"target.path={target_dir}", *recipe.drafter.overrides]
    AcceleratorState._reset_state(True)  # the target stage may have made an Accelerator in this process
    GradientState._reset_state()
    result = train_drafter.main(load_recipe(recipe.drafter.recipe, overrides))
    return {
        "checkpoint": result["best_checkpoint"],
        "kind": result["kind"],
        "simulated_tau": round(result["best_simulated_tau"], 4),
        "tau_probabilistic": round(result["val_tau_probabilistic"], 4),
        "acceptance_by_position": [round(result[f"val_acc_{k}"], 4) for k in range(1, result["block_size"])],
        "train_seconds": result["train_seconds"],
        "tokens_per_s": result["tokens_per_s"],
        "steps": result["steps"],
    }


def stage_export(recipe: QuickstartRecipe, out: Path, target_dir: Path, summary: dict) -> dict:
    from recipes import export

    overrides = [
        f"output_dir={out / 'export'}",
        f"drafter={summary['drafter']['checkpoint']}",
        f"target.path={target_dir}",
    ]
    if "eval" in summary:
        overrides.append(f"eval_reports=[{summary['eval']['report']}]")
    try:
        manifest = export.export_drafter(load_recipe(recipe.export.recipe, overrides + list(recipe.export.overrides)))
    except export.ExportRefused as e:
        gate = e.gate or {}
        return {
            "refused": True,
            "folder": None,
            "gate": {
                k: gate.get(k) for k in ("passed", "failed", "measured_tau", "simulated_tau", "logits_max_abs_diff")
            },
        }
    gate = manifest["gate"]
    return {
        "folder": str(out / "export"),
        "formats": {
            fmt: str(out / "export" / rec["folder"]) if rec["folder"] else f"not exported: {rec['not_exported']}"
            for fmt, rec in manifest["formats"].items()
        },
        "gate_passed": gate["passed"],
        "gate": {
            "passed": gate["passed"],
            "failed": gate["failed"],
            "measured_tau": gate["measured_tau"],
            "simulated_tau": gate["simulated_tau"],
            "logits_max_abs_diff": gate["logits_max_abs_diff"],
            "speedup": gate["checks"]["acceptance"].get("speedup"),
            "lossless": gate["checks"]["acceptance"]["lossless"],
        },
        "model_card": str(out / "export" / "README.md"),
        "seconds": manifest["seconds"],
    }


def print_table(title: str, section: dict) -> None:
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in section.items()]
    width = max(len(k) for k, _ in rows)
    print(f"\n== {title} ==")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
