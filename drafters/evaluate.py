"""Building drafters for a target, and evaluating them offline (simulated acceptance, calibration).

Evaluation runs the frozen target over fixed held-out windows, drafts with fixed anchors (a generator
seeded per batch, so every evaluation of every drafter sees the same blocks), and accumulates
:func:`drafters.core.acceptance_stats`. For DSpark it also scores the confidence head against the
event it should predict (the drafted token equals the target's argmax): expected calibration error
(10 equal-width bins) and AUROC.
"""

from __future__ import annotations

import torch

from distill.feature_cache import batch_features
from distill.features import FeatureCapture, default_layer_ids, final_norm

from . import DRAFTERS
from .core import acceptance_stats, sample_anchors, summarize_acceptance


def build_drafter(section, target, target_name: str, mask_token_id: int | None):
    """A randomly initialised drafter of ``section.kind`` sized for ``target``, with its embeddings and head."""
    tc = target.config
    layer_ids = section.target_layer_ids or default_layer_ids(tc.num_hidden_layers, 3 if section.kind == "eagle3" else section.num_target_layers)
    heads = section.num_heads or tc.num_attention_heads
    config_cls, model_cls = DRAFTERS[section.kind]
    extra = {
        "dflash": {},
        "dspark": {"markov_rank": section.markov_rank, "confidence_weight": section.confidence_weight},
        "eagle3": {},
    }[section.kind]
    config = config_cls(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        num_hidden_layers=section.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=tc.hidden_size // heads,
        intermediate_size=section.intermediate_size or tc.intermediate_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_theta=(getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0),
        target_hidden_size=tc.hidden_size,
        target_layer_ids=layer_ids,
        target_name_or_path=target_name,
        mask_token_id=mask_token_id,
        block_size=section.block_size,
        block_attention=section.block_attention,
        num_anchors=section.num_anchors,
        qk_norm=section.qk_norm,
        loss_terms=section.loss,
        position_weighting=section.position_weighting,
        loss_gamma=section.loss_gamma,
        **extra,
    )
    if section.kind != "eagle3" and mask_token_id is None:
        raise ValueError("the target's tokenizer has no mask token; block drafters need one (add '<|mask|>')")
    drafter = model_cls(config).copy_target_io(target)
    if section.init_norm_scale is not None:
        with torch.no_grad():
            drafter.norm.weight.copy_(section.init_norm_scale * final_norm(target).weight)
    return drafter


def expected_calibration_error(conf: torch.Tensor, label: torch.Tensor, bins: int = 10) -> float:
    idx = (conf * bins).long().clamp(max=bins - 1)
    ece = torch.zeros((), dtype=torch.float64)
    for b in range(bins):
        sel = idx == b
        if sel.any():
            ece += sel.double().mean() * (conf[sel].double().mean() - label[sel].double().mean()).abs()
    return ece.item()


def auroc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); NaN with one class."""
    pos, neg = label.bool().sum().item(), (~label.bool()).sum().item()
    if pos == 0 or neg == 0:
        return float("nan")
    order = score.double().argsort()
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    # average ranks of tied scores
    uniq, inverse = torch.unique(score.double(), return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
    ranks = (sums / counts)[inverse]
    return ((ranks[label.bool()].sum() - pos * (pos + 1) / 2) / (pos * neg)).item()


@torch.no_grad()
def evaluate_drafter(model, capture: FeatureCapture, windows, batch_size: int, max_batches: int | None = None,
                     accelerator=None, prefix: str = "val") -> dict:
    device = accelerator.device if accelerator else next(model.parameters()).device
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    unwrapped = accelerator.unwrap_model(model) if accelerator else model
    cfg = unwrapped.config
    n = len(windows) if max_batches is None else min(len(windows), max_batches * batch_size)
    sums: dict[str, torch.Tensor] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    batches = torch.zeros((), dtype=torch.float64, device=device)
    confs, labels = [], []
    starts = list(range(0, n, batch_size))
    for b in starts[rank::world]:
        batch = windows.collate(list(range(b, min(b + batch_size, n)))).to(device)
        ids, aux, last = batch_features(batch, capture)
        kwargs = {}
        if cfg.model_type != "draftsmith_eagle3":
            gen = torch.Generator().manual_seed(b)
            kwargs["anchors"] = sample_anchors(ids.shape[1], cfg.block_size, cfg.num_anchors, ids.shape[0], device, gen,
                                               loss_mask=batch.loss_mask)
        out = model(ids, aux, last, loss_mask=batch.loss_mask, **kwargs)
        chains = out.scored.all(-1)  # only drafts whose every label is scored (responses, not prompts)
        stats = acceptance_stats(out.draft_logits[chains], out.target_logits[chains])
        for k, v in stats.items():
            sums[k] = sums.get(k, 0) + v
        loss_sum += out.loss.double()
        batches += 1
        if out.confidence is not None:
            confs.append(out.confidence[out.scored].float().cpu())
            labels.append((out.draft_logits.argmax(-1) == out.target_logits.argmax(-1))[out.scored].cpu())
    if accelerator:
        sums = {k: accelerator.reduce(v, "sum") for k, v in sums.items()}
        loss_sum, batches = accelerator.reduce(loss_sum, "sum"), accelerator.reduce(batches, "sum")
    metrics = {f"{prefix}_loss": (loss_sum / batches).item(), **summarize_acceptance(sums, prefix)}
    if confs:
        from accelerate.utils import gather_object

        conf, label = torch.cat(confs), torch.cat(labels)
        if accelerator and world > 1:
            conf, label = torch.cat(gather_object([conf])), torch.cat(gather_object([label]))
        metrics[f"{prefix}_confidence_ece"] = expected_calibration_error(conf, label)
        metrics[f"{prefix}_confidence_auroc"] = auroc(conf, label)
    return metrics
