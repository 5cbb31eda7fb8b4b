"""Ship a trained run as a testbed artifact: the target, or a drafter for it.

    python -m recipes.ship_testbed runs/testbed_target [--dest distill/assets/testbed_target]
    python -m recipes.ship_testbed --drafter runs/dflash_testbed --eval-report runs/eval_dflash/report.json ...
    python -m recipes.ship_testbed runs/pard_long --dest distill/assets/testbed_pard --eval-report ...

A causal LM (the target, or a PARD drafter): ``<run>/model`` in half precision (about 22 MB for the 11M
target), with its tokenizer and the eval reports given (``results.json``, as for a drafter). A drafter
of a registered kind: its best checkpoint's own weights in half precision, without the target's
embeddings and LM head (they load from the target, as serving engines load them), plus the eval
reports given (``results.json``, keyed by each eval run's folder name: the measured tau and speedup)
and ``evaluation.json`` (the shipped weights on the run's held-out set, by the current evaluator). Both get the run's resolved ``recipe.yaml``, ``provenance.json`` and
``summary.json`` (as ``training_summary.json``), written atomically: the old copy stays in place until
the new one is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from distill.provenance import git_state
from distill.testbed import SHIPPED_DRAFTERS, SHIPPED_TARGET


def _run_files(run_dir: Path, tmp: Path, dtype: str) -> None:
    shutil.copy(run_dir / "recipe.yaml", tmp / "recipe.yaml")
    shutil.copy(run_dir / "summary.json", tmp / "training_summary.json")
    prov = json.loads((run_dir / "provenance.json").read_text())
    prov["shipped"] = {"from_run": str(run_dir), "dtype": dtype, "git_at_shipping": git_state()}
    (tmp / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")


def _publish(tmp: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def _check_run(run_dir: Path, *needed: str) -> None:
    for name in ("recipe.yaml", "provenance.json", "summary.json", *needed):
        if not (run_dir / name).exists():
            raise FileNotFoundError(f"{run_dir / name} is missing: is {run_dir} a finished training run?")


def _results(eval_reports: list[Path], tmp: Path) -> None:
    """``results.json``: each eval report but its per-prompt rows, keyed by its run's folder name."""
    results = {}
    for report in map(Path, eval_reports):
        rep = json.loads(report.read_text())
        results[report.parent.name] = {k: v for k, v in rep.items() if k != "per_prompt"}
    (tmp / "results.json").write_text(json.dumps(results, indent=2) + "\n")


def ship(run_dir: Path, dest: Path = SHIPPED_TARGET, eval_reports: list[Path] = ()) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = Path(run_dir)
    _check_run(run_dir, "model/config.json")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float16)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(run_dir / "model").save_pretrained(tmp)
    _run_files(run_dir, tmp, "float16")
    if eval_reports:
        _results(eval_reports, tmp)
    return _publish(tmp, dest)


def ship_drafter(run_dir: Path, eval_reports: list[Path], dest: Path | None = None) -> Path:
    import torch
    from transformers import AutoModel

    import drafters

    run_dir = Path(run_dir)
    best = run_dir / "checkpoints" / "best"
    _check_run(run_dir, "checkpoints/best/config.json")
    drafter = AutoModel.from_pretrained(best, dtype=torch.float32)
    kind = drafter.config.model_type.removeprefix("draftsmith_")
    dest = Path(dest or SHIPPED_DRAFTERS[kind])
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafters.save_without_target_io(drafter, tmp, torch.float16)
    shutil.copy(best / "trainer_state.json", tmp / "trainer_state.json")  # the step and the metrics it was chosen by
    # the held-out metrics of the shipped weights, by this code's evaluator (a run may predate it)
    (tmp / "evaluation.json").write_text(json.dumps(evaluate_shipped(run_dir, tmp), indent=2) + "\n")
    _run_files(run_dir, tmp, "float16")
    _results(eval_reports, tmp)
    return _publish(tmp, dest)


def evaluate_shipped(run_dir: Path, folder: Path) -> dict:
    """The drafter in ``folder`` evaluated on its training run's held-out windows (its recipe's data:
    the regenerated answers are read from their cache, or made again)."""
    from distill.base.features import FeatureCapture
    from distill.drafter_eval import evaluate_drafter
    from distill.models import load_target
    from recipes.evaluate import load_drafter
    from recipes.registry import load_recipe
    from recipes.train_drafter import drafter_windows

    recipe = load_recipe(run_dir / "recipe.yaml")
    target, tokenizer = load_target(recipe.target)
    drafter = load_drafter(str(folder), target, "cpu")
    _, val, _ = drafter_windows(recipe, target, tokenizer)
    metrics = evaluate_drafter(
        drafter, FeatureCapture(target, drafter.config.target_layer_ids), val, recipe.train.micro_batch_size, None
    )
    return {"held_out_windows": len(val), **metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "run_dir", type=Path, nargs="?", help="a train_lm / distill_student run (the target, a PARD drafter)"
    )
    parser.add_argument("--drafter", type=Path, help="a train_drafter run, shipped for the testbed target")
    parser.add_argument("--eval-report", type=Path, action="append", default=[], help="eval report.json (repeatable)")
    parser.add_argument("--dest", type=Path, default=None)
    args = parser.parse_args()
    if args.drafter:
        print(f"shipped {ship_drafter(args.drafter, args.eval_report, args.dest)}")
    elif args.run_dir:
        print(f"shipped {ship(args.run_dir, args.dest or SHIPPED_TARGET, args.eval_report)}")
    else:
        parser.error("give a target run directory or --drafter RUN")


if __name__ == "__main__":
    main()
