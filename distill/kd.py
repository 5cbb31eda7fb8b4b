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

**Chunked loss** (``kd_loss_fn(..., chunk=N)``). At a real vocabulary the logits dominate memory (Qwen3,
``V = 151936``: a [4, 2048, V] fp32 tensor is 5 GB, and the divergence's temporaries several more), so
the loss can run from the models' last hidden states instead: each model runs up to its output
embedding (:func:`forward_to_head`), the scored positions are gathered (unscored ones, prompts, cost no
head at all), and both heads, the divergence and the cross-entropy run on ``N`` positions at a time
under activation checkpointing, so forward and backward hold one chunk's logits at a time (memory in
``N * V``, not ``B * T * V``) at the price of running both heads twice (the backward recomputes them).
The result is the same loss (sums over chunks divided by the scored-token count, which is TRL's
``batchmean``) and the same gradients.

Held-out evaluation reports the student's own loss / perplexity / accuracy on the data, the forward
KL(p || q) at temperature 1 per token (nats), and top-1 agreement (student argmax == teacher argmax:
the per-position greedy acceptance rate when the student drafts). Every rank runs the same number of
forwards (:func:`distill.data.rank_batches`), as ZeRO-3 / FSDP need.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from drafters import unwrapped
from drafters.pard import mask_blocks

from .base.lm import rank_batches
from .base.masks import LayerMasks
from .lm import inputs_and_labels, next_token_ce

DIVERGENCE_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}


def generalized_jsd(student_logits, teacher_logits, labels, beta: float, temperature: float) -> torch.Tensor:
    """Mean per scored token (``labels != -100``) of JSD_beta at ``temperature`` (TRL's implementation)."""
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss(
        student_logits.float(),
        teacher_logits.float(),
        labels=labels,
        beta=beta,
        temperature=temperature,
        reduction="batchmean",
    )


def jsd_sum(student_logits, teacher_logits, beta: float, temperature: float) -> torch.Tensor:
    """Sum over rows (every row scored) of JSD_beta at ``temperature``, TRL's implementation, in fp32."""
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss(
        student_logits.float(), teacher_logits.float(), beta=beta, temperature=temperature, reduction="sum"
    )


def block_masks(model, blocks):
    """Context for a student's forward over PARD's mask blocks: yields the mask to pass, and meanwhile gives
    each windowed layer the blocks' mask with its window cut in, by position (:mod:`distill.base.masks`):
    a mask slot attends as the served drafter's token at that position will. ``model`` may be wrapped."""
    return LayerMasks(unwrapped(model)).applied(blocks.attention_mask, blocks.position_ids, blocks.position_ids)


def kd_loss_fn(
    teacher,
    divergence: str,
    beta: float,
    temperature: float,
    ce_weight: float,
    student_kwargs=None,
    pard=None,
    mask_token_id: int | None = None,
    seed: int = 0,
    chunk: int | None = None,
):
    """A ``loss_fn(model, batch)`` for :class:`distill.trainer.Trainer`. ``student_kwargs(model, batch)``
    returns extra forward arguments for the student (e.g. Parcae's sampled depths); ``pard`` (a
    :class:`~distill.config.PardSection`) appends PARD mask blocks, drawn from the batch's data position.
    ``chunk``: scored positions (over the whole micro-batch) per chunk of the chunked loss (module doc);
    None computes it from whole [B, T, V] logits. Both give the same loss and gradients."""
    beta = DIVERGENCE_BETA.get(divergence, beta)
    if chunk is not None and chunk < 1:
        raise ValueError(f"kd chunk must be a positive number of positions, got {chunk}")

    def loss_fn(model, batch):
        inputs, labels = inputs_and_labels(batch)
        with torch.no_grad():
            _, teacher_states, teacher_head = forward_to_head(teacher, chunk is not None, input_ids=inputs)
        extra = student_kwargs(model, batch) if student_kwargs else {}
        if pard is None:
            out, student_states, student_head = forward_to_head(model, chunk is not None, input_ids=inputs, **extra)
        else:  # mask slots learn the target's distribution (and label) at the window position they draft for
            gen = torch.Generator().manual_seed(seed * 1_000_003 + (batch.first_sample or 0))
            blocks = mask_blocks(inputs, labels != -100, mask_token_id, pard.draft_tokens, pard.anchors, pard.keep, gen)
            with block_masks(model, blocks) as mask:
                out, student_states, student_head = forward_to_head(
                    model,
                    chunk is not None,
                    input_ids=blocks.input_ids,
                    position_ids=blocks.position_ids,
                    attention_mask=mask,
                    **extra,
                )
            teacher_states = torch.cat(
                [
                    teacher_states,
                    teacher_states.gather(1, blocks.source[..., None].expand(-1, -1, teacher_states.shape[-1])),
                ],
                dim=1,
            )
            labels = torch.cat([labels, torch.where(blocks.valid, labels.gather(1, blocks.source), -100)], dim=1)
        if chunk is None:  # the states are the logits
            div = generalized_jsd(student_states, teacher_states, labels, beta, temperature)
            ce = next_token_ce(student_states, labels) if ce_weight else None
        else:
            div, ce = chunked_kd_terms(
                student_states,
                student_head,
                teacher_states,
                teacher_head,
                labels,
                beta,
                temperature,
                bool(ce_weight),
                chunk,
            )
        logs = {"kd/divergence": div.item()}
        loss = div
        if ce_weight:
            loss = (1 - ce_weight) * div + ce_weight * ce
            logs["kd/ce"] = ce.item()
        if getattr(out, "diagnostics", None):  # a Parcae student: its loop's invariants
            from parcae.training import diagnostics_logs

            logs.update(diagnostics_logs(out, extra))
        return loss, logs

    return loss_fn


