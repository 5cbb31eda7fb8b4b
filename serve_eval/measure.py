"""The measurements an eval report holds: speculative against plain decoding of the same prompts, one
row at a time (:func:`measure`) and in batches (:func:`measure_batches`), with the same samplers and KV
cache on both sides, so that speedups compare like with like."""

from __future__ import annotations

import copy

import torch

from distill.base.features import FeatureCapture

from .backend import TORCH, Backend
from .budget import Budget, Calibration, up_front_margin
from .kv import kv_quant
from .loop import GenerationStats, generate
from .proposers import BlockProposer, make_proposer
from .syncs import syncs_per_step
from .timing import measure_draft_seconds, measure_verify_costs, verify_sizes


def served_record(
    index: int, prompt, emitted: list[int], eos: int | None, stats: GenerationStats, temperature: float
) -> dict:
    """What the loop served for one prompt, in :mod:`distill.regenerate`'s record form (the exact tokens
    read and emitted: the loop is lossless, so these are the target's own answers, and a drafter recipe
    trains on them as on regenerated data), with the acceptance it measured."""
    ended = bool(emitted) and emitted[-1] == eos
    return {
        "id": index,
        "prompt_ids": prompt.view(-1).tolist(),
        "response_ids": emitted[:-1] if ended else emitted,
        "eos": ended,
        "temperature": temperature,
        "tau": round(stats.tau, 4),
        "accepted_by_position": stats.accepted_by_position,
        "drafted_by_position": stats.drafted_by_position,
    }


def summarize(per_prompt: list[dict]) -> dict:
    """A group of :func:`measure`'s per-prompt rows as one measurement: tau (tokens per target forward),
    acceptance by draft position, tokens/s of both loops and their ratio, losslessness (None when
    sampled), each from the group's totals."""
    total = lambda key: sum(row[key] for row in per_prompt)  # noqa: E731
    accepted = [sum(col) for col in zip(*(row["accepted_by_position"] for row in per_prompt))]
    drafted = [sum(col) for col in zip(*(row["drafted_by_position"] for row in per_prompt))]
    tokens_per_s = total("tokens") / total("seconds")
    baseline_tokens_per_s = total("baseline_tokens") / total("baseline_seconds")
    same = [row["lossless"] for row in per_prompt]
    return {
        "prompts": len(per_prompt),
        "tokens": total("tokens"),
        "tau": round(total("tokens") / max(1, total("forwards")), 4),
        "acceptance_by_position": [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)],
        "tokens_per_s": round(tokens_per_s, 2),
        "baseline_tokens_per_s": round(baseline_tokens_per_s, 2),
        "speedup": round(tokens_per_s / baseline_tokens_per_s, 4),
        "lossless": None if None in same else all(same),
    }


@torch.inference_mode()
def first_divergence(target, prompt: torch.Tensor, base: list[int], ours: list[int]) -> dict:
    """Where ``ours`` first departs from ``base`` (plain decoding's tokens of ``prompt``), and the target's
    margin between its two largest logits there, computed afresh by one forward over the prompt and the
    tokens both agree on: near the dtype's resolution, the two decodings met a tie that rounding broke
    differently (a K-token verify and a 1-token step use different kernels); far above it, a bug."""
    at = next((i for i, (a, b) in enumerate(zip(base, ours)) if a != b), min(len(base), len(ours)))
    ids = torch.cat([prompt.view(-1), torch.tensor(base[:at], dtype=torch.long, device=prompt.device)])[None]
    logits = target(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2).values
    dtype = next(target.parameters()).dtype
    return {
        "token": at,
        "top2_margin": float(top[0] - top[1]),
        "resolution": float(torch.finfo(dtype).eps * top[0].abs()),  # one unit in the last place, at the top logit
    }


def comparison(per_prompt: list[dict], divergences: list[dict], device, dtype: torch.dtype) -> dict | None:
    """How the report compared speculative with plain decoding (greedy runs; None when sampled): exact
    equality of the tokens in float32 on the CPU, where both loops compute every position alike up to
    rounding that never reaches a greedy choice; elsewhere (bf16 on a GPU) the share of prompts whose tokens
    equal plain decoding's in the same dtype and, for each one that differs, :func:`first_divergence`."""
    same = [row["lossless"] for row in per_prompt]
    if None in same:
        return None
    exact = torch.device(device).type == "cpu" and dtype == torch.float32
    return {
        "method": "exact" if exact else "same dtype",
        "dtype": str(dtype).removeprefix("torch."),
        "equal_fraction": round(sum(same) / len(same), 4),
        "divergences": divergences,
    }


