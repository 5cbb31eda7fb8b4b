"""Recipe ``distill_student``: a compact student (transformer or Parcae) distilled from a frozen target.

The student is built from ``student`` (any ``train_lm`` architecture, ``arch: parcae`` included) with
the target's tokenizer and vocabulary, so it can draft for the target in the speculative-decoding
loop (``draftsmith eval --drafter <run>/model``). It learns the target's next-token distribution on
the ``data`` section's text: the corpus, or the target's own answers (``regenerate`` recipe output,
``data.format: prompt_response``, which is TRL's ``seq_kd``). Loss and metrics: :mod:`distill.kd`;
a Parcae student also draws per-sequence depths (:mod:`parcae.training`) and reports its
test-time compute curve. ``checkpoints/best`` is the student with the lowest held-out KL. With a
``pard`` section the student also learns PARD's parallel drafting (:mod:`drafters.pard`: ``K`` drafts
from one forward over ``K - 1`` appended mask tokens, mask slots distilled towards the target too);
its config records ``pard`` so the loop drafts with it that way, and held-out evaluation adds the
per-depth agreement with the target and the simulated tau.

Why not TRL's ``GKDTrainer``: it is a ``transformers.Trainer``, and this recipe runs on the project's
trainer like every other (exact resume, the same accelerate launch configs, MFU, the frozen model
beside the trained one as in drafter recipes). The divergence itself is TRL's
(``GKDTrainer.generalized_jsd_loss``). On-policy generation (GKD's ``lmbda``) is not implemented.

    draftsmith run recipes/configs/student_testbed.yaml
    accelerate launch --config_file accelerate_configs/ddp.yaml -m recipes.cli run recipes/configs/student_qwen3_8b.yaml
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from distill.base.flops import flops_per_token
from distill.checkpoint import Ranks
from distill.config import DistillStudentRecipe, RecipeError
from distill.data import make_windows
from distill.kd import evaluate_pard, evaluate_student, kd_loss_fn
from distill.models import (
    build_causal_lm,
    init_from_target_layers,
    load_target,
    model_summary,
    special_token_ids,
    target_family_lm,
)
from distill.provenance import write_run_header
from distill.regenerate import training_splits
from distill.runtime import init_tracking, make_accelerator, set_threads
from distill.trainer import Trainer
from parcae.training import recurrence_curve, training_forward_kwargs, unwrap
from recipes.dry_run import (
    Launch,
    activation_bytes,
    current_launch,
    loss_bytes,
    memory_table,
    meta_target,
    trained_layers,
    training_state,
    weight_bytes,
)
from recipes.quant_stage import QuantStage
from recipes.train_lm import finish_lm_run

SCHEMA = DistillStudentRecipe


def memory_estimate(recipe: DistillStudentRecipe, target, student, launch: Launch | None = None) -> dict:
    """GiB per GPU for one micro batch under ``launch`` (default: :func:`recipes.dry_run.current_launch`),
    printed by ``--dry-run``; an estimate from shapes, every term as :mod:`recipes.dry_run` defines it.
    The student's positions are the window's plus, with ``pard``, up to ``anchors x (draft_tokens - 1)``
    appended mask slots a row; its activations are over those positions and the layers that carry
    gradients. The loss holds both models' logits over the target's vocabulary for every position
    (``distill.loss_chunk`` unset) or for a chunk of them, computed from the last hidden states: then
    the teacher's last hidden states are held as ``features``."""
    launch = launch or current_launch()
    train, chunk = recipe.train, recipe.distill.loss_chunk
    appended = recipe.pard.anchors * (recipe.pard.draft_tokens - 1) if recipe.pard else 0
    positions = train.micro_batch_size * (recipe.data.seq_len + appended)
    held = positions if chunk is None else min(positions, chunk)
    teacher_states = positions * target.config.hidden_size * next(target.parameters()).element_size()
    parts = {
        "target_weights": weight_bytes(target.parameters()),
        **training_state(student, train.mixed_precision, launch),
        "features": 0 if chunk is None else teacher_states,
        "activations": activation_bytes(
            positions, student.config.hidden_size, trained_layers(recipe.student), train.mixed_precision
        ),
        "loss_logits": loss_bytes(held, target.config.vocab_size, "divergence"),
    }
    return memory_table(
        parts,
        launch,
        train.mixed_precision,
        loss_positions_held=held,
        loss_positions_per_batch=positions,
        trainable_parameters=sum(p.numel() for p in student.parameters() if p.requires_grad),
    )


