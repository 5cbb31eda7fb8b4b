"""Where a speculative step's time goes: each piece of the loop timed over held-out prompts.

    python -m recipes.profile_step --drafter distill/assets/testbed_dflash [--temperature 1] [--prompts 8] [--cpu-int8 auto|off|head|all] [--cpu-prepack auto|on|panels|onednn|off] [--cpu-compile auto|on|off] [--attention kernel|sdpa|both] [--forward lean|module|both]
    python -m recipes.profile_step --drafter distill/assets/testbed_dflash --batch 4

Loads the eval recipe (``recipes/configs/eval_testbed.yaml`` unless ``--recipe``), decodes each prompt
plainly and speculatively (chain, per-step budgets, 1 thread), and prints milliseconds per
speculative step for the drafter's parts (the proposer's ``propose`` and ``observe`` and, for block
drafters, the decoding forward ``decode``, which also reads the newly verified context, and the heads) and the
budget's bookkeeping, beside the plain step and the step as a whole. The timers wrap the methods as
they run, so what is printed is what the loop spends (the target's ``verify`` and ``rollback`` in
speculative decoding only; its prefill spread over the steps); the first prompt warms up and is not
counted. ``--attention both`` decodes each prompt with the target's and the drafter's attention on our
kernel and on torch's sdpa in turn (:mod:`serve_eval.cpu.attention`; two copies of the drafter, each
compiled over its own), each with its own cost table: an A/B in one process. ``--forward both`` does
the same for the target's forward: :mod:`serve_eval.cpu.lean`'s walk and the model's own forward.
``--batch B`` profiles batched decoding instead (all the recipe's prompts through ``B`` slots, as the eval
runs them): each loop's prefills and target steps, the draft and the scheduler per speculative step,
and the speculative steps by the rows they ran with. A benchmark: run it on an otherwise idle core (``taskset -c 1``).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from distill.base.decoding import CpuSection
from distill.config.flags import add_flags, flags, given

CPU_FLAGS = flags(
    CpuSection, "decoding.cpu.", strip="decoding."
)  # the eval's own: --cpu-int8, --cpu-prepack, --cpu-compile


def _timed(obj, name: str, label, totals: dict, calls: collections.Counter, undo: list, active=lambda: True) -> None:
    """Wrap ``obj.name`` so that its calls add to ``totals[label]`` while ``active()``; ``label`` may be
    a function of the call's arguments. ``undo`` gets the call that puts ``obj.name`` back."""
    inner = getattr(obj, name)
    own = vars(obj).get(name)  # a class's own function, or None: an instance's method, from its class
    undo.append(lambda: setattr(obj, name, own) if own is not None else delattr(obj, name))

    def timed(*args, **kwargs):
        if not active():
            return inner(*args, **kwargs)
        key = label(*args) if callable(label) else label
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        totals[key] += time.perf_counter() - start
        calls[key] += 1
        return out

    setattr(obj, name, timed)


def _report(run: dict, what: str) -> dict:
    """Print and return one setting's times per speculative step."""
    steps, totals, calls = run["steps"], run["totals"], run["calls"]
    plain_ms = 1e3 * run["plain_s"] / run["plain_tokens"]
    report = {
        "plain_step_ms": round(plain_ms, 3),
        "spec_step_ms": round(1e3 * run["spec_s"] / steps, 3),
        "tokens_per_step": round(run["spec_tokens"] / steps, 3),
        "speedup": round((run["spec_tokens"] / run["spec_s"]) / (run["plain_tokens"] / run["plain_s"]), 4),
        "ms_per_step": {k: round(1e3 * v / steps, 3) for k, v in totals.items()},
    }
    print(
        f"plain step {plain_ms:.3f} ms; speculative step {report['spec_step_ms']:.3f} ms for "
        f"{report['tokens_per_step']:.2f} tokens ({report['spec_step_ms'] / plain_ms:.2f} plain steps); "
        f"speedup {report['speedup']:.3f} ({what})"
    )
    rest = report["spec_step_ms"] - sum(report["ms_per_step"][k] for k in totals if not k.startswith(" "))
    for label, ms in [*report["ms_per_step"].items(), ("the rest (the loop's own work)", rest)]:
        print(
            f"  {label:30s} {ms:7.3f} ms a step = {ms / plain_ms:.3f} plain steps"
            + (f"  ({calls[label]} calls)" if label in calls else "")
        )
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--recipe", default="recipes/configs/eval_testbed.yaml")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts, the first a warm-up")
    parser.add_argument("--max-new-tokens", type=int, help="default: the recipe's")
    add_flags(parser, CPU_FLAGS, {f.key: "the recipe's" for f in CPU_FLAGS})  # decoding.cpu.*: --cpu-int8, ...
    parser.add_argument(
        "--attention",
        choices=["kernel", "sdpa", "both"],
        default="kernel",
        help="the target's attention: as served (our kernel where it builds), torch's sdpa, or both, "
        "alternated prompt by prompt in this process (default: kernel)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=0,
        help="profile batched decoding instead: all the recipe's prompts through this many slots "
        "(plain, speculative, speculative, plain, as the eval runs them)",
    )
    parser.add_argument(
        "--forward",
        choices=["lean", "module", "both"],
        default="lean",
        help="the target's forward: as served (serve_eval.cpu.lean's walk where it applies), the model's own, "
        "or both, alternated prompt by prompt in this process (default: lean)",
    )
    args = parser.parse_args(argv)
    if args.attention == "both" and args.forward == "both":
        parser.error("--attention both and --forward both: one A/B at a time")
    if args.batch and (args.attention != "kernel" or args.forward != "lean" or args.batch < 1):
        parser.error("--batch: a batch size of 1 or more, with the served attention and forward")
    undo: list = []  # the timers come off when the profile ends (a caller's process keeps running)
    try:
        return _profile(args, undo)
    finally:
        for put_back in reversed(undo):
            put_back()


