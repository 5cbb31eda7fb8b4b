"""The one plotting helper every recipe's picture goes through.

``with saved_figure(path) as (fig, ax): ...`` draws on a matplotlib figure (the Agg backend: no
display needed) and, when the block ends without an error, lays it out and writes it to ``path``
under a temporary name first, then renames it: a crash never leaves half a PNG behind.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def saved_figure(path: str | os.PathLike, figsize: tuple[float, float] = (6.4, 4), dpi: int = 120):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=figsize, dpi=dpi)
    try:
        yield fig, ax
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)


def plot_recurrence_curve(rows: list[dict], path: Path, mean_recurrence: int, title: str = "") -> None:
    """Parcae: held-out perplexity against the number of recurrences (log-x), the training mean marked
    (rows from :func:`parcae.training.curve_rows`)."""
    ts = [r["recurrence"] for r in rows]
    with saved_figure(path, figsize=(5, 3.5)) as (_, ax):
        ax.plot(ts, [r["val_ppl"] for r in rows], marker="o")
        ax.axvline(mean_recurrence, color="gray", linestyle=":", label=f"training mean T = {mean_recurrence}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts, [str(t) for t in ts])
        ax.set_xlabel("recurrences T at test time")
        ax.set_ylabel("held-out perplexity")
        ax.set_title(title or "Parcae: test-time compute")
        ax.legend()