def forward_to_head(model, to_head: bool, **forward):
    """Run ``model(**forward)`` and return ``(output, states, head)`` with ``head(states)`` the logits
    [B, T, V] the model computes. ``to_head``: ``states`` are the hidden states [B, T, D] its output
    embedding reads and ``head`` runs that embedding (in the autocast state the model ran it in), while
    the model's own head runs on the last position only; else, or when the model has no output
    embedding module or does not call it, ``states`` are the logits and ``head`` is the identity.

    The forward goes through ``model`` itself (a DDP / DeepSpeed wrapper keeps its gradient hooks);
    the head is found on the unwrapped model. The model's logits at the last position are checked
    against ``head``: a model that changes its logits after its head (Gemma's soft-capping, Cohere's
    logit scale) is a ValueError rather than a silently different loss."""
    from accelerate.utils import extract_model_from_parallel

    module = extract_model_from_parallel(model).get_output_embeddings() if to_head else None
    if module is None:
        out = model(**forward)
        return out, out.logits, lambda x: x
    seen = {}

    def last_position_only(_, args):
        seen["states"], seen["autocast"] = args[0], autocast_now(args[0].device.type)
        return (args[0][..., -1:, :], *args[1:])

    handle = module.register_forward_pre_hook(last_position_only)
    try:
        out = model(**forward)
    finally:
        handle.remove()
    if "states" not in seen:  # the model applies its head weights some other way: whole logits
        return out, out.logits, lambda x: x

    def head(x):
        with seen["autocast"]():
            return module(x)

    check_head(out.logits, head, seen["states"], type(extract_model_from_parallel(model)).__name__)
    return out, seen["states"], head


def autocast_now(device: str):
    """A context factory that re-enters ``device``'s current autocast state, for a call made later."""
    if not torch.amp.is_autocast_available(device):
        return nullcontext
    dtype, enabled = torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)
    return lambda: torch.autocast(device, dtype=dtype, enabled=enabled)


@torch.no_grad()
def check_head(logits, head, states, name: str) -> None:
    """ValueError unless ``logits`` (the model's, at the last position) are ``head(states)`` there, to
    two units in the last place of the head's dtype."""
    ours = head(states[..., -1:, :])
    eps = torch.finfo(ours.dtype).eps
    if (
        logits is None
        or logits.shape != ours.shape
        or not torch.allclose(logits.float(), ours.float(), rtol=2 * eps, atol=2 * eps)
    ):
        raise ValueError(
            f"{name}'s logits are not its output embedding applied to its last hidden states (a soft cap or "
            "scale after the head?): it cannot be distilled in chunks; leave the kd chunk unset"
        )


