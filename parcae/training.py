"""Parcae's training loss, its logged invariants and its test-time compute curve (the trainer calls them;
this module knows no trainer).

* :func:`parcae_lm_loss` is next-token cross-entropy on the final logits at a per-sequence depth
  drawn by :func:`parcae.model.sample_depths`, seeded from ``(recipe seed, data position)``. The
  data position of a micro-batch is a function of (step, micro-batch, rank), so every process and
  micro-batch draws its own depths and a resumed run draws exactly the depths it would have drawn.
  Every sequence runs at least one gradient-carrying iteration, so every parameter gets a gradient
  each step (DDP needs no ``find_unused_parameters``).
* It logs the loop's invariants: the largest ``A_bar`` entry (< 1 by construction for the diagonal
  injection), the final state norm, the relative change of the state over the last iteration (small
  when the loop has converged to a fixed point), and the mean sampled depth.
* :func:`recurrence_curve` is the test-time compute curve: held-out loss and perplexity at several
  depths T (the paper's ``val_loss_{T}``); :func:`recipes.plots.plot_recurrence_curve` draws it.
"""

from __future__ import annotations

from distill.base.lm import evaluate_lm, inputs_and_labels, next_token_ce

from .model import sample_depths


def unwrap(model):
    return getattr(model, "module", model)


def depth_seed(seed: int, first_sample: int | None) -> int:
    return (seed * 1_000_003 + (first_sample or 0)) % (2**63)


def training_forward_kwargs(model, batch, seed: int) -> dict:
    """The forward arguments of a Parcae training step: this batch's per-sequence depths, and diagnostics."""
    cfg = unwrap(model).config
    depths = sample_depths(
        batch.input_ids.shape[0], cfg.mean_recurrence, cfg.mean_backprop_depth, depth_seed(seed, batch.first_sample)
    )
    return {"depths": depths, "return_diagnostics": True}


def diagnostics_logs(out, forward_kwargs: dict) -> dict:
    logs = {f"parcae/{key}": value for key, value in out.diagnostics.items()}
    logs["parcae/mean_backprop_depth"] = float(forward_kwargs["depths"][1].float().mean())
    return logs


def parcae_lm_loss(seed: int):
    """A ``loss_fn(model, batch)`` for :class:`distill.trainer.Trainer`."""

    def loss_fn(model, batch):
        kwargs = training_forward_kwargs(model, batch, seed)
        inputs, labels = inputs_and_labels(batch)
        out = model(input_ids=inputs, **kwargs)
        return next_token_ce(out.logits, labels), diagnostics_logs(out, kwargs)

    return loss_fn


def recurrence_curve(
    model,
    windows,
    batch_size: int,
    depths: list[int],
    default_depth: int,
    max_batches: int | None = None,
    accelerator=None,
    at_default: dict | None = None,
) -> dict:
    """``{"val_loss_T{t}": .., "val_ppl_T{t}": .., "val_acc_T{t}": ..}`` for every depth ``t``, and the
    plain ``val_*`` metrics at ``default_depth`` (the depth the model runs at outside training);
    ``at_default``: those metrics when the caller has already measured them."""
    out = {}
    for t in sorted(set(depths) | {default_depth}):
        if t == default_depth and at_default is not None:
            metrics = at_default
        else:
            metrics = evaluate_lm(model, windows, batch_size, max_batches, accelerator, num_steps=t)
        if t == default_depth:
            out.update(metrics)
        out.update(
            {
                f"val_loss_T{t}": metrics["val_loss"],
                f"val_ppl_T{t}": metrics["val_ppl"],
                f"val_acc_T{t}": metrics["val_acc"],
            }
        )
    return out


def curve_rows(metrics: dict, depths: list[int]) -> list[dict]:
    return [
        {
            "recurrence": t,
            "val_loss": metrics[f"val_loss_T{t}"],
            "val_ppl": metrics[f"val_ppl_T{t}"],
            "val_acc": metrics[f"val_acc_T{t}"],
        }
        for t in depths
    ]
