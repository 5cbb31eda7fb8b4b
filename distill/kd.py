"""Logit distillation of a student from a frozen teacher (the target).

For every scored position the teacher's and the student's next-token distributions at temperature
``tau`` are ``p = softmax(z_t / tau)`` and ``q = softmax(z_s / tau)``; the divergence is TRL's
generalized Jensen-Shannon divergence (``GKDTrainer.generalized_jsd_loss``, Agarwal et al. 2024)::

    JSD_beta(p, q) = beta * KL(p || m) + (1 - beta) * KL(q || m),   m = beta * p + (1 - beta) * q

with the limits ``beta = 0``: forward KL(p || q) (mode covering, what speculative acceptance rewards:
the drafter should put mass wherever the target does) and ``beta = 1``: reverse KL(q || p) (mode
seeking). The training loss is ``(1 - ce_weight) * divergence + ce_weight * CE(data)``.

With a ``pard`` section (:mod:`drafters.pard`) the student also learns to draft ``K`` tokens a forward:
mask blocks are appended to every window and each mask slot is distilled towards the target's
distribution at the window position it drafts for; the loss is the divergence averaged over the
window's scored tokens and the mask slots together.

Held-out evaluation reports the student's own loss / perplexity / accuracy on the data, the forward
KL(p || q) at temperature 1 per token (nats), and top-1 agreement (student argmax == teacher argmax:
the per-position greedy acceptance rate when the student drafts).
"""

from __future__ import annotations

import math

import torch

from drafters.pard import mask_blocks

from .lm import inputs_and_labels, next_token_ce

DIVERGENCE_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}


def generalized_jsd(student_logits, teacher_logits, labels, beta: float, temperature: float) -> torch.Tensor:
    """Mean per scored token (``labels != -100``) of JSD_beta at ``temperature`` (TRL's implementation)."""
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss(student_logits.float(), teacher_logits.float(), labels=labels, beta=beta,
                                           temperature=temperature, reduction="batchmean")


def kd_loss_fn(teacher, divergence: str, beta: float, temperature: float, ce_weight: float, student_kwargs=None,
               pard=None, mask_token_id: int | None = None, seed: int = 0):
    """A ``loss_fn(model, batch)`` for :class:`distill.trainer.Trainer`. ``student_kwargs(model, batch)``
    returns extra forward arguments for the student (e.g. Parcae's sampled depths); ``pard`` (a
    :class:`~distill.config.PardSection`) appends PARD mask blocks, drawn from the batch's data position."""
    beta = DIVERGENCE_BETA.get(divergence, beta)

    def loss_fn(model, batch):
        inputs, labels = inputs_and_labels(batch)
        with torch.no_grad():
            teacher_logits = teacher(input_ids=inputs).logits
        extra = student_kwargs(model, batch) if student_kwargs else {}
        if pard is None:
            out = model(input_ids=inputs, **extra)
        else:  # mask slots learn the target's distribution (and label) at the window position they draft for
            gen = torch.Generator().manual_seed(seed * 1_000_003 + (batch.first_sample or 0))
            blocks = mask_blocks(inputs, labels != -100, mask_token_id, pard.draft_tokens, pard.anchors, pard.keep, gen)
            out = model(input_ids=blocks.input_ids, position_ids=blocks.position_ids, attention_mask=blocks.attention_mask, **extra)
            teacher_logits = torch.cat([teacher_logits, teacher_logits.gather(
                1, blocks.source[..., None].expand(-1, -1, teacher_logits.shape[-1]))], dim=1)
            labels = torch.cat([labels, torch.where(blocks.valid, labels.gather(1, blocks.source), -100)], dim=1)
        student_logits = out.logits
        div = generalized_jsd(student_logits, teacher_logits, labels, beta, temperature)
        logs = {"kd/divergence": div.item()}
        loss = div
        if ce_weight:
            ce = next_token_ce(student_logits, labels)
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


@torch.no_grad()
def evaluate_pard(student, teacher, windows, batch_size: int, pard, mask_token_id: int, max_batches: int | None = None,
                  accelerator=None, seed: int = 0) -> dict:
    """A PARD student's drafts on held-out windows, greedy: blocks of all ``K - 1`` masks at up to
    ``pard.anchors`` fixed anchors a window; ``val_pard_agreement_k`` is the rate at which the student's
    draft ``k`` (``k = 1``: the output at the anchor; ``k > 1``: mask ``k - 1``) is the target's argmax
    there, and ``val_pard_simulated_tau`` is 1 + the mean run of agreeing drafts from ``k = 1``: the
    tokens a greedy speculative step would emit, one target forward per block."""
    device = accelerator.device if accelerator else next(student.parameters()).device
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    n = len(windows) if max_batches is None else min(len(windows), max_batches * batch_size)
    K = pard.draft_tokens
    sums = torch.zeros(K + 2, dtype=torch.float64, device=device)  # agreements per depth, run lengths, blocks
    for start in range(rank * batch_size, n, world * batch_size):
        idx = list(range(start, min(start + batch_size, n)))
        inputs, labels = inputs_and_labels(windows.collate(idx).to(device))
        scored = labels != -100
        scored[:, inputs.shape[1] - K:] = False  # whole blocks only
        gen = torch.Generator().manual_seed(seed + start)
        blocks = mask_blocks(inputs, scored, mask_token_id, K, pard.anchors, 1.0, gen)
        s = student(input_ids=blocks.input_ids, position_ids=blocks.position_ids, attention_mask=blocks.attention_mask).logits
        t = teacher(input_ids=inputs).logits.argmax(-1)
        L = inputs.shape[1]
        slot_agree = (s[:, L:].argmax(-1) == t.gather(1, blocks.source)) & blocks.valid  # [B, M], blocks of K - 1
        anchor = (blocks.source[:, ::K - 1] - 1).clamp_min(0)  # padding blocks: any index, not counted
        first = s[:, :L].argmax(-1).gather(1, anchor) == t.gather(1, anchor)
        agree = torch.cat([first[..., None], slot_agree.view(len(idx), -1, K - 1)], dim=-1)  # [B, blocks, K]
        agree = agree[blocks.valid[:, ::K - 1]]
        sums[:K] += agree.sum(0).double()
        sums[K] += agree.int().cumprod(-1).sum().double()
        sums[K + 1] += len(agree)
    if accelerator:
        sums = accelerator.reduce(sums, "sum")
    count = max(1.0, float(sums[K + 1]))
    out = {f"val_pard_agreement_{k + 1}": round(float(sums[k]) / count, 4) for k in range(K)}
    out["val_pard_simulated_tau"] = round(1 + float(sums[K]) / count, 4)
    return out