def _profile(args, undo: list) -> dict:  # noqa: PLR0912, PLR0915 the profile's steps, in order
    from distill.base.features import FeatureCapture
    from distill.models import load_target
    from distill.regenerate import encoded_prompts
    from distill.runtime import set_threads
    from recipes.evaluate import load_drafter
    from recipes.registry import load_recipe
    from serve_eval import loop, proposers, timing
    from serve_eval.budget import Budget, Calibration
    from serve_eval.cpu import CpuBackend
    from serve_eval.sampling import Sampler
    from serve_eval.session import TargetSession

    overrides = [f"{key}={value}" for key, value in given(args, CPU_FLAGS).items()]
    recipe = load_recipe(args.recipe, [f"drafter={args.drafter}", *overrides])
    max_new = args.max_new_tokens or recipe.decoding.max_new_tokens
    set_threads(recipe.decoding.torch_threads)
    target, tokenizer = load_target(recipe.target, "cpu")
    drafter = load_drafter(recipe.drafter, target, "cpu")
    prompts = encoded_prompts(
        recipe.prompts, recipe.data, recipe.seed, tokenizer, "cpu", recipe.target.chat_template_kwargs
    )[: None if args.batch else args.prompts]
    dec = recipe.decoding
    backend = CpuBackend(drafter, int8=dec.cpu.int8, prepack=dec.cpu.prepack, compile=dec.cpu.compile)
    backend.prepare(
        target, drafter, prompts, max_new, sampled=args.temperature > 0, rows=(args.batch,) if args.batch else ()
    )
    compiled = backend.compile
    if args.batch:
        return _profile_batch(
            args, target, drafter, prompts, dec.model_copy(update={"max_new_tokens": max_new}), undo, backend
        )
    served = target.config._attn_implementation  # the served attention (serve_eval.cpu.attention where it builds)
    drafters = {served: (drafter, backend)}
    if args.attention != "kernel" and served != "sdpa":  # the same drafter on sdpa (its graph traces what it calls)
        sdpa = load_drafter(recipe.drafter, target, "cpu")
        drafters["sdpa"] = sdpa, CpuBackend(sdpa, int8=dec.cpu.int8, prepack="off", compile=dec.cpu.compile)
        drafters["sdpa"][1].prepare(target, sdpa, prompts, max_new, sampled=args.temperature > 0)
    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    proposer_class = type(proposers.make_proposer(drafter))
    for name in ("propose", "observe"):
        _timed(proposer_class, name, f"proposer.{name}", totals, calls, undo)
    # compiled, the draft is one graph: timed as a whole
    if proposer_class is proposers.BlockProposer and compiled == "off":
        for name in ("decode", "propose"):
            for each, _ in drafters.values():
                _timed(each, name, f"  drafter.{name}", totals, calls, undo)
    for name in ("chain_length", "causal_length"):
        _timed(Budget, name, f"budget.{name}", totals, calls, undo)
    _timed(Calibration, "record_chain", "budget.record_chain", totals, calls, undo)
    speculating = [False]  # the target's session is timed in speculative decoding only
    for name, label in (("prefill", "target.prefill"), ("step", "target.verify"), ("keep", "target.keep")):
        _timed(TargetSession, name, label, totals, calls, undo, lambda: speculating[0])
    capture = FeatureCapture(target, drafter.config.target_layer_ids) if proposer_class.needs_features else None
    # each setting: a label -> (the target's attention, its forward: lean or the model's own)
    forwards = {"lean": ["lean"], "module": ["module"], "both": ["lean", "module"]}[args.forward]
    if len(forwards) > 1:
        variants = {forward: (served, forward) for forward in forwards}
    else:
        attentions = dict.fromkeys({"kernel": [served], "sdpa": ["sdpa"], "both": [served, "sdpa"]}[args.attention])
        variants = {attention: (attention, forwards[0]) for attention in attentions}
    settings = list(variants)

    def setting(label):  # the target as this setting serves it: its attention; the drafter and the backend it runs on
        target.config._attn_implementation = variants[label][0]
        each, served_by = drafters[variants[label][0]]
        return each, served_by if variants[label][1] == "lean" else served_by.with_lean(False)

    runs = {}
    for label in settings:  # each setting its own cost table
        _, served_by = setting(label)
        budget = Budget(
            timing.measure_verify_costs(
                target, timing.verify_sizes(drafter.config.block_size), capture, backend=served_by
            ),
            loop_offset=True,
        )
        runs[label] = {
            "budget": budget,
            "totals": collections.defaultdict(float),
            "calls": collections.Counter(),
            "plain_s": 0.0,
            "spec_s": 0.0,
            "plain_tokens": 0,
            "spec_tokens": 0,
            "steps": 0,
        }
    for i, prompt in enumerate(prompts):
        for label in settings[:: 1 if i % 2 else -1]:  # alternated, so that a drifting machine moves both alike
            run = runs[label]
            sampler = lambda: Sampler(temperature=args.temperature, generator=torch.Generator().manual_seed(i))  # noqa: E731, B023  (called within the iteration)
            each, served_by = setting(label)
            _, plain = loop.plain_generate(target, prompt, max_new, None, sampler(), backend=served_by)
            speculating[0] = True
            _, spec = loop.speculative_generate(
                target,
                each,
                prompt,
                max_new,
                None,
                sampler(),
                backend=served_by,  # the warm-up
                budget=run["budget"] if i else None,
            )  # without the budget: first calls are slow
            speculating[0] = False
            if i:  # after the warm-up
                for key, value in totals.items():
                    run["totals"][key] += value
                run["calls"].update(calls)
                run["plain_s"] += plain.total_seconds
                run["plain_tokens"] += plain.tokens
                run["spec_s"] += spec.total_seconds
                run["spec_tokens"] += spec.tokens
                run["steps"] += spec.target_forwards - 1
            totals.clear()
            calls.clear()
    target.config._attn_implementation = served
    reports = {
        label: _report(
            run,
            f"{args.prompts - 1} prompts after a warm-up, T = {args.temperature}, "
            f"attention {variants[label][0]}, forward {variants[label][1]}",
        )
        for label, run in runs.items()
    }
    if len(reports) > 1:
        a, b = reports.values()
        print(
            f"speedup {' / '.join(settings)}: {a['speedup']:.3f} / {b['speedup']:.3f}; plain step {' / '.join(settings)}: "
            f"{a['plain_step_ms'] / b['plain_step_ms']:.3f}, speculative step {a['spec_step_ms'] / b['spec_step_ms']:.3f}"
        )
    return reports[settings[0]]