def count_host_syncs(target, drafter, prompt, dec, sampler, budget, budget_nodes, kv, backend: Backend) -> dict:
    """Host reads per step of plain and of speculative decoding of ``prompt`` in the steady state
    (:func:`serve_eval.syncs.syncs_per_step`), with the run's settings (a copy of its budget)."""

    def run(speculative: bool):
        def steps(n: int) -> int:
            proposer = _new_proposer(drafter, dec, backend) if speculative else None
            _, r = generate(
                target,
                [prompt],
                n,
                None,
                [sampler(0)],
                proposer,
                budget=copy.deepcopy(budget) if speculative else None,
                mode=dec.mode,
                tree_budget=budget_nodes or 1,
                lookup=dec.lookup.tokens if speculative else 0,
                kv=kv,
                verify_drafts=dec.budget.verify_drafts,
                backend=backend,
            )
            return r.steps

        return steps

    return {name: round(syncs_per_step(run(name == "speculative")), 2) for name in ("speculative", "plain")}


def _new_proposer(drafter, dec, backend: Backend):
    d = dec.drafter
    return make_proposer(
        drafter, d.confidence_threshold, d.draft_length, d.draft_recurrence, d.parallel_drafts, backend
    )


def measure(  # noqa: PLR0915 the report's parts, in order
    target,
    drafter,
    encoded,
    dec,
    eos,
    sampler,
    budget_nodes,
    calibration: Calibration | None = None,
    served: list | None = None,
    backend: Backend = TORCH,
) -> dict:
    """Plain and speculative decoding of every prompt, back to back, as ``dec`` (a
    :class:`~distill.config.DecodingSection`) says; ``sampler(i)`` gives prompt i's sampler (the same seeds
    for both loops). ``calibration``: the acceptance calibration the run's budget shares (and extends).
    ``served``: a list that gets, per prompt, what the loop served (:func:`served_record`). ``backend``:
    how both loops run the target (:mod:`serve_eval.backend`)."""
    probe = _new_proposer(drafter, dec, backend)
    K = probe.block_size
    kv = kv_quant(dec.kv.format, dec.kv.rotate)
    budget = None
    if dec.budget.adaptive:  # one cost table and one acceptance calibration for the whole run
        largest = ((budget_nodes or 1) + 1 if dec.mode == "tree" else K) + dec.lookup.tokens
        capture = FeatureCapture(target, probe.target_layer_ids) if probe.needs_features else None
        budget = Budget(
            measure_verify_costs(target, verify_sizes(largest), capture, kv=kv, backend=backend),
            calibration=calibration,
            loop_offset=True,
        )
    totals = {
        "tokens": 0,
        "forwards": 0,
        "spec_s": 0.0,
        "base_tokens": 0,
        "base_s": 0.0,
        "draft_s": 0.0,
        "verify_s": 0.0,
        "sd_tokens": 0,
        "sd_forwards": 0,
        "sd_s": 0.0,
    }
    per_prompt, verify_ms, divergences = [], [], []
    speculation = None
    if dec.ssd.enabled:
        from .ssd import open_speculation, ssd_generate, ssd_report  # (ssd plugs into the loop: imported when used)

        speculation = open_speculation(
            _new_proposer(drafter, dec, backend), dec.ssd.branches, dec.ssd.exponent, dec.ssd.backup, dec.ssd.concurrent
        )
    try:
        for i, prompt in enumerate(encoded):
            base_outs, base_run = generate(
                target, [prompt], dec.max_new_tokens, eos, [sampler(i)], kv=kv, backend=backend
            )
            base, base_stats = base_outs[0], base_run.prompts[0]
            outs, run = generate(
                target,
                [prompt],
                dec.max_new_tokens,
                eos,
                [sampler(i)],
                _new_proposer(drafter, dec, backend),
                budget=budget,
                mode=dec.mode,
                tree_budget=budget_nodes or 1,
                lookup=dec.lookup.tokens,
                kv=kv,
                verify_drafts=dec.budget.verify_drafts,
                backend=backend,
            )
            ours, stats = outs[0], run.prompts[0]
            if speculation is not None:  # plain speculative decoding above; speculative speculation here
                totals["sd_tokens"] += stats.tokens
                totals["sd_forwards"] += stats.target_forwards
                totals["sd_s"] += stats.total_seconds
                sd_same = ours == base
                loop = sampler(i)
                seed = (loop.generator.initial_seed() if loop.generator is not None else i) + 2**32  # the drafter's own
                ours, stats, steps_ms = ssd_generate(
                    target, speculation, prompt, dec.max_new_tokens, eos, loop, seed, kv, backend
                )
                verify_ms += steps_ms
            same = ours == base if dec.temperature == 0 else None  # sampled outputs differ draw by draw
            if speculation is not None and same is not None:
                same = same and sd_same
            if same is False:
                divergences.append({"prompt": i, **first_divergence(target, prompt, base, ours)})
            totals["tokens"] += stats.tokens
            totals["forwards"] += stats.target_forwards
            totals["spec_s"] += stats.total_seconds
            totals["draft_s"] += stats.draft_seconds
            totals["verify_s"] += stats.verify_seconds
            totals["base_tokens"] += base_stats.tokens
            totals["base_s"] += base_stats.total_seconds
            if served is not None:
                served.append(served_record(i, prompt, ours, eos, stats, dec.temperature))
            per_prompt.append(
                {
                    "prompt": i,
                    "tokens": stats.tokens,
                    "tau": round(stats.tau, 4),
                    "lossless": same,
                    "speedup": round(
                        (stats.tokens / stats.total_seconds) / (base_stats.tokens / base_stats.total_seconds), 4
                    ),
                    # what summarize() adds up over any group of prompts (a set, a category)
                    "forwards": stats.target_forwards,
                    "seconds": round(stats.total_seconds, 6),
                    "baseline_tokens": base_stats.tokens,
                    "baseline_seconds": round(base_stats.total_seconds, 6),
                    "accepted_by_position": stats.accepted_by_position,
                    "drafted_by_position": stats.drafted_by_position,
                }
            )
        ssd = None if speculation is None else ssd_report(speculation, totals, verify_ms, len(encoded))
    finally:
        if speculation is not None:
            speculation.close()
    adaptive = None
    if budget is not None:  # the cost model's prediction beside what the steps measured (prefill excluded)
        adaptive = budget.summary()
        steps = totals["forwards"] - len(encoded)
        adaptive["measured"] = {
            "tau": round((totals["tokens"] - len(encoded)) / max(1, steps), 4),
            "step_ms": round(1e3 * (totals["draft_s"] + totals["verify_s"]) / max(1, steps), 3),
        }
        adaptive["measured"]["tokens_per_s"] = round(
            1e3 * adaptive["measured"]["tau"] / max(adaptive["measured"]["step_ms"], 1e-9), 2
        )
    return {
        "tree_budget": budget_nodes,
        "adaptive": adaptive,
        **summarize(per_prompt),
        "comparison": comparison(per_prompt, divergences, prompt.device, next(target.parameters()).dtype),
        "host_syncs_per_step": count_host_syncs(
            target, drafter, encoded[0], dec, sampler, budget, budget_nodes, kv, backend
        ),
        "time_split": {
            "draft_s": round(totals["draft_s"], 3),
            "verify_s": round(totals["verify_s"], 3),
            "other_s": round(totals["spec_s"] - totals["draft_s"] - totals["verify_s"], 3),
            "draft_fraction": round(totals["draft_s"] / totals["spec_s"], 4),
            "verify_fraction": round(totals["verify_s"] / totals["spec_s"], 4),
        },
        "per_prompt": per_prompt,
        **({"ssd": ssd} if ssd is not None else {}),
    }


