"""Next-token language modelling: the loss the target is trained with, and held-out evaluation.

For a window ``x[0..L]`` the model reads ``x[0..L-1]`` and is scored on ``x[1..L]`` with mean
token cross-entropy (nats/token). Evaluation reports the same loss over a fixed, unshuffled set of
held-out windows, its perplexity ``exp(loss)`` and next-token (greedy) accuracy. The held-out
windows are split across processes and the sums reduced, so the numbers do not depend on how many
processes evaluate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def inputs_and_labels(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``x[0..L-1]`` and labels ``x[1..L]`` of a batch (``input_ids``, optional ``loss_mask``),
    with unscored labels set to -100 (ignored)."""
    ids = batch.input_ids
    labels = ids[:, 1:].clone()
    if batch.loss_mask is not None:
        labels[batch.loss_mask[:, 1:] == 0] = -100
    return ids[:, :-1], labels


def next_token_ce(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` [B, L, V] against ``labels`` [B, L], -100 ignored."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction=reduction)


@torch.no_grad()
def rank_batches(n: int, batch_size: int, rank: int, world: int) -> list[tuple[int, bool]]:
    """This rank's share of an evaluation over items ``0 .. n-1`` in batches of ``batch_size``: pairs
    ``(first item, real)``. Batches go round-robin; a rank short of one gets a *padding* batch (``real``
    False: the first batch again, whose results the caller must drop), so every rank runs the same
    number of forwards. Under ZeRO-3 / FSDP each forward gathers parameters collectively: an uneven
    split would leave the ranks with more batches waiting on the others forever."""
    starts = list(range(0, n, batch_size))
    mine = starts[rank::world]
    return [(s, True) for s in mine] + [(0, False)] * (-(-len(starts) // world) - len(mine))


def evaluate_lm(
    model,
    windows,
    batch_size: int,
    max_batches: int | None = None,
    accelerator=None,
    prefix: str = "val",
    **forward_kwargs,
) -> dict:
    """Held-out loss, perplexity and accuracy; ``forward_kwargs`` go to the model (e.g. ``num_steps``)."""
    device = accelerator.device if accelerator else next(model.parameters()).device
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    n = len(windows) if max_batches is None else min(len(windows), max_batches * batch_size)
    nll = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    # as many forwards on every rank (ZeRO-3 / FSDP gathers)
    for start, real in rank_batches(n, batch_size, rank, world):
        inputs, labels = inputs_and_labels(windows.collate(list(range(start, min(start + batch_size, n)))).to(device))
        logits = model(input_ids=inputs, **forward_kwargs).logits.float()
        if real:
            nll += next_token_ce(logits, labels, reduction="sum").double()
            correct += (logits.argmax(-1) == labels).sum().double()
            count += (labels != -100).sum().double()
    if accelerator:
        nll, correct, count = (accelerator.reduce(t, "sum") for t in (nll, correct, count))
    loss = (nll / count).item()
    return {
        f"{prefix}_loss": loss,
        f"{prefix}_ppl": math.exp(min(loss, 50.0)),
        f"{prefix}_acc": (correct / count).item(),
        f"{prefix}_tokens": int(count.item()),
    }
