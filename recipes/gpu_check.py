"""``make gpu-check``: the CUDA paths proved in one command on one GPU (a few minutes), one summary.

0. **static_loop**: the shipped DFlash drafter through the static step (:mod:`serve_eval.static`, compiled:
   CUDA graphs) and through the eager generic loop, each against plain decoding on the same backend:
   tokens/s, tau, host reads a step, lossless (fp32).
   **verify_costs**: a verify forward of 1..32 tokens a row, batches of 1, 4 and 16, on a random-weight
   target of Qwen3-8B's shapes in bf16, and the speedup that table predicts at the shipped drafter's tau.
   **train_step**: one DFlash training step at those shapes: seconds, peak memory, the ``--dry-run`` estimate.
1. **lossless**: the shipped testbed target with each shipped drafter (DFlash, DSpark, EAGLE-3) on
   the GPU in fp32 (TF32 off), greedy: chains, trees, trees with lookup, and batches of 4 rows (block
   drafters; with prompt-lookup copies, which the chain of that run grafts too); every output must equal plain greedy decoding on the same device token for token. A run
   at temperature 1 per drafter must finish (its exactness is the sampling tests' job, on any device).
2. **train**: a DFlash drafter for the testbed target under bf16 autocast, the target beside it on the
   GPU (online features), a few hundred steps: tokens/s and MFU against the GPU's measured bf16 peak.
   **train_compiled**: the same under ``train.compile`` (torch.compile, inductor).
3. **eval**: the shipped DFlash drafter against plain decoding on held-out prompts, chain and tree:
   tau, speedup, lossless; and the chain in bf16 (target and drafter), whose equality with plain bf16
   decoding is reported, not required (k verified tokens and one decoded token round differently).

By default the steps that fit a short lease run (static_loop, verify_costs, train_step, lossless, eval); ``--steps``
names others (train, train_compiled).

Writes ``<out>/summary.json`` and prints it as a table. Exit status 0 when every step passed (and on
a machine without CUDA, where it says so and checks nothing), 1 when a step failed or an output
differed. ``--device cpu --quick`` rehearses every step at toy sizes on a CPU (the test suite does,
so the script itself cannot rot without a GPU).

    make gpu-check
    python -m recipes.gpu_check --out runs/gpu_check          # the same
    python -m recipes.gpu_check --device cpu --quick          # a rehearsal on a CPU, ~1 minute

Beside torch it needs this project's own dependencies (pydantic, transformers, accelerate, datasets):
on a machine that cannot install them, bring them as wheels.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from distill.provenance import write_json_atomic
from distill.testbed import SHIPPED_DRAFTERS
from recipes.registry import load_recipe

EVAL = "recipes/configs/eval_testbed.yaml"
TRAIN = "recipes/configs/dflash_testbed.yaml"


def _eval(out: Path, drafter: str, prompts: int, tokens: int, *overrides: str) -> dict:
    from recipes import evaluate

    recipe = load_recipe(
        EVAL,
        [
            f"output_dir={out}",
            f"drafter={drafter}",
            f"prompts.from_corpus={prompts}",
            f"decoding.max_new_tokens={tokens}",
            *overrides,
        ],
    )
    return evaluate.main(recipe)


def lossless(out: Path, quick: bool) -> dict:
    """Every shipped drafter in every greedy mode equals plain decoding; T = 1 runs."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    prompts, tokens = (2, 12) if quick else (8, 64)
    modes = {
        "chain": [],
        "tree": ["decoding.mode=tree", "decoding.tree_budgets=[8]"],
        "tree_lookup": ["decoding.mode=tree", "decoding.tree_budgets=[8]", "decoding.lookup.tokens=10"],
        "batch4": [
            f"decoding.batches.sizes=[{min(4, prompts)}]",
            "decoding.lookup.tokens=7",
        ],  # copies: chain and batch
        "chain_t1": ["decoding.temperature=1.0"],
    }
    rows = {}
    for kind, folder in SHIPPED_DRAFTERS.items():
        for mode, extra in modes.items():
            if quick and kind != "dflash" and mode not in ("chain", "tree"):
                continue  # a rehearsal: every mode once, every drafter twice
            report = _eval(out / f"{kind}_{mode}", str(folder), prompts, tokens, *extra)
            row = {"tau": report["tau"], "speedup": report["speedup"], "lossless": report["lossless"]}
            if mode == "batch4":
                row["lossless"] = all(b.get("lossless", False) for b in report["by_batch"])
            rows[f"{kind}/{mode}"] = row
    failed = [k for k, r in rows.items() if not k.endswith("_t1") and r["lossless"] is not True]
    return {"passed": not failed, "not_lossless": failed, "runs": rows}


