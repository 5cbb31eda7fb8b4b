"""Temporal temperature scaling of a DSpark drafter's confidence head (DSpark's calibration step).

    python -m recipes.calibrate_confidence --drafter distill/assets/testbed_dspark [--write]

The drafter's training recipe (``recipe.yaml`` in its folder, or ``--recipe``) names its held-out
windows (the target's regenerated answers, read from their cache). The even windows fit one
temperature per block position ``k``,

    T_k = argmin_T  BCE(sigmoid(z_k / T), kept_k)        over a log grid, 0.2 .. 5

(``z_k`` the head's logit, ``kept_k`` whether the greedy draft is the target's argmax: what greedy
verification keeps), and, since a temperature cannot remove a bias (the head is trained towards
``1 - TV``, the sampled acceptance, not the greedy one), also a temperature and an offset per position
(``sigmoid(z_k / T_k + b_k)``, Platt scaling); the odd windows measure ECE and AUROC before and after.
Both maps are monotone per position, so they stay lossless wherever the confidence is used.
``--write`` stores the temperatures and offsets in the drafter's ``config.json`` (write then rename). Writes ``calibration.json`` and ``reliability.png``
(accuracy against confidence, before and after) to ``--out`` (default: the drafter's folder).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from distill.provenance import write_json_atomic

GRID = [math.exp(math.log(0.2) + i * (math.log(5.0) - math.log(0.2)) / 60) for i in range(61)]


@torch.no_grad()
def confidence_samples(drafter, capture, windows, batch_size: int):
    """Per scored draft of every held-out window: the confidence logit, its block position (0-based),
    whether greedy verification keeps it, and the window index."""
    from distill.feature_cache import batch_features
    from drafters.masks import sample_anchors

    cfg = drafter.config
    logits, positions, kept, window = [], [], [], []
    for b in range(0, len(windows), batch_size):
        rows = list(range(b, min(b + batch_size, len(windows))))
        batch = windows.collate(rows)
        ids, aux, last = batch_features(batch, capture)
        anchors = sample_anchors(
            ids.shape[1],
            cfg.block_size,
            cfg.num_anchors,
            ids.shape[0],
            ids.device,
            torch.Generator().manual_seed(b),
            loss_mask=batch.loss_mask,
        )
        out = drafter(ids, aux, last, anchors=anchors, loss_mask=batch.loss_mask)
        conf = out.confidence.double().clamp(1e-6, 1 - 1e-6)
        z = (conf / (1 - conf)).log()  # the raw logit back (no temperature set while collecting)
        hit = out.draft_tokens == out.target_tokens
        pos = torch.arange(cfg.block_size - 1).expand_as(hit)
        win = torch.tensor(rows)[:, None, None].expand_as(hit)
        s = out.scored
        logits.append(z[s]), positions.append(pos[s]), kept.append(hit[s]), window.append(win[s])
    return torch.cat(logits), torch.cat(positions), torch.cat(kept), torch.cat(window)


BIASES = [-3.0 + 0.1 * i for i in range(61)]


def fit_temperatures(
    z: torch.Tensor, positions: torch.Tensor, kept: torch.Tensor, block_size: int, bias: bool = False
) -> tuple[list[float], list[float]]:
    """Per position, the grid temperature (and, with ``bias``, offset) with the least binary
    cross-entropy of ``sigmoid(z / T + b)``."""
    temps, offsets = [], []
    for k in range(block_size - 1):
        zk, yk = z[positions == k], kept[positions == k].double()
        if len(zk) == 0:
            temps.append(1.0), offsets.append(0.0)
            continue
        grid = [(t, b) for t in GRID for b in (BIASES if bias else [0.0])]
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        t, b = min(grid, key=lambda tb: bce(zk / tb[0] + tb[1], yk).item())
        temps.append(round(t, 4)), offsets.append(round(b, 2))
    return temps, offsets


def reliability(conf: torch.Tensor, kept: torch.Tensor, bins: int = 10) -> list[dict]:
    idx = (conf * bins).long().clamp(max=bins - 1)
    return [
        {
            "confidence": round(conf[idx == b].mean().item(), 4),
            "accepted": round(kept[idx == b].double().mean().item(), 4),
            "count": int((idx == b).sum()),
        }
        for b in range(bins)
        if (idx == b).any()
    ]


def plot_reliability(report: dict, path: Path) -> None:
    from recipes.plots import saved_figure

    with saved_figure(path, figsize=(4.5, 4.5)) as (_, ax):
        ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--")
        for key, label in (
            ("reliability_before", "before"),
            ("reliability_temperature_only", "temperature per position"),
            ("reliability_after", "temperature and offset per position"),
        ):
            rows = report[key]
            ax.plot([r["confidence"] for r in rows], [r["accepted"] for r in rows], marker="o", label=label)
        ax.set_xlabel("confidence")
        ax.set_ylabel("fraction of drafts kept (greedy)")
        ax.set_title("DSpark confidence, held-out blocks")
        ax.legend(loc="upper left")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="a DSpark drafter folder")
    parser.add_argument("--recipe", help="its training recipe (default: the folder's recipe.yaml)")
    parser.add_argument("--out", help="where calibration.json and reliability.png go (default: the drafter folder)")
    parser.add_argument("--write", action="store_true", help="store the temperatures in the drafter's config.json")
    args = parser.parse_args()

    from distill.base.features import FeatureCapture
    from distill.drafter_eval import auroc, expected_calibration_error
    from distill.models import load_target
    from recipes.evaluate import load_drafter
    from recipes.registry import load_recipe
    from recipes.train_drafter import drafter_windows

    folder = Path(args.drafter)
    recipe = load_recipe(args.recipe or folder / "recipe.yaml")
    target, tokenizer = load_target(recipe.target)
    drafter = load_drafter(str(folder), target, "cpu")
    if drafter.config.model_type != "draftsmith_dspark":
        raise SystemExit(f"--drafter: {folder} is a {drafter.config.model_type}, not a DSpark drafter")
    drafter.config.confidence_temperature = drafter.config.confidence_offset = None  # collect raw logits
    _, val, _ = drafter_windows(recipe, target, tokenizer)
    z, positions, kept, window = confidence_samples(
        drafter, FeatureCapture(target, drafter.config.target_layer_ids), val, recipe.train.micro_batch_size
    )
    fit, test = window % 2 == 0, window % 2 == 1
    K = drafter.config.block_size
    temps, _ = fit_temperatures(z[fit], positions[fit], kept[fit], K)
    platt_t, platt_b = fit_temperatures(z[fit], positions[fit], kept[fit], K, bias=True)
    before = z[test].sigmoid()
    after = (z / torch.tensor(temps, dtype=z.dtype)[positions])[test].sigmoid()
    platt = (z / torch.tensor(platt_t, dtype=z.dtype)[positions] + torch.tensor(platt_b, dtype=z.dtype)[positions])[
        test
    ].sigmoid()

    def score(c):
        return {"ece": round(expected_calibration_error(c, kept[test]), 4), "auroc": round(auroc(c, kept[test]), 4)}

    report = {
        "drafter": str(folder),
        "fit_drafts": int(fit.sum()),
        "test_drafts": int(test.sum()),
        "before": score(before),
        "temperature_only": {"temperatures": temps, **score(after)},
        "after": {"temperatures": platt_t, "offsets": platt_b, **score(platt)},  # what --write stores
        "reliability_before": reliability(before, kept[test]),
        "reliability_temperature_only": reliability(after, kept[test]),
        "reliability_after": reliability(platt, kept[test]),
    }
    out = Path(args.out or folder)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "calibration.json", report)
    plot_reliability(report, out / "reliability.png")
    if args.write:
        config = json.loads((folder / "config.json").read_text())
        config["confidence_temperature"], config["confidence_offset"] = platt_t, platt_b
        write_json_atomic(folder / "config.json", config)
    print(
        f"held-out ECE {report['before']['ece']} -> {report['temperature_only']['ece']} (temperatures {temps}) -> "
        f"{report['after']['ece']} (and offsets {platt_b}); AUROC {report['before']['auroc']} -> "
        f"{report['after']['auroc']} ({report['test_drafts']} drafts)"
    )


if __name__ == "__main__":
    main()
