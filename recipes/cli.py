"""``draftsmith``: the command line.

    draftsmith ls                                         the shipped recipes, one line each
    draftsmith run RECIPE [section.key=value ...] [--dry-run]
    draftsmith validate RECIPE [section.key=value ...]
    draftsmith eval --drafter DIR [--target testbed] [--mode chain|tree] [--kv-format int8] ... [section.key=value ...]
    draftsmith export --drafter DIR --output-dir OUT [--formats ...] [--push-to-hub OWNER/NAME]
    draftsmith bench --drafter DIR [--sets humaneval,mtbench] [--limit N] [--target T] [--output-dir OUT]
    draftsmith data show FILE --target T [--format messages] [--schema sharegpt] [--index I] [--json]

RECIPE is a YAML path or the name of a shipped recipe (``draftsmith run dflash_testbed`` from any
directory; ``draftsmith ls`` lists them). ``run`` validates the recipe (exit status 2 and nothing
written on any error), then calls the entry point its ``recipe:`` key names (:mod:`recipes.registry`).
``--dry-run`` validates and builds the recipe's models on the meta device without training, and a
training recipe prints its memory per GPU (:mod:`recipes.dry_run`) for ``--num-processes`` GPUs at
``--zero-stage`` (default 8, ZeRO-2); a hub target the hub cache lacks is built from its shipped config
(``recipes/configs/targets/``), so real-target recipes dry-run offline. The same command runs under
``accelerate launch ... -m recipes.cli run RECIPE``.

``eval`` builds an eval recipe from its flags and validates it as ``run`` does. Its flags come from the
schema (:func:`eval_flags`, :mod:`distill.config.flags`): one per leaf of ``decoding`` named by its key
below ``decoding.`` (``decoding.kv.format`` -> ``--kv-format``, ``decoding.budget.adaptive`` ->
``--budget-adaptive`` / ``--no-budget-adaptive``) and one per top-level option (``--output-dir``,
``--record-served``), each with the schema's description, type, choices and default; ``--target``,
``--prompts`` and ``--prompts-from-corpus`` fill ``target.path`` and ``prompts``. Trailing
``section.key=value`` overrides apply last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys

EXAMPLES = {
    "ls": """examples:
  draftsmith ls
  draftsmith ls --recipes          # the recipe kinds (the `recipe:` key) and their schemas""",
    "run": """examples:
  draftsmith run quickstart                                   # the main job on the testbed
  draftsmith run dflash_testbed train.max_steps=200          # a shipped recipe by name, with an override
  draftsmith run recipes/configs/eval_testbed.yaml drafter=distill/assets/testbed_dflash decoding.mode=tree
  draftsmith run dflash_qwen3_8b --dry-run                   # validate, build on the meta device, estimate memory
  draftsmith run dflash_qwen3_30b_a3b --dry-run --num-processes 4 --zero-stage 3   # ... for another launch
  accelerate launch --config_file accelerate_configs/zero3.yaml -m recipes.cli run dflash_qwen3_8b""",
    "validate": """examples:
  draftsmith validate dspark_testbed
  draftsmith validate my_recipe.yaml optim.lr=1e-3 'decoding.tree_budgets=[8, 16]'""",
    "eval": """examples:
  draftsmith eval --drafter distill/assets/testbed_dflash
  draftsmith eval --drafter distill/assets/testbed_dflash --mode tree --tree-budgets 8 16 32
  draftsmith eval --drafter distill/assets/testbed_dspark --temperature 1.0
  draftsmith eval --drafter distill/assets/testbed_dflash --lookup-tokens 10   # prompt-lookup copies grafted onto each draft
  draftsmith eval --drafter distill/assets/testbed_dflash --lookup-tokens 7 --batches-sizes 4   # and batches of 4 rows
  draftsmith eval --drafter distill/assets/testbed_eagle3 --vocab-size 1024      # a reduced draft vocabulary
  draftsmith eval --drafter distill/assets/testbed_dflash --vocab-size 768 --vocab-candidates 64 --temperature 1
                                                                                  # ... chosen per step
  draftsmith eval --drafter distill/assets/testbed_dflash --kv-format int4 --kv-rotate   # a quantized target KV cache
  draftsmith eval --drafter distill/assets/testbed_dflash --cpu-int8 off         # the drafter in fp32 (CPU default: int8)
  draftsmith eval --drafter distill/assets/testbed_dflash --backend torch        # plain torch modules, no CPU kernels
  draftsmith eval --drafter distill/assets/testbed_dflash decoding.kv.format=int8   # any recipe key, as with run
  draftsmith eval --drafter runs/student/model --drafter-draft-length 4         # a causal-LM drafter
  draftsmith eval --drafter runs/pard_testbed/model                             # a PARD drafter: its block in one forward
  draftsmith eval --drafter runs/pard_testbed/model --no-drafter-parallel-drafts --ssd-enabled --no-budget-adaptive
                                                                                  # speculative speculative decoding""",
    "export": """examples:
  draftsmith export --drafter distill/assets/testbed_dflash --output-dir runs/export
  draftsmith export --drafter DIR --output-dir OUT --formats speculators --push-to-hub me/my-drafter
  draftsmith export --drafter distill/assets/testbed_eagle3 --output-dir runs/export_dv --draft-vocab 1024 \\
      --prompts-from-corpus 16 --max-new-tokens 128""",
    "bench": """examples:
  draftsmith bench --drafter distill/assets/testbed_dflash --sets humaneval          # all 164 problems, T = 0 and 1
  draftsmith bench --drafter distill/assets/testbed_dflash --sets humaneval,mtbench --limit 20 --temperatures 0
  draftsmith bench --drafter runs/mine/model --drafter published_speculators_drafter --sets humaneval --limit 40
                                        # a drafter trained here beside a published one, one report
  draftsmith bench --drafter DIR --target Qwen/Qwen3-8B --sets mtbench,mine=my_prompts.jsonl decoding.mode=tree
                                        # thinking on and off: Qwen3's template reads enable_thinking""",
    "data": """examples:
  draftsmith data show chat.jsonl --target Qwen/Qwen3-8B --index 3       # one conversation, each token's mask bit
  draftsmith data show sharegpt.jsonl --target testbed --schema sharegpt --turns last
  draftsmith data show chat.jsonl --target Qwen/Qwen3-8B --chat-template-kwargs '{"enable_thinking": false}' --json""",
}


