"""Host reads a decoding step (:mod:`serve_eval.syncs`) of each backend, in each mode, greedy and sampled.

    python -m recipes.bench_syncs [--backends torch cpu static] [--drafter distill/assets/testbed_dflash]

The shipped testbed target and a shipped drafter over held-out stdlib prompts of 48 tokens: a chain of
every draft, a tree of 8 nodes, four rows of chains, and plain decoding, each at T = 0 and T = 1, counted
in the steady state (runs of 24 and 48 new tokens: :func:`serve_eval.syncs.syncs_per_step`). The static
backend runs eagerly here (``compile: off``): a compiled graph reads nothing on the host either way. Counts,
not times: any machine gives the same table.
"""

from __future__ import annotations

import argparse

import torch

MODES = {"chain": ("chain", 1), "tree of 8": ("tree", 1), "4 rows, chains": ("chain", 4), "plain": (None, 1)}


def main(argv: list[str] | None = None) -> dict:
    from distill.config import DataConfig, TargetConfig
    from distill.data import load_text_splits
    from distill.models import load_target
    from recipes.evaluate import load_drafter
    from serve_eval.backend import backend_for
    from serve_eval.loop import generate
    from serve_eval.proposers import make_proposer
    from serve_eval.sampling import Sampler
    from serve_eval.static import StaticBackend
    from serve_eval.syncs import syncs_per_step

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["torch", "cpu", "static"], choices=["torch", "cpu", "static"])
    parser.add_argument("--drafter", default="distill/assets/testbed_dflash")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target, tok = load_target(TargetConfig(path="testbed"))
    docs = load_text_splits(DataConfig(source="stdlib", max_documents=40, val_fraction=0.1)).val
    prompts = [torch.tensor(tok(doc[i * 300 : i * 300 + 400])["input_ids"][:48]) for i, doc in enumerate(docs[:4])]
    table: dict = {}
    for name in args.backends:
        drafter = load_drafter(args.drafter, target, "cpu")  # each backend prepares its own (in place)
        backend = StaticBackend(compile="off") if name == "static" else backend_for(name, "cpu", drafter)
        backend.prepare(target, drafter, prompts, 48, sampled=True, rows=(4,))
        for label, (mode, rows) in MODES.items():
            for temperature in (0.0, 1.0):

                def run(n: int, mode=mode, rows=rows, temperature=temperature, backend=backend, drafter=drafter) -> int:
                    gens = [torch.Generator().manual_seed(r) for r in range(rows)]
                    samplers = [Sampler(temperature=temperature, generator=g) for g in gens]
                    proposer = None if mode is None else make_proposer(drafter, backend=backend)
                    _, stats = generate(
                        target, prompts[:rows], n, None, samplers, proposer, mode=mode or "chain", tree_budget=8,
                        backend=backend,
                    )  # fmt: skip
                    return stats.steps

                table.setdefault(label, {}).setdefault(name, []).append(round(syncs_per_step(run, 24), 2))
    print(f"| mode | {' | '.join(f'`{b}`' for b in args.backends)} |")
    print(f"|---|{'---|' * len(args.backends)}")
    for label, row in table.items():
        print(f"| {label} | {' | '.join(' / '.join(map(str, row[b])) for b in args.backends)} |")
    return table


if __name__ == "__main__":
    main()
