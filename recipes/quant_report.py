"""The full / PTQ / QAT report a quantize or training recipe writes: JSON, a markdown table and a plot."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from recipes.plots import saved_figure


def recovered(full: float | None, ptq_value: float | None, qat_value: float | None) -> float | None:
    """(QAT - PTQ) / (full - PTQ): the share of the quantization gap QAT wins back; None without a gap."""
    if None in (full, ptq_value, qat_value) or full == ptq_value:
        return None
    return (qat_value - ptq_value) / (full - ptq_value)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def quant_report(
    rows: list[dict],
    out_dir: str | Path,
    metric: str,
    columns: list[str],
    title: str,
    summary: list[dict] | None = None,
) -> dict:
    """Write ``quant_report.json``, ``quant_report.md`` and, for several variants, ``quant_report.png``
    (the primary metric against packed bytes) into ``out_dir``; return the report."""
    from distill.provenance import write_json_atomic

    out = Path(out_dir)
    report = {"title": title, "metric": metric, "rows": rows, "summary": summary or []}
    write_json_atomic(out / "quant_report.json", report)
    text = f"# {title}\n\n" + markdown_table(rows, columns)
    if summary:
        text += "\n" + markdown_table(summary, list(summary[0]))
    tmp = out / f".quant_report.md.tmp-{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, out / "quant_report.md")
    variants = sorted({r["variant"] for r in rows if r.get("variant") not in (None, "-")})
    if len(variants) > 1:
        plot_report(rows, metric, out / "quant_report.png", title)
    return report


def plot_report(rows: list[dict], metric: str, path: Path, title: str) -> None:
    with saved_figure(path) as (_, ax):
        own = any(r.get("own_packed_bytes", r["packed_bytes"]) != r["packed_bytes"] for r in rows)  # drafters
        size = "own_packed_bytes" if own else "packed_bytes"
        markers = {
            "full": ("*", "black"),
            "full_ft": ("*", "grey"),
            "ptq": ("o", "#d8703b"),
            "ptq_ft": ("s", "#d8a03b"),
            "qat": ("^", "#3b7dd8"),
        }
        for kind, (marker, color) in markers.items():
            pts = [r for r in rows if r["model"] == kind and r.get(metric) is not None]
            if pts:
                ax.scatter(
                    [r[size] / 1e6 for r in pts],
                    [r[metric] for r in pts],
                    marker=marker,
                    color=color,
                    s=60,
                    label=kind,
                    zorder=3,
                )
                for r in pts:
                    if kind in ("qat", "ptq") and r.get("variant") not in (None, "-"):  # one label per point pair
                        ax.annotate(
                            r["variant"],
                            (r[size] / 1e6, r[metric]),
                            fontsize=7,
                            xytext=(3, 3),
                            textcoords="offset points",
                        )
        ax.set_xlabel("packed size (MB)" + (", without the shared embeddings and LM head" if own else ""))
        ax.set_ylabel(metric)
        ax.set_title(textwrap.fill(title, 80), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