# what `draftsmith eval` supplies that the eval schema does not default
EVAL_DEFAULTS = {"output_dir": "runs/eval"}
# eval recipe sections with flags of their own making (--target, --prompts, --prompts-from-corpus) or none
# (set them with KEY=VALUE overrides); the recipe's other fields and every leaf of `decoding` get a flag each
EVAL_SECTIONS_WITHOUT_FLAGS = ("target", "prompts", "data")


@functools.cache
def eval_flags() -> tuple:
    """One flag per leaf of the eval recipe's schema (:class:`distill.config.EvalRecipe`) but ``recipe``
    and :data:`EVAL_SECTIONS_WITHOUT_FLAGS`: a top-level field's flag is its name (``--output-dir``), a
    section's leaf its key below the section (``decoding.kv.format`` -> ``--kv-format``;
    :mod:`distill.config.flags`)."""
    from distill.config import EvalRecipe
    from distill.config.flags import Flag, flag_name, flags, section_of

    wanted = []
    for name, field in EvalRecipe.model_fields.items():
        if name == "recipe" or name in EVAL_SECTIONS_WITHOUT_FLAGS:
            continue
        section = section_of(field.annotation)
        wanted += flags(section, f"{name}.", strip=f"{name}.") if section else [Flag(name, flag_name(name), field)]
    names = [f.flag for f in wanted]
    assert len(set(names)) == len(names), f"eval flags collide: {sorted(n for n in names if names.count(n) > 1)}"
    return tuple(wanted)


