"""Recipe ``train_lm``: train a causal LM from scratch with next-token cross-entropy.

This is how the testbed target is made (``recipes/configs/testbed_target.yaml``), and it works for
any text the data section names. Launch::

    draftsmith run recipes/configs/testbed_target_quick.yaml [train.max_steps=50 ...]
    accelerate launch --config_file accelerate_configs/ddp.yaml -m recipes.cli run RECIPE.yaml
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 -m recipes.cli run RECIPE.yaml   # CPU ranks

Writes into ``output_dir``: ``recipe.yaml``, ``provenance.json``, ``metrics.jsonl``,
``checkpoints/{latest,best}``, ``model/`` (final weights + tokenizer) and ``summary.json``.
With ``model.arch: parcae`` the same recipe trains a Parcae looped model (:mod:`parcae`): the loss
draws a depth per sequence, and every evaluation adds the test-time compute curve (held-out loss at
each depth of ``model.parcae.eval_recurrences`` plus the training mean and twice it), which the
summary records and ``recurrence_curve.png`` plots.
"""

from __future__ import annotations

from pathlib import Path

from distill.base.flops import flops_per_token
from distill.base.lm import evaluate_lm
from distill.checkpoint import Ranks
from distill.config import TrainLMRecipe
from distill.data import build_tokenizer, load_text_splits, make_windows, tokenizer_fingerprint
from distill.lm import lm_loss
from distill.models import build_causal_lm, model_summary, special_token_ids
from distill.provenance import write_json_atomic, write_run_header
from distill.runtime import end_run, init_tracking, make_accelerator, set_threads
from distill.trainer import Trainer
from parcae.training import curve_rows, parcae_lm_loss, recurrence_curve
from recipes.dry_run import (
    Launch,
    activation_bytes,
    current_launch,
    loss_bytes,
    memory_table,
    trained_layers,
    training_state,
)
from recipes.plots import plot_recurrence_curve
from recipes.quant_stage import QuantStage

SCHEMA = TrainLMRecipe


def memory_estimate(recipe: TrainLMRecipe, model, launch: Launch | None = None) -> dict:
    """GiB per GPU for one micro batch under ``launch`` (default: :func:`recipes.dry_run.current_launch`),
    printed by ``--dry-run``, as :mod:`recipes.dry_run` defines each term: no target, cross-entropy over
    the whole [B, T, V] logits, activations of the layers that carry gradients (Parcae: its core
    ``backprop_depth`` times)."""
    launch = launch or current_launch()
    train, positions = recipe.train, recipe.train.micro_batch_size * recipe.data.seq_len
    parts = {
        **training_state(model, train.mixed_precision, launch),
        "activations": activation_bytes(
            positions, recipe.model.hidden_size, trained_layers(recipe.model), train.mixed_precision
        ),
        "loss_logits": loss_bytes(positions, model.config.vocab_size, "cross_entropy"),
    }
    return memory_table(
        parts,
        launch,
        train.mixed_precision,
        loss_positions_held=positions,
        loss_positions_per_batch=positions,
        trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
    )