def measure_batches(
    target,
    drafter,
    encoded,
    dec,
    eos,
    sampler,
    batch_sizes: list[int],
    calibration: Calibration | None = None,
    backend: Backend = TORCH,
) -> list[dict]:
    """Plain and speculative decoding of all the prompts at most ``B`` rows at a time for each batch size
    ``B`` (waiting prompts taking the places of rows that finish), in the order plain, speculative,
    speculative, plain, ``dec.batches.rounds`` times (a machine that drifts moves both sides alike);
    ``sampler(i)``: prompt i's sampler. One acceptance calibration (``calibration``: e.g. a one-row run's,
    which learns on every step) and one one-row cost table serve every batch size; each has its own
    measured batched steps, drafting cost and off switch, and is judged before it drafts at all: below
    its margin (:func:`~serve_eval.budget.up_front_margin`) it decodes plainly."""
    probe = _new_proposer(drafter, dec, backend)
    K = probe.block_size
    kv = kv_quant(dec.kv.format, dec.kv.rotate)
    capture = FeatureCapture(target, probe.target_layer_ids) if probe.needs_features else None
    shared = calibration or Calibration()
    table = (
        measure_verify_costs(target, verify_sizes(max(batch_sizes) * K), capture, kv=kv, backend=backend)
        if dec.budget.adaptive
        else None
    )
    tree_budget = dec.tree_budgets[0] if dec.mode == "tree" else 16
    rows = []
    prompts, samplers = list(encoded), lambda: [sampler(i) for i in range(len(encoded))]  # noqa: E731
    for B in batch_sizes:
        budget = None
        if table is not None:  # the batched step's own cost at this size, over a cache about the mean's length
            context = sum(map(len, prompts)) // len(prompts) + dec.max_new_tokens * 3 // 4
            steps = measure_verify_costs(
                target, range(1, K + 1), capture, context=context, kv=kv, rows=B, plain=True, backend=backend
            )
            budget = Budget(table, calibration=shared, step_seconds=steps, rows=B, min_drafts=1 if calibration else 8)
            if isinstance(probe, BlockProposer):  # a block drafter: its draft timed at B rows
                budget.costs.seed_drafting(B, measure_draft_seconds(drafter, B, backend=backend))
            budget.predicted = budget.predicted_speedup(B, K - 1)
            if calibration is not None:  # a calibrated prediction: below the margin drafting would not pay here
                budget.margin = up_front_margin(len(prompts), B, sampled=dec.temperature > 0)
                budget.off = budget.predicted < budget.margin

        def plain(B=B):
            return generate(target, prompts, dec.max_new_tokens, eos, samplers(), kv=kv, slots=B, backend=backend)

        def speculative(B=B, budget=budget):
            if budget is not None and budget.off:  # speculation off: the loop is plain decoding
                return plain()
            return generate(
                target,
                prompts,
                dec.max_new_tokens,
                eos,
                samplers(),
                _new_proposer(drafter, dec, backend),
                budget=budget,
                mode=dec.mode,
                tree_budget=tree_budget,
                lookup=dec.lookup.tokens,
                kv=kv,
                slots=B,
                verify_drafts=dec.budget.verify_drafts,
                backend=backend,
            )

        graph = backend.draft_graph(drafter)
        graph_before = graph.calls if graph else 0
        outs, spec, base = [], [], []  # every run's tokens; speculative and plain runs' stats in time order
        for _ in range(dec.batches.rounds):
            for kind, run in (("plain", plain), ("spec", speculative), ("spec", speculative), ("plain", plain)):
                out, run_stats = run()
                outs.append(out)
                (spec if kind == "spec" else base).append(run_stats)
        tokens_per_s = sum(s.tokens for s in spec) / sum(s.seconds for s in spec)
        baseline = sum(s.tokens for s in base) / sum(s.seconds for s in base)
        # half k pairs speculative run k with the plain run on its side of the round (first with first)
        halves = [(s.tokens / s.seconds) / (b.tokens / b.seconds) for s, b in zip(spec, base)]
        rows.append(
            {
                "batch": B,
                "prompts": len(prompts),
                "rounds": dec.batches.rounds,
                "tau": round(
                    sum(s.tokens for s in spec) / sum(s.row_steps + len(prompts) for s in spec), 4
                ),  # each prefill reads its row once
                "tokens_per_s": round(tokens_per_s, 2),
                "baseline_tokens_per_s": round(baseline, 2),
                "speedup": round(tokens_per_s / baseline, 4),
                "speedup_halves": [round(h, 4) for h in halves],
                "lossless": all(o == outs[0] for o in outs) if dec.temperature == 0 else None,
                "scheduler": None if budget is None else budget.batch_summary(B),
                **({"graph_drafts": graph.calls - graph_before} if graph else {}),
            }
        )  # drafts the compiled graph made
    return rows
