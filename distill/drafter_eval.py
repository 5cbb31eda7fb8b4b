"""Building drafters for a target, and evaluating them offline (simulated acceptance, calibration).

Evaluation runs the frozen target over fixed held-out windows, drafts with fixed anchors (a generator
seeded per batch, so every evaluation of every drafter sees the same blocks), and accumulates
:func:`drafters.metrics.acceptance_stats` (per-position acceptance, ``block_tau``). The *simulated tau*
replays greedy decoding over every held-out answer (:func:`replay_decoding`): on the target's own
greedy answers (a ``regenerate:`` recipe's held-out set) that is what the decoding loop measures. For DSpark it also scores the confidence head against the
event it should predict (the drafted token equals the target's argmax): expected calibration error
(10 equal-width bins) and AUROC.
"""

from __future__ import annotations

import torch

from drafters import DRAFTERS, is_block_drafter, unwrapped
from drafters.masks import sample_anchors
from drafters.metrics import acceptance_stats, accepted_lengths, decode_walk, summarize_acceptance

from .base.features import FeatureCapture, default_layer_ids, final_norm
from .base.lm import rank_batches
from .feature_cache import batch_features


def target_rope(config) -> dict:
    """The target's RoPE settings (``rope_parameters``) for a drafter. A target with one set per layer
    type (Gemma 3: local RoPE on its sliding layers, global on the others) gives its full-attention
    layers' set: the drafter attends to the whole context, as those layers do."""
    rope = getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_theta", 10000.0),
    }
    if "rope_type" not in rope and "full_attention" in rope:
        rope = rope["full_attention"]
    return dict(rope)


def sliding_layers(section) -> dict:
    """The drafter config's ``layer_types`` / ``sliding_window`` / ``sliding_block_attention`` of a drafter section."""
    if section.sliding_window is None:
        return {}
    slides = [section.sliding_layers == "all" or i % 2 == 0 for i in range(section.num_layers)]
    return {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in slides],
        "sliding_window": section.sliding_window,
        "sliding_block_attention": section.sliding_block_attention,
    }


def build_drafter(section, target, target_name: str, mask_token_id: int | None):
    """A randomly initialised drafter of ``section.kind`` sized for ``target``, with its embeddings and head."""
    tc = target.config
    config_cls, model_cls = DRAFTERS[section.kind]
    layer_ids = section.target_layer_ids or default_layer_ids(
        tc.num_hidden_layers, config_cls.fixed_target_layers or section.num_target_layers
    )
    heads = section.num_heads or tc.num_attention_heads
    extra = {key: getattr(section, key) for key in config_cls.recipe_keys}
    config = config_cls(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        num_hidden_layers=section.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=tc.hidden_size // heads,
        intermediate_size=section.intermediate_size or tc.intermediate_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_parameters=target_rope(tc),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        hidden_act=getattr(tc, "hidden_act", "silu"),
        target_hidden_size=tc.hidden_size,
        target_layer_ids=layer_ids,
        target_name_or_path=target_name,
        mask_token_id=mask_token_id,
        block_size=section.block_size,
        block_attention=section.block_attention,
        **sliding_layers(section),
        num_anchors=section.num_anchors,
        qk_norm=section.qk_norm,
        loss_terms=section.loss,
        position_weighting=section.position_weighting,
        loss_gamma=section.loss_gamma,
        loss_chunk=section.loss_chunk,
        **extra,
    )
    if config_cls.needs_mask_token and mask_token_id is None:
        raise ValueError("the target's tokenizer has no mask token; block drafters need one (add '<|mask|>')")
    drafter = model_cls(config).copy_target_io(target)
    if section.init_from is not None:
        drafter.load_own_weights(section.init_from)
    elif section.init_norm_scale is not None:
        with torch.no_grad():
            drafter.norm.weight.copy_(section.init_norm_scale * final_norm(target).weight)
    return drafter


def answer_span(loss_mask: torch.Tensor | None, row: int, length: int) -> tuple[int, int] | None:
    """First and last position of the scored answer in a window (the whole window without a mask)."""
    if loss_mask is None:
        return 1, length - 1
    scored = loss_mask[row].nonzero()
    return (int(scored[0]), int(scored[-1])) if len(scored) > 1 else None