def train(out: Path, quick: bool, compile: bool = False) -> dict:
    """A short bf16 DFlash training with the target beside it: tokens/s, MFU."""
    from recipes import train_drafter

    steps = 3 if quick else (150 if compile else 300)
    mixed = "bf16" if torch.cuda.is_available() else "no"  # bf16 on a CPU is the slow path: rehearse in fp32
    recipe = load_recipe(
        TRAIN,
        [
            f"output_dir={out}",
            "regenerate=null",
            "features.mode=online",
            "features.cache_dir=null",
            f"train.mixed_precision='{mixed}'",
            f"train.max_steps={steps}",
            f"train.eval_every={steps}",
            f"train.save_every={steps}",
            "train.eval_batches=2",
            "train.resume=false",
            f"train.micro_batch_size={2 if quick else 32}",
            "drafter.init_from=null",
            f"train.compile={compile}",
            *(["data.max_documents=40"] if quick else []),
        ],
    )
    summary = train_drafter.main(recipe)
    return {
        "passed": True,
        "mixed_precision": mixed,
        "steps": summary["steps"],
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": summary["mfu"],
        "val_simulated_tau": summary.get("val_simulated_tau"),
    }


def evaluate(out: Path, quick: bool) -> dict:
    """The shipped DFlash drafter, chain and tree, against plain decoding."""
    prompts, tokens = (2, 12) if quick else (16, 128)
    folder = str(SHIPPED_DRAFTERS["dflash"])
    rows = {
        "chain": _eval(out / "chain", folder, prompts, tokens),
        "tree": _eval(
            out / "tree",
            folder,
            prompts,
            tokens,
            "decoding.mode=tree",
            "decoding.tree_budgets=[8]" if quick else "decoding.tree_budgets=[8, 16, 32]",
        ),
    }
    passed = all(r["lossless"] for r in rows.values())
    if torch.cuda.is_available():  # bf16 target and drafter: the serving dtype; verifying k tokens and decoding one
        # at a time round differently in bf16, so its equality with plain decoding is reported, not required
        rows["chain_bf16"] = _eval(out / "chain_bf16", folder, prompts, tokens, "target.dtype=bfloat16")
    keep = ("tau", "speedup", "tokens_per_s", "baseline_tokens_per_s", "lossless")
    return {"passed": passed, **{k: {f: r[f] for f in keep} for k, r in rows.items()}}


