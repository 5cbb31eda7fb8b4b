"""The target's Linears on the panel kernel against this core's limits, by the rows a call multiplies.

    python -m recipes.bench_linears [--recipe recipes/configs/eval_testbed.yaml] [--rows 1 2 4 6 8 12 16 24] [--repeats 15]

Every step of a decoding loop multiplies each of the target's weights by a few rows: one in plain
decoding, the bonus and the drafts in a verify (3-9 on the testbed), each row's in a batch. Each row
count's time is one pass over the target's Linears in their forward order, each with its own weight as
a forward reads them (:mod:`serve_eval.cpu.prepack`'s panels, fp16 where the values allow), the counts
alternated round by round (:func:`serve_eval.timing.interleaved_seconds`, medians), on 1 thread. Two
limits frame it:

* arithmetic: ``2 rows sum(in x out)`` FLOPs against this machine's measured fp32 matmul peak
  (:func:`distill.perf.measured_matmul_peak`, torch's own 2,048^3 product on 1 thread);
* the weights' trip: the panels' bytes against the rate at which this core reads a buffer of that size
  again and again (``x.sum()``, in the same rounds: the L3 where the panels fit it, memory where not).

A pass that reaches neither leaves time on the table; the printed fractions say which limit is near.
A benchmark: run it on an otherwise idle core (``taskset -c 1``).
"""

from __future__ import annotations

import argparse
import functools

import torch


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/configs/eval_testbed.yaml", help="an eval recipe: its target")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 24])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.repeats < 1:
        parser.error("--rows and --repeats take positive numbers")

    from distill.models import load_target
    from distill.perf import measured_matmul_peak
    from recipes.registry import load_recipe
    from serve_eval.cpu import prepack
    from serve_eval.timing import interleaved_seconds

    if not prepack.panels_available():
        parser.exit(
            2, "bench_linears: the panel kernel does not build here (it needs an x86 CPU with AVX2 and a compiler)\n"
        )
    recipe = load_recipe(args.recipe, [])
    torch.set_num_threads(1)
    target, _ = load_target(recipe.target, "cpu")
    packed = prepack.prepack_linears(target, "panels")
    linears = [m for m in target.modules() if isinstance(m, prepack.PrepackedLinear)]
    flops_per_row = 2 * sum(m.in_features * m.out_features for m in linears)
    g = torch.Generator().manual_seed(0)
    inputs = {n: [torch.randn(n, m.in_features, generator=g) for m in linears] for n in args.rows}

    @torch.inference_mode()
    def one_pass(n: int) -> None:
        for linear, x in zip(linears, inputs[n]):
            linear(x)

    buffer = torch.ones(packed["panel_bytes"] // 4)  # the panels' size in fp32
    runs = {n: (functools.partial(one_pass, n), None) for n in args.rows} | {"read": (buffer.sum, None)}
    seconds = interleaved_seconds(runs, args.repeats, "cpu")
    peak, read = measured_matmul_peak("cpu", torch.float32, 1), packed["panel_bytes"] / seconds["read"]
    print(
        f"{len(linears)} Linears, {packed['panel_bytes'] / 2**20:.1f} MB of panels ({packed['fp16_panels']} in fp16); "
        f"this core: fp32 matmul peak {peak / 1e9:.1f} GFLOP/s, reads the panels' size at {read / 1e9:.1f} GB/s"
    )
    rows = []
    for n in args.rows:
        t = seconds[n]
        rows.append(
            {
                "rows": n,
                "ms": round(1e3 * t, 3),
                "gflops": round(n * flops_per_row / t / 1e9, 2),
                "of_peak": round(n * flops_per_row / t / peak, 3),
                "gbytes_s": round(packed["panel_bytes"] / t / 1e9, 2),
                "of_read": round(packed["panel_bytes"] / t / read, 3),
                "per_row_ms": round(1e3 * t / n, 3),
            }
        )
        r = rows[-1]
        print(
            f"{n:3d} rows: {r['ms']:.3f} ms ({r['per_row_ms']:.3f} a row), {r['gflops']:.1f} GFLOP/s = {r['of_peak']:.2f} of the peak, "
            f"weights at {r['gbytes_s']:.1f} GB/s = {r['of_read']:.2f} of the read rate"
        )
    return rows


if __name__ == "__main__":
    main()