@torch.no_grad()
def replay_decoding(model, cfg, ids, aux, last, loss_mask, out, chunk: int = 64) -> tuple[int, int]:
    """Greedy decoding replayed over each window's answer (:func:`drafters.metrics.decode_walk`):
    ``(tokens, target forwards)`` summed over the batch. Block drafters draft a block at every anchor
    of the window (in chunks of ``chunk`` anchors: how many forwards depends on the window's length
    alone, never on its data, so every rank of a sharded model runs as many); EAGLE-3's forward
    already drafts a chain from every position (chain ``t`` is the draft after the bonus token at
    ``t + 1``). ``model`` may be wrapped (DDP, DeepSpeed, FSDP, compiled)."""
    B, L = ids.shape
    spans = [answer_span(loss_mask, r, L) for r in range(B)]
    if not is_block_drafter(model):
        kept = accepted_lengths(out.draft_tokens, out.target_tokens, out.scored)  # [B, chains]
        anchors = torch.arange(1, kept.shape[1] + 1, device=ids.device)[None].expand(B, -1)
    else:
        hi = L - cfg.block_size  # the last anchor whose block fits the window
        every = torch.arange(1, hi + 1, device=ids.device)
        kept = []
        for part in every.split(chunk):
            anchors = part[None].expand(B, -1)
            o = model(ids, aux, last, anchors=anchors, loss_mask=loss_mask)
            kept.append(accepted_lengths(o.draft_tokens, o.target_tokens, o.scored))
        kept, anchors = torch.cat(kept, dim=1), every[None].expand(B, -1)
    tokens = forwards = 0
    for r, span in enumerate(spans):
        if span is None:
            continue
        t, f = decode_walk(dict(zip(anchors[r].tolist(), kept[r].tolist())), *span)
        tokens, forwards = tokens + t, forwards + f
    return tokens, forwards


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
def evaluate_drafter(
    model,
    capture: FeatureCapture,
    windows,
    batch_size: int,
    max_batches: int | None = None,
    accelerator=None,
    prefix: str = "val",
) -> dict:
    device = accelerator.device if accelerator else next(model.parameters()).device
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    cfg = unwrapped(model).config
    n = len(windows) if max_batches is None else min(len(windows), max_batches * batch_size)
    sums: dict[str, torch.Tensor] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    batches = torch.zeros((), dtype=torch.float64, device=device)
    confs, labels, confident = [], [], False
    walk = torch.zeros(2, dtype=torch.float64, device=device)  # tokens, target forwards of the replayed decoding
    for b, real in rank_batches(n, batch_size, rank, world):  # as many forwards on every rank (ZeRO-3 / FSDP gathers)
        batch = windows.collate(list(range(b, min(b + batch_size, n)))).to(device)
        ids, aux, last = batch_features(batch, capture)
        kwargs = {}
        if is_block_drafter(model):
            gen = torch.Generator().manual_seed(b)
            kwargs["anchors"] = sample_anchors(
                ids.shape[1], cfg.block_size, cfg.num_anchors, ids.shape[0], device, gen, loss_mask=batch.loss_mask
            )
        out = model(ids, aux, last, loss_mask=batch.loss_mask, **kwargs)
        weight = float(real)  # a padding batch runs for its collectives and counts nowhere (every sum's keys alike)
        walk += weight * torch.tensor(
            replay_decoding(model, cfg, ids, aux, last, batch.loss_mask, out), dtype=torch.float64, device=device
        )
        chains = out.scored.all(-1)  # only drafts whose every label is scored (responses, not prompts)
        stats = acceptance_stats(out.draft_tokens[chains], out.target_tokens[chains], out.accept[chains])
        for k, v in stats.items():
            sums[k] = sums.get(k, 0) + weight * v
        loss_sum += weight * out.loss.double()
        batches += weight
        confident = out.confidence is not None
        if confident and real:
            confs.append(out.confidence[out.scored].float().cpu())
            labels.append((out.draft_tokens == out.target_tokens)[out.scored].cpu())
    if accelerator:
        sums = {k: accelerator.reduce(v, "sum") for k, v in sums.items()}
        loss_sum, batches = accelerator.reduce(loss_sum, "sum"), accelerator.reduce(batches, "sum")
        walk = accelerator.reduce(walk, "sum")
    metrics = {
        f"{prefix}_loss": (loss_sum / batches).item(),
        **summarize_acceptance(sums, prefix),
        f"{prefix}_simulated_tau": (walk[0] / walk[1].clamp_min(1)).item(),
    }
    if confident:  # the same on every rank (the model's kind), so every rank gathers
        from accelerate.utils import gather_object

        conf, label = torch.cat(confs or [torch.zeros(0)]), torch.cat(labels or [torch.zeros(0, dtype=torch.bool)])
        if accelerator and world > 1:
            conf, label = torch.cat(gather_object([conf])), torch.cat(gather_object([label]))
        metrics[f"{prefix}_confidence_ece"] = expected_calibration_error(conf, label)
        metrics[f"{prefix}_confidence_auroc"] = auroc(conf, label)
    return metrics
