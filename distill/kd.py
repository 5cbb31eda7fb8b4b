"""Logit distillation of a student from a frozen teacher (the target).

For every scored position the teacher's and the student's next-token distributions at temperature
``tau`` are ``p = softmax(z_t / tau)`` and ``q = softmax(z_s / tau)``; the divergence is TRL's
generalized Jensen-Shannon divergence (``GKDTrainer.generalized_jsd_loss``, Agarwal et al. 2024)::

    JSD_beta(p, q) = beta * KL(p || m) + (1 - beta) * KL(q || m),   m = beta * p + (1 - beta) * q

with the limits ``beta = 0``: forward KL(p || q) (mode covering, what speculative acceptance rewards:
the drafter should put mass wherever the target does) and ``beta = 1``: reverse KL(q || p) (mode
seeking). The training loss is ``(1 - ce_weight) * divergence + ce_weight * CE(data)``.

Held-out evaluation reports the student's own loss / perplexity / accuracy on the data, the forward
KL(p || q) at temperature 1 per token (nats), and top-1 agreement (student argmax == teacher argmax:
the per-position greedy acceptance rate when the student drafts).
"""

from __future__ import annotations

import math

import torch

from .lm import inputs_and_labels, next_token_ce

DIVERGENCE_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}


def generalized_jsd(student_logits, teacher_logits, labels, beta: float, temperature: float) -> torch.Tensor:
    """Mean per scored token (``labels != -100``) of JSD_beta at ``temperature`` (TRL's implementation)."""
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss(student_logits.float(), teacher_logits.float(), labels=labels, beta=beta,
                                           temperature=temperature, reduction="batchmean")


def kd_loss_fn(teacher, divergence: str, beta: float, temperature: float, ce_weight: float, student_kwargs=None):
    """A ``loss_fn(model, batch)`` for :class:`distill.trainer.Trainer`. ``student_kwargs(model, batch)``
    returns extra forward arguments for the student (e.g. Parcae's sampled depths)."""
    beta = DIVERGENCE_BETA.get(divergence, beta)

    def loss_fn(model, batch):
        inputs, labels = inputs_and_labels(batch)
        with torch.no_grad():
            teacher_logits = teacher(input_ids=inputs).logits
        extra = student_kwargs(model, batch) if student_kwargs else {}
        out = model(input_ids=inputs, **extra)
        div = generalized_jsd(out.logits, teacher_logits, labels, beta, temperature)
        logs = {"kd/divergence": div.item()}
        loss = div
        if ce_weight:
            ce = next_token_ce(out.logits, labels)
            loss = (1 - ce_weight) * div + ce_weight * ce
            logs["kd/ce"] = ce.item()
        if getattr(out, "diagnostics", None):  # a Parcae student: its loop's invariants
            from parcae.training import diagnostics_logs

            logs.update(diagnostics_logs(out, extra))
        return loss, logs

    return loss_fn


@torch.no_grad()
def evaluate_student(student, teacher, windows, batch_size: int, max_batches: int | None = None,
                     accelerator=None, **forward_kwargs) -> dict:
    """``val_loss``, ``val_ppl``, ``val_acc`` (student on the data), ``val_kl`` (forward KL to the
    teacher, nats/token, temperature 1) and ``val_agreement`` (top-1 agreement with the teacher)."""
    device = accelerator.device if accelerator else next(student.parameters()).device
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    n = len(windows) if max_batches is None else min(len(windows), max_batches * batch_size)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # nll, correct, kl, agree, count
    for start in range(rank * batch_size, n, world * batch_size):
        idx = list(range(start, min(start + batch_size, n)))
        inputs, labels = inputs_and_labels(windows.collate(idx).to(device))
        s = student(input_ids=inputs, **forward_kwargs).logits.float()
        t = teacher(input_ids=inputs).logits.float()
        scored = labels != -100
        s_logp, t_logp = s.log_softmax(-1), t.log_softmax(-1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
        sums += torch.stack([
            next_token_ce(s, labels, reduction="sum"),
            ((s.argmax(-1) == labels) & scored).sum(),
            kl[scored].sum(),
            ((s.argmax(-1) == t.argmax(-1)) & scored).sum(),
            scored.sum(),
        ]).double()
    if accelerator:
        sums = accelerator.reduce(sums, "sum")
    nll, correct, kl, agree, count = (sums / sums[4]).tolist()
    return {"val_loss": nll, "val_ppl": math.exp(min(nll, 50.0)), "val_acc": correct, "val_kl": kl,
            "val_agreement": agree, "val_tokens": int(sums[4].item())}
