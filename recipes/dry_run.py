"""Memory per GPU that ``draftsmith run RECIPE --dry-run`` prints before any compute: an estimate from
the shapes of models built on the meta device, not a measurement.

Every training recipe reports the same terms, in GiB per GPU, for a launch of ``num_processes`` GPUs
at DeepSpeed ZeRO stage ``zero_stage`` (0: no DeepSpeed, i.e. DDP or one process; default 8 GPUs,
ZeRO-2; ``--num-processes`` / ``--zero-stage`` on the command line):

* ``target_weights``: the frozen target, whole on every rank, in its dtype (a mixture of experts with
  all its experts: they are all resident);
* ``frozen_weights``: the trained model's frozen parameters (a drafter's copy of the target's
  embeddings and head); ``trainable_weights``: the rest. Under DeepSpeed with mixed precision the
  engine holds both in 16 bits, else as built (fp32). ZeRO-3 shards them over the GPUs;
* ``gradients``: one per trainable weight, in the weights' dtype; ZeRO-2 and -3 shard them;
* ``adamw_states``: AdamW's two fp32 moments (8 bytes a trainable parameter) plus, under DeepSpeed
  with 16-bit weights, the fp32 master copy (4 bytes); ZeRO-1, -2 and -3 shard them;
* ``features``: what the trained model reads of the target and holds for the step: a drafter's
  captured hidden states [B, T, H x (layers + 1)]; a student's teacher states [B, T, H] (chunked loss);
* ``activations``: ``34 bytes x tokens x hidden x layers`` in 16-bit, twice that in fp32 (Korthikanti
  et al. 2022, per layer without the attention-score term that SDPA / flash attention never store);
  tokens are the positions the trained layers run on (drafted positions for a drafter);
* ``loss_logits``: the fp32 vocabulary-sized rows the loss holds at once: ``copies x positions x V x
  4 bytes``, 6 copies for a divergence (both models' logits, their log-softmaxes, the mixture or
  ratio, the gradient), 3 for cross-entropy alone; positions are the whole micro-batch's, or a chunk.

Not counted: DeepSpeed's communication buckets, the transient fp32 gradient partition at the step,
DDP's reducer buckets, the target's transient forward activations, the CUDA context (~0.5-1 GiB) and
allocator fragmentation. Leave 10-15% headroom.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

GiB = 2**30

#: the terms of every memory table, in print order (``total`` is their sum)
MEMORY_KEYS = (
    "target_weights",
    "frozen_weights",
    "trainable_weights",
    "gradients",
    "adamw_states",
    "features",
    "activations",
    "loss_logits",
)

#: bytes of activations per token, channel and layer in 16-bit (Korthikanti et al. 2022, flash attention)
ACTIVATION_BYTES_16BIT = 34

#: fp32 vocabulary-sized copies a loss holds per position: a divergence between two models, cross-entropy
LOSS_COPIES = {"divergence": 6, "cross_entropy": 3}

FORMULAS = {
    "trainable_weights": "2 bytes (DeepSpeed, 16-bit) else as built x trainable parameters, / GPUs at ZeRO-3",
    "gradients": "weights' bytes x trainable parameters, / GPUs at ZeRO >= 2",
    "adamw_states": "(8 + 4 fp32 master under DeepSpeed 16-bit) x trainable parameters, / GPUs at ZeRO >= 1",
    "activations": "34 bytes x tokens x hidden x layers (16-bit; x2 in fp32)",
    "loss_logits": "copies (6 divergence, 3 CE) x positions held x vocabulary x 4 bytes",
}


@dataclass(frozen=True)
class Launch:
    """The launch a dry run estimates for: GPUs (processes) and DeepSpeed ZeRO stage (0 = no DeepSpeed)."""

    num_processes: int = 8
    zero_stage: int = 2

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")


_LAUNCH: ContextVar[Launch | None] = ContextVar("dry_run_launch", default=None)


@contextlib.contextmanager
def estimate_for(launch: Launch) -> Iterator[Launch]:
    """Within the block, dry runs estimate memory for ``launch``."""
    token = _LAUNCH.set(launch)
    try:
        yield launch
    finally:
        _LAUNCH.reset(token)


def current_launch() -> Launch:
    """The launch set by :func:`estimate_for`, else the default (8 GPUs, ZeRO-2)."""
    return _LAUNCH.get() or Launch()


def meta_target(cfg):
    """``(target, tokenizer)`` of a :class:`~distill.config.TargetConfig` built on the meta device; a hub
    id the hub cache lacks is built from its shipped config (:mod:`distill.config.targets`)."""
    from distill.config.targets import allow_shipped_target_configs
    from distill.models import load_target

    with allow_shipped_target_configs():
        return load_target(cfg, "meta", weights=False)


def weight_bytes(params) -> int:
    """Bytes of ``params`` (an iterable of tensors), each in its own dtype."""
    return sum(p.numel() * p.element_size() for p in params)


def training_state(model, mixed_precision: str, launch: Launch) -> dict[str, float]:
    """Bytes per GPU of ``model``'s frozen and trainable weights, gradients and AdamW states when it
    trains under ``launch`` (module doc)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    deepspeed, half = launch.zero_stage > 0, mixed_precision != "no"
    if deepspeed:  # the engine casts the whole module to bf16 / fp16 under mixed precision
        size = 2 if half else 4
        frozen_bytes, trainable_bytes = size * sum(p.numel() for p in frozen), size * n_trainable
    else:  # autocast: weights stay as built
        size = trainable[0].element_size() if trainable else 4
        frozen_bytes, trainable_bytes = weight_bytes(frozen), weight_bytes(trainable)
    master = 4 if deepspeed and half else 0
    gpus, stage = launch.num_processes, launch.zero_stage
    return {
        "frozen_weights": frozen_bytes / (gpus if stage >= 3 else 1),
        "trainable_weights": trainable_bytes / (gpus if stage >= 3 else 1),
        "gradients": size * n_trainable / (gpus if stage >= 2 else 1),
        "adamw_states": (8 + master) * n_trainable / (gpus if stage >= 1 else 1),
    }


