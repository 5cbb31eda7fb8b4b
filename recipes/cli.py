"""``draftsmith``: the command line.

    draftsmith run RECIPE.yaml [section.key=value ...] [--dry-run]
    draftsmith validate RECIPE.yaml [section.key=value ...]
    draftsmith eval --drafter DIR [--target testbed] [--prompts FILE] [--max-new-tokens N]
                    [--draft-length N --draft-recurrence T]   # a student / Parcae drafter
    draftsmith export --drafter DIR --output-dir OUT [--formats ...] [--push-to-hub OWNER/NAME]

``run`` validates the recipe (exit status 2 and nothing written on any error), then calls the entry
point named by its ``recipe:`` key. ``--dry-run`` validates and builds the recipe's models without
training. The same command runs under ``accelerate launch ... -m recipes.cli run RECIPE.yaml``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ENTRY_POINTS = {"train_lm": "recipes.train_lm", "quickstart": "recipes.quickstart", "train_drafter": "recipes.train_drafter",
                "regenerate": "recipes.regenerate", "eval": "recipes.evaluate", "quantize": "recipes.quantize",
                "export": "recipes.export", "distill_student": "recipes.distill_student"}


def run_recipe(recipe, dry_run: bool = False) -> dict:
    module = importlib.import_module(ENTRY_POINTS[recipe.recipe])
    return module.main(recipe, dry_run=dry_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("run", "run a recipe"), ("validate", "validate a recipe and print it resolved")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("recipe", help="path to a recipe YAML")
        p.add_argument("overrides", nargs="*", help="section.key=value overrides")
        if name == "run":
            p.add_argument("--dry-run", action="store_true", help="validate and build models, do not train")
    ev = sub.add_parser("eval", help="speculative vs plain decoding of a target with a drafter (writes report.json)")
    ev.add_argument("--drafter", required=True, help="drafter folder")
    ev.add_argument("--target", default="testbed", help="'testbed', a local folder or a hub id")
    ev.add_argument("--prompts", help="JSONL file, one {\"prompt\": ...} per line (default: held-out corpus snippets)")
    ev.add_argument("--prompts-from-corpus", type=int, default=16, help="held-out snippets when --prompts is not given")
    ev.add_argument("--max-new-tokens", type=int, default=128)
    ev.add_argument("--temperature", type=float, default=0.0)
    ev.add_argument("--mode", default="chain", choices=["chain", "tree"])
    ev.add_argument("--tree-budgets", type=int, nargs="+", default=[16], help="tree nodes per step (tree mode)")
    ev.add_argument("--top-k", type=int, default=0)
    ev.add_argument("--top-p", type=float, default=1.0)
    ev.add_argument("--draft-length", type=int, default=7, help="tokens per draft for a causal-LM drafter (student, Parcae)")
    ev.add_argument("--draft-recurrence", type=int, help="Parcae drafter: recurrences while drafting")
    ev.add_argument("--fixed-budget", action="store_true",
                    help="verify every draft (the whole tree) each step, not what measured costs say pays")
    ev.add_argument("--threads", type=int, default=1)
    ev.add_argument("--output-dir", default="runs/eval")
    ex = sub.add_parser("export", help="export a drafter (transformers, vLLM speculators, SGLang EAGLE-3) behind the parity gate")
    ex.add_argument("--drafter", required=True, help="trained drafter folder")
    ex.add_argument("--target", default="testbed", help="'testbed', a local folder or a hub id")
    ex.add_argument("--output-dir", required=True)
    ex.add_argument("--formats", nargs="+", choices=["transformers", "speculators", "sglang_eagle3"],
                    help="default: every format that can express the drafter")
    ex.add_argument("--verifier", help="verifier name recorded for serving (default: the drafter's target)")
    ex.add_argument("--prompts-from-corpus", type=int, default=8, help="held-out snippets the gate decodes")
    ex.add_argument("--max-new-tokens", type=int, default=64)
    ex.add_argument("--eval-report", action="append", default=[], help="an eval report.json to cite in the model card")
    ex.add_argument("--allow-failed-gate", action="store_true", help="publish even if the parity gate fails (loudly)")
    ex.add_argument("--push-to-hub", metavar="REPO_ID", help="upload to this hub repository (owner/name)")
    ex.add_argument("--public", action="store_true", help="with --push-to-hub: a public repository")
    ex.add_argument("--revision", help="with --push-to-hub: the branch to commit to")
    args = parser.parse_args(argv)

    from distill.config import RecipeError, load_recipe, parse_recipe

    try:
        if args.command == "eval":
            prompts = {"file": args.prompts} if args.prompts else {"from_corpus": args.prompts_from_corpus, "split": "val"}
            recipe = parse_recipe({"recipe": "eval", "output_dir": args.output_dir, "target": {"path": args.target},
                                   "drafter": args.drafter, "prompts": prompts,
                                   "decoding": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                                                "top_k": args.top_k, "top_p": args.top_p, "mode": args.mode,
                                                "tree_budgets": args.tree_budgets, "torch_threads": args.threads,
                                                "draft_length": args.draft_length, "draft_recurrence": args.draft_recurrence,
                                                "adaptive": not args.fixed_budget}},
                                  source="draftsmith eval")
            run_recipe(recipe)
            return 0
        if args.command == "export":
            push = {"enabled": bool(args.push_to_hub), "repo_id": args.push_to_hub, "private": not args.public,
                    "revision": args.revision}
            recipe = parse_recipe({"recipe": "export", "output_dir": args.output_dir, "drafter": args.drafter,
                                   "target": {"path": args.target}, "formats": args.formats, "verifier_name_or_path": args.verifier,
                                   "prompts": {"from_corpus": args.prompts_from_corpus, "split": "val"},
                                   "gate": {"allow_failure": args.allow_failed_gate, "max_new_tokens": args.max_new_tokens},
                                   "eval_reports": args.eval_report, "push_to_hub": push}, source="draftsmith export")
            return _run_export(recipe)
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "validate":
        print(json.dumps(recipe.model_dump(mode="json"), indent=2))
        return 0
    if recipe.recipe == "export" and not args.dry_run:
        return _run_export(recipe)
    try:
        result = run_recipe(recipe, dry_run=args.dry_run)
    except RecipeError as e:  # found once the models are built (a layer-map pattern that matches nothing, ...)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(result, indent=2, default=str))
    return 0


def _run_export(recipe) -> int:
    """An export whose parity gate fails (without an override) exits with status 3."""
    from recipes.export import ExportRefused

    try:
        run_recipe(recipe)
    except ExportRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