def _profile_batch(args, target, drafter, prompts, dec, undo: list, backend) -> dict:
    """``--batch B``: where batched decoding's time goes, as the eval measures it (:func:`serve_eval.measure.
    measure_batches`, with a calibration lent by one-row runs of the same prompts first, untimed): each
    loop's prefills (the waiting prompts' groups), its target steps, the draft and the scheduler's
    choice, per speculative step, and the speculative steps by the number of rows they ran with (the
    tail, as rows finish apart)."""
    from distill.base.features import FeatureCapture
    from serve_eval import loop, measure, timing
    from serve_eval.budget import Budget, Calibration
    from serve_eval.proposers import BlockProposer
    from serve_eval.sampling import Sampler
    from serve_eval.session import TargetSession

    sampler = lambda i: Sampler(temperature=args.temperature, generator=torch.Generator().manual_seed(i))  # noqa: E731
    calibration = Calibration()  # lent to the batches, as the eval lends its one-row run's
    capture = FeatureCapture(target, drafter.config.target_layer_ids)
    budget = Budget(
        timing.measure_verify_costs(target, timing.verify_sizes(drafter.config.block_size), capture, backend=backend),
        calibration=calibration,
    )
    for i, prompt in enumerate(prompts):
        loop.speculative_generate(
            target, drafter, prompt, dec.max_new_tokens, None, sampler(i), budget=budget, backend=backend
        )
    running = [None]  # "plain" or "speculative" while a timed run decodes
    totals: dict[tuple[str, str], float] = collections.defaultdict(float)  # (loop, part) -> seconds
    calls: collections.Counter = collections.Counter()
    by_rows: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])  # rows -> tokens, seconds, steps
    active = lambda: running[0] is not None  # noqa: E731
    for obj, name, part in (
        (TargetSession, "prefill", "prefills"),
        (TargetSession, "step", "target steps"),
        (BlockProposer, "propose", "draft"),
        (Budget, "choose_rows", "scheduler.choose"),
    ):
        _timed(obj, name, lambda *_, part=part: (running[0], part), totals, calls, undo, active)

    inner = measure.generate  # a whole run (plain without a proposer), and the flag that lets the part timers count
    undo.append(lambda: setattr(measure, "generate", inner))

    def run(*a, **k):
        kind = "speculative" if (len(a) > 5 and a[5] is not None) or k.get("proposer") is not None else "plain"
        running[0] = kind
        try:
            start = time.perf_counter()
            out = inner(*a, **k)
            totals[kind, "run"] += time.perf_counter() - start
            calls[kind, "run"] += 1
            return out
        finally:
            running[0] = None

    measure.generate = run
    record = Budget.record_step
    undo.append(lambda: setattr(Budget, "record_step", record))

    def counted(self, rows, drafted, kept, seconds):
        cell = by_rows[rows]
        cell[0], cell[1], cell[2] = cell[0] + kept + rows, cell[1] + seconds, cell[2] + 1
        return record(self, rows, drafted, kept, seconds)

    Budget.record_step = counted

    row = measure.measure_batches(target, drafter, prompts, dec, None, sampler, [args.batch], calibration, backend)[0]

    def per(kind, part, count="run"):  # seconds of `part` per run (or per call of `count`) of one loop
        return totals[kind, part] / max(1, calls[kind, count])

    parts = {
        part: round(1e3 * per("speculative", part, "target steps"), 3)
        for part in ("target steps", "draft", "scheduler.choose")
    }
    parts["the rest (the loop's own work)"] = round(
        1e3
        * (totals["speculative", "run"] - totals["speculative", "prefills"])
        / max(1, calls["speculative", "target steps"])
        - sum(parts.values()),
        3,
    )
    report = {
        "batch": args.batch,
        "prompts": len(prompts),
        "speedup": row["speedup"],
        "tau": row["tau"],
        "plain_s": round(per("plain", "run"), 3),
        "spec_s": round(per("speculative", "run"), 3),
        "prefills_s": {kind: round(per(kind, "prefills"), 3) for kind in ("plain", "speculative")},
        "plain_step_ms": round(1e3 * per("plain", "target steps", "target steps"), 3),
        "ms_per_spec_step": parts,
        "by_rows": {
            rows: {"steps": cell[2], "tokens_per_s": round(cell[0] / cell[1], 1) if cell[1] else 0.0}
            for rows, cell in sorted(by_rows.items())
        },
    }
    print(
        f"batch {args.batch} ({len(prompts)} prompts, {args.batch} slots, T = {args.temperature}): a run "
        f"{report['plain_s']:.3f} s plain, {report['spec_s']:.3f} s speculative; speedup {row['speedup']:.3f} (tau {row['tau']:.3f} a row)"
    )
    print(
        f"  prefills a run: plain {report['prefills_s']['plain']:.3f} s, speculative {report['prefills_s']['speculative']:.3f} s; "
        f"a plain step {report['plain_step_ms']:.3f} ms"
    )
    for label, ms in parts.items():
        print(f"  {label:30s} {ms:7.3f} ms a speculative step = {ms / report['plain_step_ms']:.3f} plain steps")
    for rows, cell in report["by_rows"].items():
        print(f"  speculative steps of {rows} rows: {cell['steps']:5d}, {cell['tokens_per_s']:8.1f} tokens/s")
    return report


if __name__ == "__main__":
    main()