def static_loop(out: Path, quick: bool) -> dict:
    """The shipped DFlash drafter on the testbed, chains of every draft (fp32, TF32 off), through the
    static step (:mod:`serve_eval.static`, compiled) and the eager generic loop, each against plain
    decoding through the same backend: tokens/s, tau, host reads a step, lossless."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    prompts, tokens = (2, 16) if quick else (8, 128)
    folder = str(SHIPPED_DRAFTERS["dflash"])
    fixed = ["decoding.budget.adaptive=false"]
    runs = {
        name: _eval(out / name, folder, prompts, tokens, f"decoding.backend={name}", *fixed)
        for name in ("static", "torch")
    }
    row = lambda r: {  # noqa: E731
        "lossless": r["lossless"],
        "tau": r["tau"],
        "tokens_per_s": r["tokens_per_s"],
        "host_syncs_per_step": r["host_syncs_per_step"]["speculative"],
    }
    static, eager = runs["static"], runs["torch"]
    return {
        "passed": static["lossless"] is True and eager["lossless"] is True,
        **row(static),
        "compiled_graphs": static.get("compiled_graphs"),
        "eager": row(eager),
        "plain": {
            "static_tokens_per_s": static["baseline_tokens_per_s"],
            "eager_tokens_per_s": eager["baseline_tokens_per_s"],
            "host_syncs_per_step": static["host_syncs_per_step"]["plain"],
        },
        "static_over_eager": round(static["tokens_per_s"] / eager["tokens_per_s"], 4),
        "comparison": static["comparison"],
    }


#: Qwen3-8B's shapes (its config.json), for a random-weight target of that size
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)
#: the same family at toy size, for a rehearsal
QWEN3_TOY = dict(QWEN3_8B, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip


def random_qwen3(quick: bool, device: str):
    """A random-weight Qwen3 of 8B's shapes (a toy one with ``quick``), bf16 on a GPU, fp32 on a CPU."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = Qwen3Config(**(QWEN3_TOY if quick else QWEN3_8B))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def verify_costs(out: Path, quick: bool, drafter_tau: dict | None = None) -> dict:
    """The cost of one verify forward of ``n`` tokens a row after a context, for ``n`` in 1..32 and batches
    of 1, 4 and 16 rows, on a random-weight target of Qwen3-8B's shapes (bf16) through the static step's
    cache, eager; and the speedup the table predicts for a drafter of tau ``t`` verifying ``K`` tokens a
    step, ``t * cost(1) / cost(K)`` (the draft's own cost left out: an upper bound), at the shipped
    drafters' tau measured on the testbed."""
    from serve_eval.static import RowSlots, static_cache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_qwen3(quick, device)
    context, sizes = (32, [1, 2, 4, 8]) if quick else (512, [1, 2, 4, 8, 16, 32])
    batches = [1, 4] if quick else [1, 4, 16]
    repeats = 2 if quick else 10
    clock = _timer(device)
    table: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in batches:
            slots = RowSlots()
            cache = static_cache(model.config, context + max(sizes) + 1, slots)
            slots.starts = torch.zeros(rows, dtype=torch.long, device=device)
            ids = torch.randint(0, model.config.vocab_size, (rows, context), device=device)
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)  # the context, once
            lengths = torch.full((rows,), context, device=device)
            table[str(rows)] = {}
            for n in sizes:
                positions = lengths[:, None] + torch.arange(n, device=device)
                mask = (torch.arange(cache.layers[0].capacity, device=device) <= positions[:, :, None])[:, None]
                slots.starts = lengths
                step = functools.partial(
                    model,
                    input_ids=ids[:, :n],
                    position_ids=positions,
                    attention_mask=mask,
                    cache=cache,
                    use_cache=True,
                )
                table[str(rows)][str(n)] = round(1e3 * clock(step, repeats), 3)
    taus = drafter_tau or {}
    predicted = {
        kind: {rows: round(t * costs["1"] / costs[str(k)], 3) for rows, costs in table.items() if str(k) in costs}
        for kind, (t, k) in taus.items()
    }
    return {"passed": True, "model": "qwen3 toy" if quick else "qwen3-8b shapes", "dtype": str(model.dtype),
            "context": context, "ms": table, "predicted_speedup": predicted}  # fmt: skip