def main(recipe: TrainLMRecipe, dry_run: bool = False) -> dict:
    set_threads(recipe.train.torch_threads)

    if dry_run:  # the model from the config alone: no corpus, no tokenizer training
        if recipe.tokenizer.path:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(recipe.tokenizer.path)
            vocab, ids = len(tok), special_token_ids(tok)
        else:
            vocab, ids = recipe.tokenizer.vocab_size, None
        model = build_causal_lm(recipe.model, vocab, ids)
        return {
            "model": model_summary(model),
            "quant": QuantStage(recipe.quant, model).summary(),
            "memory_gib_per_device": memory_estimate(recipe, model),
        }

    ### Accelerator, data, tokenizer
    acc = make_accelerator(recipe.train, recipe.seed, recipe.output_dir, recipe.wandb)
    ranks = Ranks.of(acc)
    splits = load_text_splits(recipe.data, recipe.seed)  # every rank (datasets' file locks share one download)
    if recipe.tokenizer.path:
        tokenizer = build_tokenizer(recipe.tokenizer, splits)
    else:  # training a BPE is one job, not divisible: the main process trains it, the others load it
        with acc.main_process_first():
            tokenizer = build_tokenizer(recipe.tokenizer, splits)
    train = make_windows(
        splits.train, tokenizer, recipe.data, "train", recipe.seed, ranks=ranks
    )  # every rank its shards
    val = make_windows(splits.val, tokenizer, recipe.data, "val", recipe.seed, ranks=ranks)

    ### Model
    model = build_causal_lm(recipe.model, len(tokenizer), special_token_ids(tokenizer))
    fpt = flops_per_token(model, recipe.data.seq_len)
    quant = QuantStage(recipe.quant, model)  # the layer map against this model: errors before any compute
    quant.prepare()  # qat: fake quantization before the optimizer is built

    ### Run header
    data_record = {
        "description": splits.description,
        "text_fingerprint": splits.fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "train_windows": len(train),
        "val_windows": len(val),
        "seq_len": recipe.data.seq_len,
        "tokenized_by_rank": {"train": train.prepared_by_rank, "val": val.prepared_by_rank},
    }
    if acc.is_main_process:
        write_run_header(
            recipe.output_dir, recipe, data=data_record, model=model_summary(model), world_size=acc.num_processes
        )
    init_tracking(acc, recipe.wandb, recipe.output_dir, recipe.model_dump(mode="json"), Path(recipe.output_dir).name)
    acc.print(
        f"{splits.description}; {len(train):,} train / {len(val):,} held-out windows of {recipe.data.seq_len} tokens; "
        f"model {model_summary(model)['parameters']:,} parameters; {acc.num_processes} process(es)"
    )

    ### Train (a Parcae model: depth sampling, loop diagnostics and the test-time compute curve)
    parcae_cfg = recipe.model.parcae
    depths = parcae_cfg.curve_depths() if parcae_cfg else []

    def evaluate(m, max_batches):
        if parcae_cfg:
            return recurrence_curve(
                m, val, recipe.train.micro_batch_size, depths, parcae_cfg.mean_recurrence, max_batches, acc
            )
        return evaluate_lm(m, val, recipe.train.micro_batch_size, max_batches, acc)

    trainer = Trainer(
        accelerator=acc,
        model=model,
        train_cfg=recipe.train,
        optim_cfg=recipe.optim,
        output_dir=recipe.output_dir,
        data=train,
        loss_fn=parcae_lm_loss(recipe.seed) if parcae_cfg else lm_loss,
        flops_per_token=fpt,
        evaluate_fn=lambda m: evaluate(m, recipe.train.eval_batches),
        best_metric="val_loss",
        save_extra=tokenizer.save_pretrained,
        before_step=quant.before_step,
    )
    result = trainer.fit()

    ### Final model, evaluated on the whole held-out split, and summary
    return finish_lm_run(
        acc,
        trainer,
        evaluate,
        tokenizer,
        quant,
        parcae_cfg,
        {
            "steps": result.step,
            "skipped_steps": result.skipped_steps,
            "world_size": result.world_size,
            "train_seconds": round(result.train_seconds, 2),
            "tokens_per_s": round(result.tokens_per_s, 1),
            "mfu": round(result.mfu, 4),
            "peak_flops": result.peak_flops,
            "train_tokens_seen": trainer.state.tokens_seen,
            "epochs": round(train.epoch_of(trainer.state.samples_consumed), 3),
            "data": data_record,
        },
    )


def finish_lm_run(acc, trainer, evaluate, tokenizer, quant, parcae_cfg, record: dict) -> dict:
    """The end of a run that trains a causal LM (``train_lm``, ``distill_student``): save ``model/``,
    evaluate it on the whole held-out split, add a Parcae model's test-time compute curve (and plot) and
    the quantization report when the recipe asks, write ``summary.json``."""
    out = trainer.out
    trainer.save_model(out / "model")
    trainer.model.eval()
    final_eval = evaluate(trainer.model, None)
    summary = {
        "checkpoint": str(out / "model"),
        "best_checkpoint": str(out / "checkpoints" / "best"),
        **record,
        **final_eval,
    }
    if parcae_cfg:
        summary["recurrence_curve"] = curve_rows(final_eval, parcae_cfg.curve_depths())
    if quant.enabled:  # quant.mode ptq / qat: the quantized copy in model_quantized/, quant_report.{json,md}
        summary["quant"] = quant.finish(
            acc.unwrap_model(trainer.model, keep_torch_compile=False),
            lambda m: evaluate(m, trainer.cfg.eval_batches),
            out,
            "val_loss",
            tokenizer,
            is_main_process=acc.is_main_process,
        )
    if acc.is_main_process:
        tokenizer.save_pretrained(out / "model")
        if parcae_cfg:
            plot_recurrence_curve(
                summary["recurrence_curve"],
                out / "recurrence_curve.png",
                parcae_cfg.mean_recurrence,
                f"{out.name}: held-out perplexity vs recurrences",
            )
        write_json_atomic(out / "summary.json", summary)
    end_run(acc)
    return summary
