"""Exporting drafters into the folders serving engines load, and reading those folders back.

Three formats, one mapping each way (``to_*`` writes, ``from_*`` reads a folder back into a draftsmith
drafter so the parity gate can run what was written):

``transformers`` (draftsmith's own)
    ``save_pretrained`` of the drafter plus its tokenizer; ``AutoModel.from_pretrained`` loads it once
    ``import drafters`` has registered the classes. Layer ids keep the project's convention.

``speculators`` (vLLM's drafter format, ``speculators`` library 0.9)
    ``config.json`` with ``speculators_model_type`` (``dflash`` / ``dspark`` / ``eagle3``),
    ``speculators_config`` (algorithm, a greedy proposal of ``block_size - 1`` tokens, the verifier's
    name and architectures), a ``transformer_layer_config`` (``qwen3`` when the layers have per-head
    q/k norms, ``llama`` otherwise) and the auxiliary layer ids in **that library's convention: id i is
    the input of decoder layer i** (``hidden_states[i]``; id = num_layers is the final state before the
    last norm). Draftsmith records *outputs* (:mod:`distill.base.features`), so ids are shifted by +1 here
    and only here; the parity gate recomputes features from the written ids to prove the shift.
    Weights use the library's names (``layers.N.self_attn.q_proj.weight``, ``fc.weight``, ...).
    DFlash/DSpark checkpoints omit ``embed_tokens`` and ``lm_head`` (the library and vLLM rebuild both
    from the verifier, which is what the drafter froze them to); EAGLE-3 keeps both.

``sglang_eagle3`` (SGLang / SpecForge EAGLE-3, the baseline only)
    ``LlamaForCausalLMEagle3`` ``config.json`` (``draft_vocab_size``, ``tie_word_embeddings: false`` so
    SGLang reads our ``lm_head`` instead of reusing the embedding, ``eagle_config`` with
    ``eagle_aux_hidden_state_layer_ids`` in SGLang's *output-of-layer* convention, the same as ours:
    SGLang itself adds 1 when it picks the layers to capture) and weights ``midlayer.*``, ``fc``,
    ``norm``, ``lm_head``, ``embed_tokens``, ``d2t`` and ``t2d``.

**Draft vocabularies** (:mod:`drafters.vocab`): a drafter restricted to N target tokens exports as
those engines load one: ``draft_vocab_size: N``, ``d2t`` (draft id i -> target id ``i + d2t[i]``) and
``t2d`` (target ids that have a draft id) in the weights, and every head onto the vocabulary pruned
to those N rows (``lm_head``, which DFlash / DSpark then write too: the library keeps a pruned head in
the checkpoint rather than rebuild it from the verifier; DSpark's ``markov_w2``). A drafter over the
whole vocabulary writes ``draft_vocab_size = vocab_size`` (speculators: no tables; SGLang: the identity).

**Attention** of block drafters round-trips both ways (:func:`speculators_attention`,
:func:`read_speculators_attention`): full-context layers with bidirectional blocks, sliding-window
layers (``layer_types``, ``sliding_window``) with causal or bidirectional blocks
(``sliding_window_non_causal``), and causal blocks over the whole context (a sliding layer whose window
holds every position).

What a format cannot express is refused with :class:`ExportError`, never approximated:
DFlash/DSpark layers without q/k norms (vLLM's DFlash layers are Qwen3 layers, which always apply
them; train with ``drafter.qk_norm: true``), sliding layers of two windows or two block attentions
(the format has one of each), EAGLE-3 with q/k norms in the SGLang Llama format. DSpark's Markov
head (``markov_head.markov_w1/w2``, vanilla) and confidence head (``confidence_head.proj``, fed
``[hidden ; markov code]``) map one to one onto speculators' ``dspark`` model; nothing is dropped.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from distill.base.features import LAYER_ID_CONVENTION

from . import DRAFTERS, kind_of
from .vocab import restrict_vocab

SPECULATORS_VERSION = "0.9.0"  # the library version the format was checked against (tests load it)
FORMATS = ("transformers", "speculators", "sglang_eagle3")


class ExportError(ValueError):
    """A drafter that a format cannot express exactly (the message says what and how to fix it)."""


# --------------------------------------------------------------------------------------------------
# Layer ids
# --------------------------------------------------------------------------------------------------


def speculators_layer_ids(config) -> list[int]:
    """Draftsmith ids (output of layer i) -> speculators ids (input of layer i + 1)."""
    if config.layer_id_convention != LAYER_ID_CONVENTION:
        raise ExportError(
            f"drafter records layer ids as {config.layer_id_convention!r}; export expects {LAYER_ID_CONVENTION!r}"
        )
    return [i + 1 for i in config.target_layer_ids]


def sglang_layer_ids(config) -> list[int]:
    """Draftsmith ids -> SGLang ``eagle_aux_hidden_state_layer_ids`` (also output of layer i: unchanged)."""
    if config.layer_id_convention != LAYER_ID_CONVENTION:
        raise ExportError(
            f"drafter records layer ids as {config.layer_id_convention!r}; export expects {LAYER_ID_CONVENTION!r}"
        )
    return list(config.target_layer_ids)


# --------------------------------------------------------------------------------------------------
# Weight names
# --------------------------------------------------------------------------------------------------

_LAYER = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm", "attn": "self_attn", "mlp": "mlp"}
_EAGLE_LAYER = {
    "embed_norm": "input_layernorm",
    "hidden_norm": "hidden_norm",
    "post_norm": "post_attention_layernorm",
    "attn": "self_attn",
    "mlp": "mlp",
}
_DSPARK = {
    "markov_in.weight": "markov_head.markov_w1.weight",
    "markov_out.weight": "markov_head.markov_w2.weight",
    "confidence.weight": "confidence_head.proj.weight",
    "confidence.bias": "confidence_head.proj.bias",
}
_TOP = {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight"}


def _rename_layer_key(rest: str, table: dict) -> str:
    head, _, tail = rest.partition(".")
    if head not in table:
        raise ExportError(f"no export name for layer parameter '{rest}'")
    return f"{table[head]}.{tail}"


def speculators_name(kind: str, key: str) -> str | None:
    """The speculators name of a draftsmith parameter (None: the format does not store it)."""
    if key == "draft_vocab":
        return None  # written as d2t / t2d
    if kind in ("dflash", "dspark"):
        if key in ("embed_tokens.weight", "lm_head.weight"):
            return None  # rebuilt from the verifier on load (vLLM and the library do the same)
        if kind == "dspark" and key in _DSPARK:
            return _DSPARK[key]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        if m:
            return f"layers.{m[1]}.{_rename_layer_key(m[2], _LAYER)}"
    elif kind == "eagle3" and key.startswith("layer."):
        return f"layers.0.{_rename_layer_key(key[len('layer.') :], _EAGLE_LAYER)}"
    if key in _TOP:
        return key
    raise ExportError(f"no speculators name for {kind} parameter '{key}'")


def sglang_name(key: str) -> str | None:
    if key == "draft_vocab":
        return None  # written as d2t / t2d
    if key.startswith("layer."):
        return f"midlayer.{_rename_layer_key(key[len('layer.') :], _EAGLE_LAYER)}"
    if key in _TOP:
        return key
    raise ExportError(f"no SGLang EAGLE-3 name for parameter '{key}'")


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------


def speculators_attention(cfg, target_config) -> dict:
    """A block drafter's per-layer attention (:func:`drafters.block.layer_attention`) as the speculators
    format holds it: ``layer_types`` / ``sliding_window`` / ``use_sliding_window`` in the layer config
    and ``sliding_window_non_causal``. There, a full-attention layer sees the whole context and its block
    both ways; a sliding layer sees the window and its block causally unless ``sliding_window_non_causal``
    (one window, one flag for all). A layer of ours with causal blocks over the whole context is a
    sliding layer whose window holds every position. Anything else raises :class:`ExportError`."""
    from .block import layer_attention

    whole = getattr(target_config, "max_position_embeddings", None) or cfg.max_position_embeddings
    layers = [(causal, window or (whole if causal else None)) for causal, window in layer_attention(cfg)]
    sliding = {(causal, window) for causal, window in layers if window is not None}
    if len(sliding) > 1:
        raise ExportError(
            f"{kind_of(cfg)} layers attending as {sorted(sliding, key=str)} (causal blocks, context window) cannot "
            "be expressed in the speculators format: its sliding layers share one window and one block attention"
        )
    if not sliding:
        return {"layer": {}, "sliding_window_non_causal": False}
    ((causal, window),) = sliding
    types = ["sliding_attention" if w is not None else "full_attention" for _, w in layers]
    return {
        "layer": {"layer_types": types, "sliding_window": window, "use_sliding_window": True},
        "sliding_window_non_causal": not causal,
    }


def read_speculators_attention(config: dict) -> dict:
    """The drafter config's ``block_attention`` / ``layer_types`` / ``sliding_window`` /
    ``sliding_block_attention`` of a speculators config, read as the library reads it: its layer config
    built by transformers (a Qwen3 config keeps ``sliding_window`` only with ``use_sliding_window``; a
    sliding layer without a window attends as a full one)."""
    from transformers import AutoConfig

    layer = dict(config["transformer_layer_config"])
    built = AutoConfig.for_model(layer.pop("model_type"), **layer)
    window = getattr(built, "sliding_window", None)
    types = list(getattr(built, "layer_types", None) or [])
    if window is None or "sliding_attention" not in types:
        return {"block_attention": "bidirectional"}
    causal = not config.get("sliding_window_non_causal", False)
    if (
        causal
        and window >= getattr(built, "max_position_embeddings", window + 1)
        and set(types) == {"sliding_attention"}
    ):
        return {"block_attention": "causal"}  # a window that holds every position: causal blocks, whole context
    return {
        "block_attention": "bidirectional",
        "layer_types": types,
        "sliding_window": window,
        "sliding_block_attention": "causal" if causal else "bidirectional",
    }


def _layer_config(cfg, target_config, model_type: str) -> dict:
    """The ``transformer_layer_config`` of a speculators export (a transformers Llama/Qwen3 config)."""
    return {
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": dict(cfg.rope_parameters),
        "max_position_embeddings": getattr(target_config, "max_position_embeddings", 4096),
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def check_expressible(cfg, fmt: str) -> None:
    """Raise :class:`ExportError` when ``fmt`` cannot express this drafter exactly."""
    kind = kind_of(cfg)
    if fmt == "speculators" and kind in ("dflash", "dspark"):
        if not getattr(cfg, "qk_norm", False):
            raise ExportError(
                f"{kind} without per-head q/k norms cannot be expressed in the speculators format: its "
                "DFlash layers are Qwen3 layers, which always normalise queries and keys; retrain with "
                "drafter.qk_norm: true"
            )
        speculators_attention(cfg, None)
    if fmt == "sglang_eagle3":
        if kind != "eagle3":
            raise ExportError(f"the SGLang EAGLE-3 format holds EAGLE-3 drafters only, not {kind}")
        if getattr(cfg, "qk_norm", False):
            raise ExportError("an EAGLE-3 drafter with q/k norms cannot be expressed in SGLang's Llama EAGLE-3 format")


def formats_for(cfg) -> dict[str, str | None]:
    """Each format -> None if it can hold this drafter, else the reason it cannot."""
    out = {}
    for fmt in FORMATS:
        try:
            check_expressible(cfg, fmt)
            out[fmt] = None
        except ExportError as e:
            out[fmt] = str(e)
    return out


def speculators_config(cfg, target_config, verifier_name_or_path: str) -> dict:
    kind = kind_of(cfg)
    check_expressible(cfg, "speculators")
    verifier = {
        "name_or_path": verifier_name_or_path,
        "architectures": list(getattr(target_config, "architectures", None) or []),
    }
    proposal = {
        "proposal_type": "greedy",
        "speculative_tokens": cfg.block_size - 1,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    layer_type = "qwen3" if getattr(cfg, "qk_norm", False) else "llama"
    common = {
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [proposal],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "transformer_layer_config": _layer_config(cfg, target_config, layer_type),
        "draft_vocab_size": draft_vocab_size(cfg),
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    if kind in ("dflash", "dspark"):
        attention = speculators_attention(cfg, target_config)
        common["transformer_layer_config"].update(attention["layer"])
        block = {
            "architectures": ["DFlashSpeculator" if kind == "dflash" else "DSparkSpeculator"],
            "block_size": cfg.block_size,
            "aux_hidden_state_layer_ids": speculators_layer_ids(cfg),
            "mask_token_id": cfg.mask_token_id,
            "sliding_window_non_causal": attention["sliding_window_non_causal"],
            # the anchor is the target's bonus token; block positions 1..K-1 draft (K-1 tokens)
            "sample_from_anchor": False,
        }
        if kind == "dspark":
            block.update(
                {
                    "markov_rank": cfg.markov_rank,
                    "markov_head_type": "vanilla",
                    "enable_confidence_head": True,
                    "confidence_head_with_markov": True,
                }
            )
        return {**common, **block}
    return {
        **common,
        "architectures": ["Eagle3Speculator"],
        "eagle_aux_hidden_state_layer_ids": speculators_layer_ids(cfg),
        # residual on the un-normed hidden half, no extra norms: vLLM defaults norm_before_residual to true
        # when the key is absent, so every flag is written out
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
    }


def sglang_config(cfg, target_config) -> dict:
    check_expressible(cfg, "sglang_eagle3")
    layer = _layer_config(cfg, target_config, "llama")
    rope = layer.pop("rope_parameters")
    scaling = (
        None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    )  # HF's legacy form
    return {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "draft_vocab_size": draft_vocab_size(cfg),
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": "float32",
        "bos_token_id": getattr(target_config, "bos_token_id", None),
        "eos_token_id": getattr(target_config, "eos_token_id", None),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(cfg), "use_aux_hidden_state": True},
    }


# --------------------------------------------------------------------------------------------------
# Writing and reading folders
# --------------------------------------------------------------------------------------------------


def _contiguous(state: dict) -> dict:
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def draft_vocab_size(cfg) -> int:
    return getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size


#: the heads onto the vocabulary, pruned to the draft vocabulary's rows in an export (by format name)
_PRUNED = ("lm_head.weight", "markov_head.markov_w2.weight")


def _vocab_tables(drafter, state: dict, full_tables: bool) -> None:
    """Add ``d2t`` / ``t2d`` to an export's ``state`` and prune its heads to the draft vocabulary's rows
    (module doc); ``full_tables``: write identity tables for a drafter over the whole vocabulary."""
    from .vocab import d2t, t2d

    V = drafter.config.vocab_size
    ids = drafter.draft_vocab_ids()
    if ids is None:
        if full_tables:
            state["d2t"], state["t2d"] = torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool)
        return
    ids = ids.cpu()
    for name in _PRUNED:
        if name in state:
            state[name] = state[name][ids]
    state["d2t"], state["t2d"] = d2t(ids), t2d(ids, V)


def _unpruned(state: dict, vocab_size: int, heads: dict, source: str) -> torch.Tensor | None:
    """Read an export's draft vocabulary back: its ids (None: the whole vocabulary), and each pruned
    head in ``state`` scattered back over the vocabulary onto ``heads[name]`` (the rows the format
    does not hold: the verifier's, or zeros)."""
    if "d2t" not in state or state["t2d"].all():
        return None
    ids = torch.arange(len(state["d2t"])) + state["d2t"]
    if not torch.equal(ids, state["t2d"].nonzero().view(-1)) or len(state["t2d"]) != vocab_size:
        raise ExportError(f"{source}: d2t and t2d disagree on the draft vocabulary")
    for name, base in heads.items():
        if name in state:
            full = base.detach().clone().cpu()
            full[ids] = state[name]
            state[name] = full
    return ids


def write_speculators(drafter, target_config, verifier_name_or_path: str, folder: Path) -> dict:
    """Write the speculators folder; returns its config."""
    cfg = drafter.config
    config = speculators_config(cfg, target_config, verifier_name_or_path)
    kind = kind_of(cfg)
    state = {}
    for key, value in drafter.state_dict().items():
        name = speculators_name(kind, key)
        if name is not None:
            state[name] = value
    if drafter.draft_vocab_ids() is not None:  # a pruned head is stored, for every kind (module doc)
        state["lm_head.weight"] = drafter.lm_head.weight
    _vocab_tables(drafter, state, full_tables=False)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_contiguous(state), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def write_sglang_eagle3(drafter, target_config, folder: Path) -> dict:
    cfg = drafter.config
    config = sglang_config(cfg, target_config)
    state = {sglang_name(k): v for k, v in drafter.state_dict().items() if sglang_name(k) is not None}
    _vocab_tables(drafter, state, full_tables=True)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_contiguous(state), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def _fill(drafter, state: dict, rename, source: str) -> None:
    """Load ``state`` (format names) into ``drafter`` through ``rename`` (draftsmith name -> format name or None)."""
    own = drafter.state_dict()
    loaded, wanted = {}, set()
    for key in own:
        name = rename(key)
        if name is None:
            continue
        wanted.add(name)
        if name not in state:
            raise ExportError(f"{source}: missing weight '{name}' (for {key})")
        loaded[key] = state[name]
    extra = set(state) - wanted - {"d2t", "t2d"}
    if extra:
        raise ExportError(f"{source}: unexpected weights {sorted(extra)}")
    drafter.load_state_dict(loaded, strict=False)


def read_speculators(folder: Path, verifier) -> tuple[torch.nn.Module, dict]:
    """A draftsmith drafter holding the weights of a speculators folder (embeddings and head from
    ``verifier``, as the library rebuilds them), and the folder's config. Layer ids are *not* read
    into the model: the gate feeds it features computed from the config's ids itself."""

    config = json.loads((Path(folder) / "config.json").read_text())
    kind = config["speculators_model_type"]
    layer = config["transformer_layer_config"]
    ids = config.get("aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
    extra = {"markov_rank": config["markov_rank"]} if kind == "dspark" else {}
    config_cls, model_cls = DRAFTERS[kind]
    cfg = config_cls(
        vocab_size=layer["vocab_size"],
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_hidden_layers=layer["num_hidden_layers"] if kind != "eagle3" else 1,
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer["head_dim"],
        rms_norm_eps=layer["rms_norm_eps"],
        rope_parameters=layer["rope_parameters"],
        hidden_act=layer["hidden_act"],
        target_hidden_size=config["target_hidden_size"],
        target_layer_ids=[i - 1 for i in ids],
        mask_token_id=config.get("mask_token_id"),
        block_size=config.get(
            "block_size", config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] + 1
        ),
        qk_norm=layer["model_type"] == "qwen3",
        **(read_speculators_attention(config) if kind != "eagle3" else {}),
        **extra,
    )
    drafter = model_cls(cfg).copy_target_io(verifier)
    state = load_file(str(Path(folder) / "model.safetensors"))
    heads = {"lm_head.weight": drafter.lm_head.weight}
    if kind == "dspark":
        heads["markov_head.markov_w2.weight"] = torch.zeros_like(drafter.markov_out.weight)
    ids = _unpruned(state, cfg.vocab_size, heads, str(folder))
    if kind in ("dflash", "dspark") and "lm_head.weight" in state:  # a draft vocabulary's pruned head
        drafter.lm_head.weight.data.copy_(state.pop("lm_head.weight"))
    _fill(drafter, state, lambda k: speculators_name(kind, k), str(folder))
    return (drafter if ids is None else restrict_vocab(drafter, ids)).eval(), config


def read_sglang_eagle3(folder: Path, block_size: int = 8) -> tuple[torch.nn.Module, dict]:
    """A draftsmith EAGLE-3 drafter holding the weights of an SGLang folder. The format does not record
    how many steps to draft (a serving flag), so ``block_size`` (steps + 1) is given."""

    config = json.loads((Path(folder) / "config.json").read_text())
    config_cls, model_cls = DRAFTERS["eagle3"]
    cfg = config_cls(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rms_norm_eps=config["rms_norm_eps"],
        hidden_act=config["hidden_act"],
        rope_parameters={
            "rope_theta": config["rope_theta"],
            **(config.get("rope_scaling") or {"rope_type": "default"}),
        },
        target_hidden_size=config["target_hidden_size"],
        target_layer_ids=list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        block_size=block_size,
    )
    drafter = model_cls(cfg)
    state = load_file(str(Path(folder) / "model.safetensors"))
    # the rows SGLang's pruned lm_head leaves out are never used: any will do (the embedding's)
    ids = _unpruned(state, cfg.vocab_size, {"lm_head.weight": state["embed_tokens.weight"]}, str(folder))
    _fill(drafter, state, sglang_name, str(folder))
    return (drafter if ids is None else restrict_vocab(drafter, ids)).eval(), config


def source_record(drafter_dir: str | os.PathLike) -> dict:
    """What the drafter's training run recorded: its recipe, provenance, summary and the checkpoint's
    own metrics, found in the checkpoint folder or up to two folders above it."""
    folder = Path(drafter_dir).resolve()
    record: dict = {"checkpoint": str(folder)}
    state = folder / "trainer_state.json"
    if state.exists():
        record["checkpoint_metrics"] = json.loads(state.read_text())
    for parent in (folder, folder.parent, folder.parent.parent):
        for name, key in (
            ("summary.json", "summary"),
            ("provenance.json", "provenance"),
            ("recipe.yaml", "recipe_file"),
        ):
            if key not in record and (parent / name).exists():
                record[key] = str(parent / name) if name.endswith(".yaml") else json.loads((parent / name).read_text())
    return record


def recorded_simulated_tau(record: dict) -> float | None:
    """The simulated tau measured at training for exactly this checkpoint (best: its trainer_state;
    the final model folder: the run summary's last evaluation)."""
    metrics = record.get("checkpoint_metrics") or {}
    if "val_simulated_tau" in metrics:
        return float(metrics["val_simulated_tau"])
    summary = record.get("summary") or {}
    ckpt = Path(record["checkpoint"])
    if summary and ckpt.name == "model" and "val_simulated_tau" in summary:
        return float(summary["val_simulated_tau"])
    return None
