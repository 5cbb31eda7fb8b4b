"""Ship a trained ``train_lm`` run as the testbed target: fp16 weights, tokenizer and provenance.

    python -m recipes.ship_testbed runs/testbed_target [--dest distill/assets/testbed_target]

Copies ``<run>/model`` in half precision (about 22 MB for the 11M model) with the run's resolved
``recipe.yaml``, ``provenance.json`` and ``summary.json`` (as ``training_summary.json``) into the
destination, atomically: the old copy stays in place until the new one is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from distill.provenance import git_state
from distill.testbed import SHIPPED_TARGET


def ship(run_dir: Path, dest: Path = SHIPPED_TARGET) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = Path(run_dir)
    for needed in ("model/config.json", "recipe.yaml", "provenance.json", "summary.json"):
        if not (run_dir / needed).exists():
            raise FileNotFoundError(f"{run_dir / needed} is missing: is {run_dir} a finished train_lm run?")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float16)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(run_dir / "model").save_pretrained(tmp)
    shutil.copy(run_dir / "recipe.yaml", tmp / "recipe.yaml")
    shutil.copy(run_dir / "summary.json", tmp / "training_summary.json")
    prov = json.loads((run_dir / "provenance.json").read_text())
    prov["shipped"] = {"from_run": str(run_dir), "dtype": "float16", "git_at_shipping": git_state()}
    (tmp / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--dest", type=Path, default=SHIPPED_TARGET)
    args = parser.parse_args()
    print(f"shipped {ship(args.run_dir, args.dest)}")


if __name__ == "__main__":
    main()