def main(recipe: DistillStudentRecipe, dry_run: bool = False) -> dict:
    set_threads(recipe.train.torch_threads)

    ### Target (frozen) and student, in the target's vocabulary
    acc = None if dry_run else make_accelerator(recipe.train, recipe.seed, recipe.output_dir, recipe.wandb)
    # a dry run builds both models on the meta device: shapes only, no weights read or allocated
    target, tokenizer = meta_target(recipe.target) if dry_run else load_target(recipe.target, acc.device)
    with torch.device("meta") if dry_run else contextlib.nullcontext():
        if recipe.student.arch == "target":  # the target's own family (PARD's layer dropping from any target)
            student = target_family_lm(target, recipe.student.num_layers, recipe.init_from_target_layers)
        else:
            student = build_causal_lm(recipe.student, target.config.vocab_size, special_token_ids(tokenizer))
    if recipe.init_from_target_layers:
        init_from_target_layers(student, target, recipe.init_from_target_layers)
    pard = recipe.pard
    # recorded in the config: the loop drafts K tokens a forward (serve_eval.proposers.PardProposer)
    if pard is not None:
        mask_id = pard.mask_token_id if pard.mask_token_id is not None else tokenizer.mask_token_id
        if mask_id is None:
            raise RecipeError("pard: the target's tokenizer has no mask token; set pard.mask_token_id")
        student.config.pard = {"draft_tokens": pard.draft_tokens, "mask_token_id": mask_id}
    quant = QuantStage(recipe.quant, student)  # the layer map against this student: errors before any compute
    if dry_run:
        return {
            "student": model_summary(student),
            "target": model_summary(target),
            "quant": quant.summary(),
            "memory_gib_per_device": memory_estimate(recipe, target, student),
        }

    ### Data, tokenized with the target's tokenizer
    ranks = Ranks.of(acc)  # every rank regenerates and tokenizes its share
    chat = recipe.target.chat_template_kwargs
    splits, data_cfg, data_record = training_splits(
        recipe.data, recipe.regenerate, target, tokenizer, recipe.seed, ranks, chat
    )
    train = make_windows(splits.train, tokenizer, data_cfg, "train", recipe.seed, ranks=ranks, template_kwargs=chat)
    val = make_windows(splits.val, tokenizer, data_cfg, "val", recipe.seed, ranks=ranks, template_kwargs=chat)
    data_record["tokenized_by_rank"] = {"train": train.prepared_by_rank, "val": val.prepared_by_rank}
    if acc.is_main_process:
        write_run_header(
            recipe.output_dir,
            recipe,
            data=data_record,
            student=model_summary(student),
            target=recipe.target.path,
            world_size=acc.num_processes,
        )
    init_tracking(acc, recipe.wandb, recipe.output_dir, recipe.model_dump(mode="json"), Path(recipe.output_dir).name)

    ### Loss: the divergence to the target (a Parcae student at a sampled depth per sequence)
    parcae_cfg = recipe.student.parcae

    d = recipe.distill
    depths = (lambda model, batch: training_forward_kwargs(model, batch, recipe.seed)) if parcae_cfg else None
    loss_fn = kd_loss_fn(
        target,
        d.divergence,
        d.beta,
        d.temperature,
        d.ce_weight,
        depths,
        pard,
        pard and student.config.pard["mask_token_id"],
        recipe.seed,
        chunk=d.loss_chunk,
    )

    def evaluate(m, max_batches):
        metrics = evaluate_student(m, target, val, recipe.train.micro_batch_size, max_batches, acc)
        if pard is not None:
            metrics.update(
                evaluate_pard(
                    m,
                    target,
                    val,
                    recipe.train.micro_batch_size,
                    pard,
                    student.config.pard["mask_token_id"],
                    max_batches,
                    acc,
                    recipe.seed,
                )
            )
        if parcae_cfg:  # the other depths of the curve; the default one was just measured
            metrics.update(
                recurrence_curve(
                    m,
                    val,
                    recipe.train.micro_batch_size,
                    parcae_cfg.curve_depths(),
                    unwrap(m).config.recurrence,
                    max_batches,
                    acc,
                    at_default=metrics,
                )
            )
        return metrics

    fpt = flops_per_token(student, recipe.data.seq_len) + flops_per_token(target, recipe.data.seq_len, training=False)
    quant.prepare()  # qat: fake quantization before the optimizer is built
    trainer = Trainer(
        accelerator=acc,
        model=student,
        train_cfg=recipe.train,
        optim_cfg=recipe.optim,
        output_dir=recipe.output_dir,
        data=train,
        loss_fn=loss_fn,
        flops_per_token=fpt,
        evaluate_fn=lambda m: evaluate(m, recipe.train.eval_batches),
        best_metric="val_kl",
        save_extra=tokenizer.save_pretrained,
        before_step=quant.before_step,
    )
    result = trainer.fit()

    ### Final student, evaluated on the whole held-out split, and summary
    return finish_lm_run(
        acc,
        trainer,
        evaluate,
        tokenizer,
        quant,
        parcae_cfg,
        {
            "target": recipe.target.path,
            "student": model_summary(student),
            "divergence": d.divergence,
            "steps": result.step,
            "train_seconds": round(result.train_seconds, 2),
            "tokens_per_s": round(result.tokens_per_s, 1),
            "mfu": round(result.mfu, 4),
            "train_tokens_seen": trainer.state.tokens_seen,
            "best_val_kl": result.best_metric,
            "best_step": result.best_step,
            "data": data_record,
        },
    )
