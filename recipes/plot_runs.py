"""Plot an evaluation metric of several training runs against training time or tokens.

    python -m recipes.plot_runs runs/abl/* --metric val_simulated_tau --x minutes --out runs/abl/convergence.png

Reads each run's ``metrics.jsonl`` (evaluation records carry ``train_seconds`` and ``tokens_seen``;
older runs without them are placed by step x the run's mean step time from ``summary.json``) and
prints the final value per run as a table, best first.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run: Path, metric: str, x: str) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    per_step = summary.get("train_seconds", 0) / max(1, summary.get("steps", 1))
    points = []
    for r in rows:
        if metric not in r:
            continue
        seconds = r.get("train_seconds", r["step"] * per_step)
        points.append(
            (seconds / 60 if x == "minutes" else r.get("tokens_seen", 0) if x == "tokens" else r["step"], r[metric])
        )
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--metric", default="val_simulated_tau")
    parser.add_argument("--x", choices=["minutes", "tokens", "step"], default="minutes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default=None)
    args = parser.parse_args()

    from recipes.plots import saved_figure

    runs = [r for r in args.runs if (r / "metrics.jsonl").exists()]
    finals = []
    with saved_figure(args.out) as (_, ax):
        for run in runs:
            pts = curve(run, args.metric, args.x)
            if pts:
                ax.plot(*zip(*pts), "o-", ms=3, label=run.name)
                finals.append((run.name, pts[-1][1], max(p[1] for p in pts), pts[-1][0]))
        ax.set_xlabel({"minutes": "training CPU minutes (wall)", "tokens": "training tokens", "step": "step"}[args.x])
        ax.set_ylabel(args.metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(args.title or f"{args.metric} against {args.x}", fontsize=9)
    print(f"{'run':<32} {'final':>8} {'best':>8} {args.x:>8}")
    for name, final, best, at in sorted(finals, key=lambda f: -f[1]):
        print(f"{name:<32} {final:>8.3f} {best:>8.3f} {at:>8.1f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
