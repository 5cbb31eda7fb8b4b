"""Recipe ``train_drafter``: distill a DFlash, DSpark or EAGLE-3 drafter from a frozen target.

Online features (``features.mode: online``): the target runs beside the drafter; forward hooks capture
the configured layers and its final hidden state for every batch (:mod:`distill.base.features`). Offline
(``features.mode: offline``): the same features are written once to ``features.cache_dir`` (built on
first use) and read back; a cache made for another target, tokenizer, data or layer set is refused. The drafter never sees gradients
from the target, and the target's embeddings and LM head are copied into the drafter, frozen.

A target one GPU cannot hold beside the training state trains in two stages: the cache built in one
process with the target split over the node's GPUs (``target.device_map: auto``, ``features.build_only:
true``), then training from the complete cache under any launch, which reads none of the target's weights
but the embeddings, head and final norm the drafter copies (:func:`frozen_target`).

Every evaluation reports per-position acceptance and the simulated acceptance length tau on held-out
windows; ``checkpoints/best`` is the drafter with the highest tau. Launch::

    draftsmith run recipes/configs/dflash_testbed.yaml
    accelerate launch --config_file accelerate_configs/zero2.yaml -m recipes.cli run recipes/configs/dflash_qwen3_8b.yaml
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from distill.base.features import LAYER_ID_CONVENTION, FeatureCapture, decoder_layers, final_norm
from distill.checkpoint import Ranks
from distill.config import RecipeError, TrainDrafterRecipe
from distill.data import make_windows
from distill.drafter_eval import build_drafter, evaluate_drafter
from distill.feature_cache import CachedFeatureWindows, batch_features, target_fingerprint, write_feature_caches
from distill.models import DTYPES, check_device_map, load_target, load_target_io, model_summary, resolve_target_path
from distill.provenance import write_json_atomic, write_run_header
from distill.regenerate import training_splits
from distill.runtime import end_run, init_tracking, make_accelerator, set_threads
from distill.trainer import Trainer
from drafters import DRAFTERS
from drafters.masks import sample_anchors
from drafters.vocab import coverage, frequent_tokens, restrict_vocab
from recipes.dry_run import (
    Launch,
    activation_bytes,
    current_launch,
    loss_bytes,
    memory_table,
    meta_target,
    training_state,
    weight_bytes,
)
from recipes.quant_stage import QuantStage


def drafter_flops_per_token(drafter, target, seq_len: int, online: bool = True) -> float:
    """Training FLOPs per sequence token: the drafter's forward + backward over the positions it drafts
    (blocks per sequence x block size, or TTT steps), plus the frozen target's forward when it runs
    beside the drafter (online features; an offline cache computed it once, before training)."""
    from distill.base.flops import flops_per_token

    cfg = drafter.config
    weights = sum(p.numel() for p in drafter.parameters() if p.dim() >= 2) - drafter.embed_tokens.weight.numel()
    drafted = cfg.ttt_steps if cfg.model_type == "draftsmith_eagle3" else cfg.num_anchors * cfg.block_size / seq_len
    return 6 * weights * drafted + (flops_per_token(target, seq_len, training=False) if online else 0.0)


def memory_estimate(recipe: TrainDrafterRecipe, target, drafter, launch: Launch | None = None) -> dict:
    """GiB per GPU for one micro batch under ``launch`` (default: :func:`recipes.dry_run.current_launch`),
    printed by ``--dry-run``; an estimate from shapes, every term as :mod:`recipes.dry_run` defines it.
    The drafter's frozen embeddings and head are ``frozen_weights``; ``features`` are the captured
    target layers and final hidden state; activations run over the drafted positions (blocks x block
    size; EAGLE-3: every position at every training-time-test step); the loss holds the drafted
    positions' logits (whole blocks of ``drafter.loss_chunk``, or the whole batch) over the draft
    vocabulary."""
    launch = launch or current_launch()
    cfg, train = drafter.config, recipe.train
    rows, seq = train.micro_batch_size, recipe.data.seq_len
    if cfg.model_type == "draftsmith_eagle3":  # every step's logits over every position live until the backward
        drafted = positions = seq * cfg.ttt_steps
    else:
        drafted, positions = cfg.num_anchors * cfg.block_size, cfg.num_anchors * (cfg.block_size - 1)
    positions *= rows
    held = positions if cfg.loss_chunk is None else min(positions, max(cfg.loss_chunk, cfg.block_size - 1))
    feature_size = next(target.parameters()).element_size()
    parts = {
        "target_weights": weight_bytes(target.parameters()),
        **training_state(drafter, train.mixed_precision, launch),
        "features": rows * seq * cfg.target_hidden_size * (len(cfg.target_layer_ids) + 1) * feature_size,
        "activations": activation_bytes(rows * drafted, cfg.hidden_size, cfg.num_hidden_layers, train.mixed_precision),
        "loss_logits": loss_bytes(held, recipe.drafter.draft_vocab or cfg.vocab_size, "divergence"),
    }
    return memory_table(
        parts,
        launch,
        train.mixed_precision,
        loss_positions_held=held,
        loss_positions_per_batch=positions,
        trainable_parameters=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
    )


SPLITS = ("train", "val")


def cache_folder(recipe: TrainDrafterRecipe) -> Path:
    """The offline feature caches' folder (one subfolder per split)."""
    return Path(recipe.features.cache_dir or Path(recipe.output_dir) / "feature_cache")