def _parser(eval_flags_too: bool = True) -> argparse.ArgumentParser:
    """The command line; ``eval_flags_too=False`` leaves out ``eval``'s schema flags (what every other
    command parses without importing the schema)."""
    parser = argparse.ArgumentParser(
        prog="draftsmith",
        description="Train speculative-decoding drafters and compact models from a target LLM, "
        "and prove them in a lossless decoding loop.",
        epilog="`draftsmith COMMAND --help` shows each command's options and examples.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_,
            description=help_,
            epilog=EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    ls = command("ls", "list the shipped recipes (recipes/configs/), one line each")
    ls.add_argument("--recipes", action="store_true", help="list the recipe kinds and their schemas instead")
    for name, help_ in (
        ("run", "run a recipe"),
        ("validate", "validate a recipe and print it resolved (nothing runs)"),
    ):
        p = command(name, help_)
        p.add_argument(
            "recipe", metavar="RECIPE", help="a recipe YAML path, or a shipped recipe's name (see `draftsmith ls`)"
        )
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="KEY=VALUE",
            help="dotted overrides, values parsed as YAML scalars (train.max_steps=20, 'x.y=[1, 2]')",
        )
        if name == "run":
            p.add_argument(
                "--dry-run",
                action="store_true",
                help="validate and build the models on the meta device, print a summary (JSON) and the "
                "memory per GPU, train nothing; a hub target not in the cache is built from its "
                "shipped config (recipes/configs/targets/)",
            )
            p.add_argument(
                "--num-processes",
                type=_positive_int,
                metavar="N",
                help="with --dry-run: the GPUs (processes) the memory estimate is for (default: 8)",
            )
            p.add_argument(
                "--zero-stage",
                type=int,
                choices=[0, 1, 2, 3],
                metavar="{0,1,2,3}",
                help="with --dry-run: the DeepSpeed ZeRO stage the memory estimate assumes; 0 = no DeepSpeed "
                "(DDP or one process) (default: 2)",
            )
    ev = command("eval", "speculative vs plain decoding of a target with a drafter (writes OUTPUT_DIR/report.json)")
    ev.add_argument(
        "--target", default="testbed", help="'testbed', a local folder or a hub id: target.path (default: testbed)"
    )
    ev.add_argument(
        "--prompts",
        metavar="FILE",
        help='JSONL file, one {"prompt": ...} per line: prompts.file (default: held-out corpus snippets)',
    )
    ev.add_argument(
        "--prompts-from-corpus",
        type=int,
        default=16,
        metavar="N",
        help="held-out snippets when --prompts is not given: prompts.from_corpus, split val (default: 16)",
    )
    if eval_flags_too:
        from distill.config.flags import add_flags

        add_flags(ev, list(eval_flags()), EVAL_DEFAULTS)
    ev.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides of the eval recipe, applied after the flags, values parsed as YAML scalars "
        "(decoding.kv.format=int8, data.source=stdlib, 'decoding.tree_budgets=[8, 16]')",
    )
    ex = command("export", "export a drafter (transformers, vLLM speculators, SGLang EAGLE-3) behind the parity gate")
    ex.add_argument("--drafter", required=True, metavar="DIR", help="trained drafter folder")
    ex.add_argument("--target", default="testbed", help="'testbed', a local folder or a hub id (default: testbed)")
    ex.add_argument("--output-dir", required=True, metavar="DIR", help="the export folder to write")
    ex.add_argument(
        "--formats",
        nargs="+",
        choices=["transformers", "speculators", "sglang_eagle3"],
        help="default: every format that can express the drafter",
    )
    ex.add_argument(
        "--verifier", metavar="NAME", help="verifier name recorded for serving (default: the drafter's target)"
    )
    ex.add_argument(
        "--prompts-from-corpus",
        type=int,
        metavar="N",
        help="held-out snippets the gate decodes (default: the export recipe's)",
    )
    ex.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="tokens the gate generates per prompt (default: the export recipe's)",
    )
    ex.add_argument(
        "--eval-report",
        action="append",
        default=[],
        metavar="FILE",
        help="an eval report.json to cite in the model card (repeatable)",
    )
    ex.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        metavar="N",
        help="export a draft vocabulary of the N tokens the target emits most (d2t / t2d, pruned heads)",
    )
    ex.add_argument("--allow-failed-gate", action="store_true", help="publish even if the parity gate fails (loudly)")
    ex.add_argument("--push-to-hub", metavar="REPO_ID", help="upload to this hub repository (owner/name)")
    ex.add_argument("--public", action="store_true", help="with --push-to-hub: a public repository")
    ex.add_argument("--revision", help="with --push-to-hub: the branch to commit to")
    bench = command(
        "bench", "a drafter on HumanEval, MT-Bench or your own prompt sets, per set and category (writes report.json)"
    )
    bench.add_argument(
        "--drafter",
        required=True,
        action="append",
        metavar="DIR",
        help="a drafter folder (draftsmith's or vLLM's speculators format); repeat it to compare drafters on the "
        "same prompts in one report: drafter, then compare",
    )
    bench.add_argument("--target", default="testbed", help="'testbed', a local folder or a hub id (default: testbed)")
    bench.add_argument(
        "--sets",
        default="humaneval,mtbench",
        help="comma-separated: named sets (humaneval, mtbench) and NAME=FILE.jsonl (default: humaneval,mtbench)",
    )
    bench.add_argument("--limit", type=_positive_int, metavar="N", help="the first N questions of each set")
    bench.add_argument(
        "--temperatures", type=float, nargs="+", metavar="T", help="temperatures measured (default: 0 1)"
    )
    bench.add_argument("--output-dir", default="runs/bench", metavar="DIR", help="(default: runs/bench)")
    bench.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides of the bench recipe (decoding.mode=tree, 'decoding.tree_budgets=[8]', thinking=[false])",
    )
    data = command("data", "look at training data as a recipe reads it")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    show = data_sub.add_parser(
        "show",
        help="one record's training examples, each token with its mask bit",
        description="one record's training examples, each token with its mask bit (1: the loss scores it)",
        epilog=EXAMPLES["data"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from recipes import data_show

    data_show.add_arguments(show)
    return parser


def _ls(recipes: bool) -> int:
    from recipes.registry import describe, schema_table, shipped_configs

    if recipes:
        for row in schema_table():
            print(f"{row['recipe']:16s} {row['module']:24s} {row['summary']}")
        return 0
    for name, path in shipped_configs().items():
        print(f"{name:28s} {describe(path)}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0911, PLR0912 one exit status per command
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser(eval_flags_too=argv[:1] == ["eval"])
    args = parser.parse_args(argv)
    dry_run = args.command == "run" and args.dry_run
    if args.command == "run" and not dry_run and (args.num_processes or args.zero_stage is not None):
        parser.error(
            "--num-processes and --zero-stage size the --dry-run estimate; a real run takes its launch from accelerate"
        )
    from distill.config import RecipeError, apply_overrides, set_key
    from distill.config.flags import given
    from distill.config.targets import allow_shipped_target_configs
    from recipes.registry import load_recipe, parse_recipe, run_recipe

    if args.command == "ls":
        return _ls(args.recipes)
    if args.command == "data":
        from recipes import data_show

        try:
            return data_show.main(args)
        except RecipeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    try:
        if args.command == "eval":
            prompts = (
                {"file": args.prompts} if args.prompts else {"from_corpus": args.prompts_from_corpus, "split": "val"}
            )
            raw = {"recipe": "eval", "target": {"path": args.target}, "prompts": prompts}
            flag = {f.key: f.flag for f in eval_flags()}
            for key, value in {**EVAL_DEFAULTS, **given(args, eval_flags())}.items():
                set_key(raw, key, value, flag[key])
            recipe = parse_recipe(apply_overrides(raw, args.overrides), source="draftsmith eval")
            run_recipe(recipe)
            return 0
        if args.command == "bench":
            sets = [
                dict(zip(("name", "file"), item.split("=", 1))) if "=" in item else {"name": item}
                for item in args.sets.split(",")
                if item
            ]
            raw = {
                "recipe": "bench",
                "output_dir": args.output_dir,
                "drafter": args.drafter[0],
                "compare": args.drafter[1:],
                "target": {"path": args.target},
                "sets": sets,
                **({"limit": args.limit} if args.limit else {}),
                **({"temperatures": args.temperatures} if args.temperatures else {}),
            }
            run_recipe(parse_recipe(apply_overrides(raw, args.overrides), source="draftsmith bench"))
            return 0
        if args.command == "export":
            push = {
                "enabled": bool(args.push_to_hub),
                "repo_id": args.push_to_hub,
                "private": not args.public,
                "revision": args.revision,
            }
            recipe = parse_recipe(
                {
                    "recipe": "export",
                    "output_dir": args.output_dir,
                    "drafter": args.drafter,
                    "target": {"path": args.target},
                    "formats": args.formats,
                    "verifier_name_or_path": args.verifier,
                    **(
                        {"prompts": {"from_corpus": args.prompts_from_corpus, "split": "val"}}
                        if args.prompts_from_corpus
                        else {}
                    ),
                    "gate": {
                        "allow_failure": args.allow_failed_gate,
                        **({"max_new_tokens": args.max_new_tokens} if args.max_new_tokens else {}),
                    },
                    "eval_reports": args.eval_report,
                    "draft_vocab": args.draft_vocab,
                    "push_to_hub": push,
                },
                source="draftsmith export",
            )
            return _run_export(recipe)
        with allow_shipped_target_configs() if dry_run else contextlib.nullcontext():
            recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "validate":
        print(json.dumps(recipe.model_dump(mode="json"), indent=2))
        return 0
    if recipe.recipe == "export" and not args.dry_run:
        return _run_export(recipe)
    if dry_run:
        return _dry_run(recipe, args)
    try:
        run_recipe(recipe)
    except RecipeError as e:  # found once the models are built (a layer-map pattern that matches nothing, ...)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _dry_run(recipe, args) -> int:
    """The recipe's dry-run summary as JSON, then its memory table (training recipes)."""
    from distill.config import RecipeError
    from recipes.dry_run import Launch, estimate_for, format_memory_table
    from recipes.registry import run_recipe

    launch = Launch(
        **{k: v for k, v in (("num_processes", args.num_processes), ("zero_stage", args.zero_stage)) if v is not None}
    )
    try:
        with estimate_for(launch):
            result = run_recipe(recipe, dry_run=True)
    except RecipeError as e:  # found once the models are built (a layer-map pattern that matches nothing, ...)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, default=str))
    if "memory_gib_per_device" in result:
        print(format_memory_table(result["memory_gib_per_device"]))
    return 0


def _run_export(recipe) -> int:
    """An export whose parity gate fails (without an override) exits with status 3."""
    from recipes.export import ExportRefused
    from recipes.registry import run_recipe

    try:
        run_recipe(recipe)
    except ExportRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
