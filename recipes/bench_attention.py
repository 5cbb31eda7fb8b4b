"""Attention for the few queries of a step: our kernel against torch's, one process, alternated.

    python -m recipes.bench_attention [--heads 5] [--head-dim 64] [--context 205] [--layers 8] [--queries 1 5 8]

For the testbed target's shapes (5 heads of 64, 8 layers) and a cache of ``--context`` positions held
in buffers of a longer capacity (as the loop's KV cache holds them): the median time of one forward's
``--layers`` attention calls, each layer its own cache, causal mask for more than one query, torch's
``scaled_dot_product_attention`` (its flash kernel for the CPU) against ``draftsmith_attn::attention``
(:mod:`serve_eval.cpu.attention`), alternated call by call (medians: :func:`serve_eval.timing.
interleaved_seconds`). ``cold``: a 64 MB buffer is streamed before each timed forward, so the caches
are read from memory as after the target's weights streamed through (the loop's case); ``warm``:
back to back. 1 thread; a benchmark: run it on an otherwise idle
core (``taskset -c 1``).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=5)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--context", type=int, default=205)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 5, 8])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)

    from serve_eval.cpu import attention
    from serve_eval.timing import interleaved_seconds

    if not attention.available():
        parser.exit(
            2, "bench_attention: the C++ attention operator does not build here (it needs AVX2 and a compiler)\n"
        )
    torch.set_num_threads(1)
    H, D, L = args.heads, args.head_dim, args.context
    g = torch.Generator().manual_seed(0)
    caches = [
        (torch.randn(1, H, 2 * L, D, generator=g), torch.randn(1, H, 2 * L, D, generator=g)) for _ in range(args.layers)
    ]
    stream = torch.zeros(16 * 1024 * 1024)
    rows = []
    with torch.inference_mode():
        for n in args.queries:
            queries = [torch.randn(1, n, H, D, generator=g).transpose(1, 2) for _ in range(args.layers)]
            mask = torch.ones(n, L, dtype=torch.bool).tril(L - n)[None, None] if n > 1 else None
            kernels = {  # the lambdas run within this iteration, with its mask
                "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),  # noqa: B023
                "ours": lambda q, k, v: torch.ops.draftsmith_attn.attention(q, k, v, mask, D**-0.5),  # noqa: B023
            }
            forward = lambda kernel: [kernel(q, k[:, :, :L], v[:, :, :L]) for q, (k, v) in zip(queries, caches)]  # noqa: E731, B023
            for cold in (False, True):  # cold: the stream runs (untimed) after each forward, so before the next
                after = (lambda: stream.add_(1.0)) if cold else None
                seconds = interleaved_seconds(
                    {name: (functools.partial(forward, kernel), after) for name, kernel in kernels.items()},
                    args.repeats,
                    "cpu",
                )
                ms = {name: 1e3 * t for name, t in seconds.items()}
                rows.append(
                    {
                        "queries": n,
                        "cache": "cold" if cold else "warm",
                        **{k: round(v, 3) for k, v in ms.items()},
                        "ours / sdpa": round(ms["ours"] / ms["sdpa"], 3),
                    }
                )
                print(
                    f"{n:2d} queries, {rows[-1]['cache']}: sdpa {ms['sdpa']:.3f} ms, ours {ms['ours']:.3f} ms "
                    f"({rows[-1]['ours / sdpa']:.3f}x) for {args.layers} layers of {H} heads x {D}, {L} positions"
                )
    return rows


if __name__ == "__main__":
    main()