def chunked_kd_terms(
    student_states,
    student_head,
    teacher_states,
    teacher_head,
    labels,
    beta: float,
    temperature: float,
    with_ce: bool,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(divergence, ce)`` means per scored token (``labels != -100``; ce None unless ``with_ce``) from
    the states of both models (:func:`forward_to_head`), ``chunk`` scored positions at a time: each
    chunk's logits exist only inside a checkpointed function, recomputed in the backward. The means
    divide the chunks' sums by the scored-token count (at least 1), as TRL's ``batchmean`` does."""
    scored = labels != -100
    student_rows, teacher_rows, targets = student_states[scored], teacher_states[scored], labels[scored]

    def sums(s_rows, t_rows, y):
        s, t = student_head(s_rows).float(), teacher_head(t_rows).float()
        div = jsd_sum(s, t, beta, temperature)
        return div, (F.cross_entropy(s, y, reduction="sum") if with_ce else torch.zeros_like(div))

    div = ce = student_rows.new_zeros((), dtype=torch.float32)
    for i in range(0, max(len(targets), 1), chunk):  # no scored position: one empty chunk, a zero loss with a graph
        d, c = checkpoint(
            sums, student_rows[i : i + chunk], teacher_rows[i : i + chunk], targets[i : i + chunk], use_reentrant=False
        )
        div, ce = div + d, ce + c
    count = scored.sum().clamp_min(1)
    return div / count, (ce / count if with_ce else None)


@torch.no_grad()
def evaluate_student(
    student, teacher, windows, batch_size: int, max_batches: int | None = None, accelerator=None, **forward_kwargs
) -> dict:
    """``val_loss``, ``val_ppl``, ``val_acc`` (student on the data), ``val_kl`` (forward KL to the
    teacher, nats/token, temperature 1) and ``val_agreement`` (top-1 agreement with the teacher)."""
    device = accelerator.device if accelerator else next(student.parameters()).device
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    n = len(windows) if max_batches is None else min(len(windows), max_batches * batch_size)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # nll, correct, kl, agree, count
    for start, real in rank_batches(n, batch_size, rank, world):
        batch = windows.collate(list(range(start, min(start + batch_size, n)))).to(device)
        batch_sums = student_sums(student, teacher, batch, forward_kwargs)
        if real:  # a padding batch ran its forwards for the collectives; its numbers are dropped
            sums += batch_sums
    if accelerator:
        sums = accelerator.reduce(sums, "sum")
    nll, correct, kl, agree, count = (sums / sums[4]).tolist()
    return {
        "val_loss": nll,
        "val_ppl": math.exp(min(nll, 50.0)),
        "val_acc": correct,
        "val_kl": kl,
        "val_agreement": agree,
        "val_tokens": int(sums[4].item()),
    }


def student_sums(student, teacher, batch, forward_kwargs: dict) -> torch.Tensor:
    """One batch's sums for :func:`evaluate_student`, float64 [5]: student NLL, student correct, forward
    KL to the teacher, top-1 agreements, scored tokens."""
    inputs, labels = inputs_and_labels(batch)
    s = student(input_ids=inputs, **forward_kwargs).logits.float()
    t = teacher(input_ids=inputs).logits.float()
    scored = labels != -100
    s_logp, t_logp = s.log_softmax(-1), t.log_softmax(-1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    return torch.stack(
        [
            next_token_ce(s, labels, reduction="sum"),
            ((s.argmax(-1) == labels) & scored).sum(),
            kl[scored].sum(),
            ((s.argmax(-1) == t.argmax(-1)) & scored).sum(),
            scored.sum(),
        ]
    ).double()


@torch.no_grad()
def evaluate_pard(
    student,
    teacher,
    windows,
    batch_size: int,
    pard,
    mask_token_id: int,
    max_batches: int | None = None,
    accelerator=None,
    seed: int = 0,
) -> dict:
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
    for start, real in rank_batches(n, batch_size, rank, world):
        batch = windows.collate(list(range(start, min(start + batch_size, n)))).to(device)
        batch_sums = pard_sums(
            student, teacher, batch, pard, mask_token_id, torch.Generator().manual_seed(seed + start)
        )
        if real:  # a padding batch ran its forwards for the collectives; its numbers are dropped
            sums += batch_sums
    if accelerator:
        sums = accelerator.reduce(sums, "sum")
    count = max(1.0, float(sums[K + 1]))
    out = {f"val_pard_agreement_{k + 1}": round(float(sums[k]) / count, 4) for k in range(K)}
    out["val_pard_simulated_tau"] = round(1 + float(sums[K]) / count, 4)
    return out


def pard_sums(student, teacher, batch, pard, mask_token_id: int, generator: torch.Generator) -> torch.Tensor:
    """One batch's sums for :func:`evaluate_pard`, float64 [K + 2]: agreements per draft depth, the
    runs of agreeing drafts from depth 1, blocks."""
    K = pard.draft_tokens
    inputs, labels = inputs_and_labels(batch)
    scored = labels != -100
    scored[:, inputs.shape[1] - K :] = False  # whole blocks only
    blocks = mask_blocks(inputs, scored, mask_token_id, K, pard.anchors, 1.0, generator)
    with block_masks(student, blocks) as mask:
        s = student(input_ids=blocks.input_ids, position_ids=blocks.position_ids, attention_mask=mask).logits
    t = teacher(input_ids=inputs).logits.argmax(-1)
    L = inputs.shape[1]
    slot_agree = (s[:, L:].argmax(-1) == t.gather(1, blocks.source)) & blocks.valid  # [B, M], blocks of K - 1
    anchor = (blocks.source[:, :: K - 1] - 1).clamp_min(0)  # padding blocks: any index, not counted
    first = s[:, :L].argmax(-1).gather(1, anchor) == t.gather(1, anchor)
    agree = torch.cat([first[..., None], slot_agree.view(len(inputs), -1, K - 1)], dim=-1)  # [B, blocks, K]
    agree = agree[blocks.valid[:, :: K - 1]]
    runs = agree.int().cumprod(-1).sum()
    return torch.cat([agree.sum(0), runs[None], runs.new_tensor([len(agree)])]).double()