def activation_bytes(tokens: int, hidden: int, layers: int, mixed_precision: str) -> float:
    """Stored activations of ``layers`` transformer layers of width ``hidden`` over ``tokens`` positions."""
    return ACTIVATION_BYTES_16BIT * tokens * hidden * layers * (1 if mixed_precision != "no" else 2)


def loss_bytes(positions_held: int, vocab: int, loss: str) -> int:
    """The fp32 vocabulary-sized rows a ``loss`` (a key of :data:`LOSS_COPIES`) holds at once."""
    return LOSS_COPIES[loss] * positions_held * vocab * 4


def trained_layers(model_cfg) -> int:
    """Layers whose activations a :class:`~distill.config.ModelConfig` model stores for the backward: a
    Parcae model's prelude and coda once, its core for the iterations that carry gradients."""
    p = model_cfg.parcae
    if p is None:
        return model_cfg.num_layers
    return p.prelude_layers + p.core_layers * min(p.backprop_depth, p.mean_recurrence) + p.coda_layers


def memory_table(parts: dict[str, float], launch: Launch, mixed_precision: str, **counts) -> dict:
    """The machine-readable table: every :data:`MEMORY_KEYS` term in GiB per GPU (0 when absent) and
    ``total``, rounded to 0.01; the same in whole bytes under ``bytes``; the launch assumed, ``counts``
    (positions and the like) and the formulas."""
    unknown = set(parts) - set(MEMORY_KEYS)
    if unknown:
        raise KeyError(f"not memory terms: {sorted(unknown)}")
    exact = {k: int(parts.get(k, 0)) for k in MEMORY_KEYS}
    exact["total"] = sum(exact.values())
    table = {k: round(v / GiB, 2) for k, v in exact.items()}
    table.update(
        num_processes=launch.num_processes, zero_stage=launch.zero_stage, mixed_precision=mixed_precision, **counts
    )
    table["bytes"] = exact
    table["formulas"] = FORMULAS
    return table


def format_memory_table(table: dict) -> str:
    """``table`` (:func:`memory_table`) as aligned text lines."""
    launch = (
        f"{table['num_processes']} GPU(s), "
        + (f"DeepSpeed ZeRO-{table['zero_stage']}" if table["zero_stage"] else "no DeepSpeed")
        + f", mixed precision {table['mixed_precision']}"
    )
    lines = [f"memory per GPU, GiB (estimate from shapes; {launch})"]
    lines += [f"  {k:18s} {table[k]:9.2f}" for k in MEMORY_KEYS]
    lines.append(f"  {'total':18s} {table['total']:9.2f}")
    lines += [f"  {k}: {v}" for k, v in table["formulas"].items()]
    return "\n".join(lines)