def caches_complete(recipe: TrainDrafterRecipe) -> bool:
    """Whether features are offline and both splits' caches are written (their manifests present; vLLM's
    hidden-states files: a first file in each split, the rest checked as they are read)."""
    marker = "hs_0.safetensors" if recipe.features.format == "vllm" else "manifest.json"
    return recipe.features.mode == "offline" and all((cache_folder(recipe) / s / marker).exists() for s in SPLITS)


def frozen_target(recipe: TrainDrafterRecipe, acc, weightless: bool):
    """``(target, tokenizer)`` for training: loaded whole on ``acc.device`` (or placed by ``target.device_map``,
    one process only), or, ``weightless`` (the offline caches complete), built without its weights
    (:func:`distill.models.load_target_io`: only the embeddings, head and, for ``drafter.init_norm_scale``,
    final norm the drafter copies; ``target.device_map`` then places nothing and is not checked). Either
    way the caches' fingerprint check reads the checkpoint's files."""
    if weightless:  # vLLM's files hold the final state before the norm: the norm is read too
        norm = recipe.drafter.init_norm_scale is not None or recipe.features.format == "vllm"
        return load_target_io(recipe.target, norm=norm)
    check_device_map(recipe.target, acc.num_processes)
    return load_target(recipe.target, acc.device)


def offline_windows(recipe, acc, capture, target, data_record, train, val, norm=None):
    """Cached-feature windows for both splits, building the caches first where they are missing: the
    shards of both divided among the ranks, each running its copy of the target (``data_record`` gets
    ``features_by_rank``, the shards each rank wrote)."""
    folder = cache_folder(recipe)
    dtype = DTYPES[recipe.features.dtype]
    if recipe.features.format == "vllm":
        return vllm_windows(recipe, acc, capture, target, data_record, train, val, norm)
    fingerprint = target_fingerprint(target)
    expected, build = {}, []
    for split, windows in (("train", train), ("val", val)):
        expected[split] = {
            "target_fingerprint": fingerprint,
            "layer_ids": capture.layer_ids,
            "layer_id_convention": LAYER_ID_CONVENTION,
            "seq_len": windows.seq_len,
            "split": split,
            "num_windows": len(windows),
            "dtype": recipe.features.dtype,
            "tokenizer_fingerprint": data_record["tokenizer_fingerprint"],
            "data_fingerprint": data_record["data_fingerprint"],
        }
        meta = {
            k: expected[split][k] for k in ("target_fingerprint", "tokenizer_fingerprint", "data_fingerprint", "split")
        }
        build.append((windows, folder / split, {"target": recipe.target.path, **meta}))
    data_record["features_by_rank"] = write_feature_caches(
        capture, build, dtype, batch_size=recipe.train.micro_batch_size, device=acc.device, ranks=Ranks.of(acc)
    )
    return [
        CachedFeatureWindows(folder / split, expected[split], recipe.seed, shuffle=windows.shuffle)
        for split, windows in (("train", train), ("val", val))
    ]