def train_step(out: Path, quick: bool) -> dict:
    """One DFlash training step (features from the target, the drafter's forward, backward and AdamW step,
    bf16 autocast on a GPU) for a random-weight target of Qwen3-8B's shapes at the testbed recipe's
    micro batch and sequence length: seconds a step and the peak memory, beside the ``--dry-run``
    estimate (:func:`recipes.train_drafter.memory_estimate`) of the same."""
    from distill.base.features import FeatureCapture
    from distill.drafter_eval import build_drafter
    from recipes.train_drafter import memory_estimate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = random_qwen3(quick, device)
    rows, seq = (2, 32) if quick else (8, 1024)
    mixed = "bf16" if device == "cuda" else "no"
    recipe = load_recipe(TRAIN, [f"output_dir={out}", "regenerate=null", f"train.micro_batch_size={rows}", f"data.seq_len={seq}",
                                 f"train.mixed_precision='{mixed}'"])  # fmt: skip
    vocab = target.config.vocab_size
    drafter = build_drafter(recipe.drafter, target, "qwen3", mask_token_id=vocab - 1).to(device).train()
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    capture = FeatureCapture(target, drafter.config.target_layer_ids)
    ids = torch.randint(0, vocab, (rows, seq), device=device)

    def step() -> None:
        with torch.no_grad():
            feats = capture(ids)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=mixed == "bf16"):
            loss = drafter(input_ids=ids, aux=feats.aux, last=feats.last).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = _timer(device)(step, 1 if quick else 3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    estimate = memory_estimate(recipe, target, drafter)["total"]
    return {
        "passed": True,
        "model": "qwen3 toy" if quick else "qwen3-8b shapes",
        "micro_batch": rows,
        "seq_len": seq,
        "seconds_per_step": round(seconds, 4),
        "peak_gib": None if peak is None else round(peak, 2),
        "dry_run_estimate_gib": estimate,
        "peak_over_estimate": None if peak is None else round(peak / estimate, 3),
    }


def _timer(device: str):
    """``time(fn, repeats)``: the median seconds of ``fn()`` after one warm-up, the device waited for."""

    def time_it(fn, repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    return time_it


def train_compiled(out: Path, quick: bool) -> dict:
    """The same training under ``train.compile`` (inductor; the first steps include compiling)."""
    return train(out, quick, compile=True)


STEPS = {
    "static_loop": static_loop,
    "verify_costs": verify_costs,
    "train_step": train_step,
    "lossless": lossless,
    "train": train,
    "train_compiled": train_compiled,
    "eval": evaluate,
}
DEFAULT_STEPS = [
    "static_loop",
    "verify_costs",
    "train_step",
    "lossless",
    "eval",
]  # what fits a short lease (train: --steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.gpu_check",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", default="runs/gpu_check", help="folder for the runs and summary.json (default: %(default)s)"
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu"],
        default="auto",
        help="auto: the GPU, or say there is none and exit 0; cpu: rehearse on the CPU",
    )
    parser.add_argument("--quick", action="store_true", help="toy sizes (prompts, tokens, steps): a rehearsal")
    parser.add_argument(
        "--steps",
        nargs="+",
        choices=list(STEPS),
        default=None,
        help=f"which steps (default: {' '.join(DEFAULT_STEPS)})",
    )
    args = parser.parse_args(argv)
    args.steps = args.steps or DEFAULT_STEPS
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA is asked: every recipe then picks the CPU
    elif not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}); nothing checked.")
        return 0
    out = Path(args.out)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    summary = {"device": device, "torch": torch.__version__, "quick": args.quick, "steps": {}}
    for name in args.steps:
        start = time.perf_counter()
        try:
            if name == "verify_costs":  # the predicted speedups read the shipped drafter's tau from the static loop
                loop = summary["steps"].get("static_loop", {})
                block = json.loads((SHIPPED_DRAFTERS["dflash"] / "config.json").read_text())["block_size"]
                tau = {"dflash": (loop["tau"], block)} if "tau" in loop else None  # a step verifies its whole block
                result = verify_costs(out / name, args.quick, tau)
            else:
                result = STEPS[name](out / name, args.quick)
        except Exception as e:  # one step's failure is reported; the others still run
            result = {"passed": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        result["seconds"] = round(time.perf_counter() - start, 1)
        summary["steps"][name] = result
    summary["passed"] = all(s["passed"] for s in summary["steps"].values())
    loop = summary["steps"].get("static_loop", {})
    if "tau" in loop:  # the headline: the static step's own numbers
        summary["static_loop"] = {k: loop[k] for k in ("lossless", "tau", "tokens_per_s", "host_syncs_per_step")}
    write_json_atomic(out / "summary.json", summary)
    print(f"\n== gpu-check on {device} (torch {torch.__version__}) ==")
    for name, result in summary["steps"].items():
        brief = {k: v for k, v in result.items() if k not in ("traceback", "runs")}
        print(f"  {name:<9} {'passed' if result['passed'] else 'FAILED'}  {json.dumps(brief)}")
        for key, row in result.get("runs", {}).items():
            print(f"    {key:<20} {json.dumps(row)}")
    print(f"  summary: {out / 'summary.json'}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