def vllm_windows(recipe, acc, capture, target, data_record, train, val, norm):
    """Both splits' windows with features from vLLM's hidden-states files under the cache folder, the
    missing files written first by the main process from the target running here; ``norm``: a copy of
    the target's final norm (the files hold the final state before it)."""
    from distill.feature_cache import VllmFeatureWindows, vllm_layer_ids, write_vllm_hidden_states

    folder, num_layers = cache_folder(recipe), len(decoder_layers(target))
    layer_ids = recipe.features.vllm_layer_ids or vllm_layer_ids(capture.layer_ids, num_layers)
    if layer_ids[-1] != num_layers:
        raise RecipeError(
            f"features.vllm_layer_ids {layer_ids}: the last id must be the target's final state, {num_layers}"
        )
    written = {}
    if acc.is_main_process and not caches_complete(recipe):
        for split, windows in (("train", train), ("val", val)):
            written[split] = write_vllm_hidden_states(
                capture, windows, folder / split, DTYPES[recipe.features.dtype], acc.device
            )
    acc.wait_for_everyone()
    data_record["features_by_rank"] = {"vllm_files_written": written}
    return [
        VllmFeatureWindows(windows, folder / split, layer_ids, capture.layer_ids, norm)
        for split, windows in (("train", train), ("val", val))
    ]


def cache_summary(recipe: TrainDrafterRecipe, acc, train, val, data_record: dict) -> dict:
    """``features.build_only``: the built caches' summary, written to ``summary.json`` by the main process."""
    summary = {
        "feature_cache": str(cache_folder(recipe)),
        "windows": {"train": len(train), "val": len(val)},
        "target": recipe.target.path,
        "features_by_rank": data_record["features_by_rank"],
    }
    if acc.is_main_process:
        write_json_atomic(Path(recipe.output_dir) / "summary.json", summary)
    end_run(acc)
    return summary


def drafter_windows(recipe: TrainDrafterRecipe, target, tokenizer, ranks: Ranks | None = None):
    """``(train, val, data record)``: the recipe's token windows (the corpus, or the target's answers,
    regenerated now or read from their cache) of ``seq_len + 1`` tokens; the drafter reads all of them
    (no shift: its targets come from the features). Regenerating and tokenizing are divided among
    ``ranks``; the record's ``tokenized_by_rank`` says how (per split, the shards each rank tokenized)."""
    chat = recipe.target.chat_template_kwargs
    splits, data_cfg, record = training_splits(
        recipe.data, recipe.regenerate, target, tokenizer, recipe.seed, ranks, chat
    )
    train = make_windows(
        splits.train, tokenizer, data_cfg, "train", recipe.seed, recipe.features.max_windows, ranks, chat
    )
    val = make_windows(splits.val, tokenizer, data_cfg, "val", recipe.seed, ranks=ranks, template_kwargs=chat)
    record["tokenized_by_rank"] = {"train": train.prepared_by_rank, "val": val.prepared_by_rank}
    return train, val, record


SCHEMA = TrainDrafterRecipe


def main(recipe: TrainDrafterRecipe, dry_run: bool = False) -> dict:
    set_threads(recipe.train.torch_threads)

    ### Target (frozen) and drafter
    acc = None if dry_run else make_accelerator(recipe.train, recipe.seed, recipe.output_dir, recipe.wandb)
    # a dry run builds both models on the meta device: shapes only, no weights read or allocated
    weightless = not dry_run and caches_complete(recipe)  # training from complete caches: no target weights
    target, tokenizer = meta_target(recipe.target) if dry_run else frozen_target(recipe, acc, weightless)
    mask_id = recipe.drafter.mask_token_id if recipe.drafter.mask_token_id is not None else tokenizer.mask_token_id
    if mask_id is None and DRAFTERS[recipe.drafter.kind][0].needs_mask_token:
        raise RecipeError(
            f"drafter.mask_token_id: the target's tokenizer has no mask token and a {recipe.drafter.kind} drafter "
            "needs one; set drafter.mask_token_id to a token id the target does not use (a reserved one)"
        )
    with torch.device("meta") if dry_run else contextlib.nullcontext():
        drafter = build_drafter(recipe.drafter, target, resolve_target_path(recipe.target.path), mask_id)
    # vLLM's hidden-states files hold the final state before the target's final norm: a copy normalises it
    norm = copy.deepcopy(final_norm(target)).cpu() if recipe.features.format == "vllm" and not dry_run else None
    if weightless:
        target.to("meta")  # what it read is copied into the drafter; the target holds no memory from here on
    capture = FeatureCapture(target, drafter.config.target_layer_ids)
    quant = QuantStage(recipe.quant, drafter)  # the layer map against this drafter: errors before any compute
    if dry_run:
        return {
            "drafter": model_summary(drafter),
            "target": model_summary(target),
            "target_layer_ids": drafter.config.target_layer_ids,
            "quant": quant.summary(),
            "memory_gib_per_device": memory_estimate(recipe, target, drafter),
        }

    ### Data, tokenized with the target's tokenizer; features online or from a cache
    train, val, data_record = drafter_windows(recipe, target, tokenizer, Ranks.of(acc))  # every rank prepares its share
    if recipe.drafter.draft_vocab:  # before any step (and any resume): the tokens the training answers use most
        counts = train.token_counts(drafter.config.vocab_size)
        restrict_vocab(drafter, frequent_tokens(counts, recipe.drafter.draft_vocab))
        data_record["draft_vocab"] = {
            "size": recipe.drafter.draft_vocab,
            "coverage": round(coverage(drafter.draft_vocab.cpu(), counts), 4),
        }
    if recipe.features.mode == "offline":
        train, val = offline_windows(recipe, acc, capture, target, data_record, train, val, norm)

    if acc.is_main_process:
        write_run_header(
            recipe.output_dir,
            recipe,
            data=data_record,
            drafter=model_summary(drafter),
            target_layer_ids=drafter.config.target_layer_ids,
            layer_id_convention=LAYER_ID_CONVENTION,
            world_size=acc.num_processes,
        )
    if recipe.features.build_only:
        return cache_summary(recipe, acc, train, val, data_record)
    init_tracking(acc, recipe.wandb, recipe.output_dir, recipe.model_dump(mode="json"), Path(recipe.output_dir).name)

    block = drafter.config.model_type != "draftsmith_eagle3"

    def loss_fn(model, batch):
        ids, aux, last = batch_features(batch, capture)
        kwargs = {}
        if block and batch.first_sample is not None:  # anchors: a function of the data position, nothing else
            cfg = drafter.config
            gen = torch.Generator().manual_seed(recipe.seed * 1_000_003 + batch.first_sample)
            kwargs["anchors"] = sample_anchors(
                ids.shape[1], cfg.block_size, cfg.num_anchors, ids.shape[0], ids.device, gen, loss_mask=batch.loss_mask
            )
        out = model(ids, aux, last, loss_mask=batch.loss_mask, **kwargs)
        scored_tokens = batch.input_ids.numel() if batch.loss_mask is None else batch.loss_mask.sum()
        # real tokens: those the data scores (responses, not prompts or padding); labels: drafted positions with a loss
        return out.loss, {
            **(out.logs or {}),
            "count/scored_tokens": scored_tokens,
            "count/scored_labels": out.scored.sum(),
        }

    quant.prepare()  # qat: fake quantization before the optimizer is built
    trainer = Trainer(
        accelerator=acc,
        model=drafter,
        train_cfg=recipe.train,
        optim_cfg=recipe.optim,
        output_dir=recipe.output_dir,
        data=train,
        loss_fn=loss_fn,
        flops_per_token=drafter_flops_per_token(drafter, target, recipe.data.seq_len, recipe.features.mode == "online"),
        evaluate_fn=lambda m: evaluate_drafter(
            m, capture, val, recipe.train.micro_batch_size, recipe.train.eval_batches, acc
        ),
        best_metric="val_simulated_tau",
        greater_is_better=True,
        save_extra=tokenizer.save_pretrained,
        before_step=quant.before_step,
    )
    result = trainer.fit()

    ### Final drafter and summary
    out = Path(recipe.output_dir)
    trainer.save_model(out / "model")
    summary = {
        "checkpoint": str(out / "model"),
        "best_checkpoint": str(out / "checkpoints" / "best"),
        "kind": recipe.drafter.kind,
        "target": recipe.target.path,
        "target_layer_ids": drafter.config.target_layer_ids,
        "block_size": drafter.config.block_size,
        "steps": result.step,
        "world_size": result.world_size,
        "train_seconds": round(result.train_seconds, 2),
        "tokens_per_s": round(result.tokens_per_s, 1),
        **{f"{k}_per_s": round(v, 1) for k, v in result.count_rates.items()},
        "mfu": round(result.mfu, 4),
        "best_simulated_tau": result.best_metric,
        "best_step": result.best_step,
        **result.final_eval,
    }
    if quant.enabled:  # quant.mode ptq / qat: the quantized drafter in model_quantized/, quant_report.{json,md}
        summary["quant"] = quant.finish(
            acc.unwrap_model(trainer.model, keep_torch_compile=False),
            trainer.evaluate_fn,
            out,
            "val_simulated_tau",
            tokenizer,
            exclude_from_bytes=("embed_tokens", "lm_head"),
            is_main_process=acc.is_main_process,
        )
    if acc.is_main_process:
        tokenizer.save_pretrained(out / "model")
        write_json_atomic(out / "summary.json", summary)
    end_run(acc)
    return summary
