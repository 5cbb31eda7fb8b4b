"""Causal LMs: named builders for the models the project trains, and loading of frozen targets.

Builders follow torchtune's habit of named functions (``testbed_target()``, ``tiny_target()``)
that return a :class:`~distill.config.ModelConfig`; :func:`build_causal_lm` turns one into a
``transformers`` Llama, Qwen3 or Parcae (:mod:`parcae`) model, so everything downstream (KV caches, ``generate``,
``save_pretrained``, serving engines) treats our models exactly like a hub checkpoint.

"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from .base.features import final_norm
from .base.flops import matmul_params
from .config import ModelConfig, RecipeError, TargetConfig
from .target_files import checkpoint_folder, read_tensors
from .testbed import SHIPPED_TARGET

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def testbed_target() -> ModelConfig:
    """The shipped testbed target: ~11M parameters, Llama architecture, 4096-token BPE."""
    return ModelConfig(
        arch="llama", hidden_size=320, num_layers=8, num_heads=5, intermediate_size=864, max_position_embeddings=1024
    )


def tiny_target() -> ModelConfig:
    """A model that trains in seconds, for tests."""
    return ModelConfig(
        arch="llama", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_position_embeddings=256
    )


@torch.no_grad()
def init_from_target_layers(student, target, layers: list[int]) -> None:
    """Start ``student`` from ``target``: its embeddings, final norm, head and decoder ``layers`` (in order;
    layer dropping, so a small drafter starts from a pretrained LM as PARD adapts one). The student must
    be the target's architecture with ``len(layers)`` layers; a mismatch names the first parameter."""
    if student.config.num_hidden_layers != len(layers):
        raise RecipeError(
            f"init_from_target_layers {layers}: {len(layers)} layers, but the student has "
            f"student.num_layers = {student.config.num_hidden_layers}"
        )
    depth = target.config.num_hidden_layers
    if any(not 0 <= i < depth for i in layers):
        raise RecipeError(f"init_from_target_layers {layers}: the target has layers 0..{depth - 1}")
    source = target.state_dict()
    for name, param in student.state_dict().items():
        parts = name.split(".")
        if "layers" in parts:  # the student's layer J is the target's layer layers[J]
            k = parts.index("layers") + 1
            parts[k] = str(layers[int(parts[k])])
        theirs = source.get(".".join(parts))
        if theirs is None or theirs.shape != param.shape:
            raise RecipeError(
                f"init_from_target_layers: the student's {name} {tuple(param.shape)} has no match in the "
                f"target ({'missing' if theirs is None else tuple(theirs.shape)}); give the student the "
                f"target's architecture (hidden_size, num_heads, num_kv_heads, intermediate_size)"
            )
        param.copy_(theirs)


def target_family_lm(target, num_layers: int, layers: list[int] | None = None, dtype: torch.dtype = torch.float32):
    """A randomly initialised causal LM of ``target``'s own architecture and sizes with ``num_layers``
    decoder layers (a student of any family: ``student.arch = target``). Per-layer kinds (sliding or full
    attention) follow the target's ``layers`` (the ones :func:`init_from_target_layers` will copy), else its
    first ``num_layers``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    layers = list(layers or range(num_layers))
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    for key in ("mlp_only_layers",):  # MoE layer lists name layers of the target
        if getattr(config, key, None):
            setattr(config, key, [j for j, i in enumerate(layers) if i in getattr(target.config, key)])
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build_causal_lm(
    cfg: ModelConfig, vocab_size: int, special_ids: dict | None = None, dtype: torch.dtype = torch.float32
):
    """A randomly initialised ``transformers`` causal LM for ``cfg``.

    ``special_ids`` maps ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` to ids (see
    :func:`special_token_ids`), so ``generate`` knows when to stop.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if cfg.arch == "target":
        raise RecipeError(
            "model.arch = target builds a student of its target's family (distill_student); this model has no target"
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        **(special_ids or {}),
    )
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.arch == "parcae":
        from parcae import ParcaeConfig

        p = cfg.parcae
        common.pop("num_hidden_layers")  # derived from the loop
        hf_cfg = ParcaeConfig(
            **common,
            rope_parameters=rope,
            n_prelude=p.prelude_layers,
            n_core=p.core_layers,
            n_coda=p.coda_layers,
            mean_recurrence=p.mean_recurrence,
            mean_backprop_depth=p.backprop_depth,
            injection_type=p.injection,
        )
    elif cfg.arch == "llama":
        hf_cfg = LlamaConfig(**common, rope_parameters=rope, attention_bias=False, mlp_bias=False)
    else:
        hf_cfg = Qwen3Config(**common, rope_parameters=rope, attention_bias=False)
    hf_cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)


def special_token_ids(tokenizer) -> dict:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def resolve_target_path(path: str) -> str:
    if path == "testbed":
        if not (SHIPPED_TARGET / "config.json").exists():
            raise FileNotFoundError(
                f"the shipped testbed target is missing at {SHIPPED_TARGET}; rebuild it with `make testbed-target`"
            )
        return str(SHIPPED_TARGET)
    return path


@contextlib.contextmanager
def _whole_under_zero3():
    """Under a DeepSpeed ZeRO-3 launch transformers builds every ``from_pretrained`` model inside
    ``deepspeed.zero.Init``, partitioned across ranks. A frozen target that only feeds features (or
    logits) to the model being trained must stay whole on each rank: ZeRO-3 shards what trains. There
    is no public switch, so transformers' module-level ZeRO-3 marker is cleared while the target loads."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def check_device_map(cfg: TargetConfig, num_processes: int) -> None:
    """Refuse ``target.device_map`` in a launch of more than one process: each process would place its own
    copy of the target over every device it sees. The split target needs one process given all the node's GPUs."""
    if cfg.device_map is not None and num_processes > 1:
        raise RecipeError(
            f"target.device_map: {cfg.device_map!r} splits the target over the node's devices in one process, "
            f"but this launch runs {num_processes} processes, each of which would place its own copy; run it "
            "as one process (`draftsmith run RECIPE`, which sees every GPU), e.g. to build the offline feature "
            "cache (features.build_only: true), then train from that cache under `accelerate launch` "
            "without target.device_map"
        )


def load_target(cfg: TargetConfig, device: str | torch.device = "cpu", weights: bool = True):
    """A frozen target (eval mode, no gradients) and its tokenizer, by hub id or local folder, on ``device``;
    with ``cfg.device_map`` placed as transformers' ``device_map`` says instead (``auto``: split by layers over
    every visible GPU; ``device`` is not used). ``weights=False``: the model built from its config on the meta
    device (shapes and dtypes, no memory, nothing downloaded but the config and tokenizer), for dry runs
    (:func:`meta_target`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import parcae  # noqa: F401  (registers Parcae with the Auto classes)

    path = resolve_target_path(cfg.path)
    try:
        if weights:
            with _whole_under_zero3():
                attention = None if cfg.attn_implementation == "auto" else cfg.attn_implementation
                model = AutoModelForCausalLM.from_pretrained(
                    path, dtype=DTYPES[cfg.dtype], attn_implementation=attention, device_map=cfg.device_map
                )
            tokenizer = AutoTokenizer.from_pretrained(path)
        else:
            model, tokenizer = meta_target(path, DTYPES[cfg.dtype])
            device = "meta"
    except ValueError as e:  # e.g. an attention kernel the architecture does not support (gpt-oss and SDPA)
        if "attn" not in str(e).lower() and "attention" not in str(e).lower():
            raise
        raise RecipeError(
            f"target.attn_implementation: {cfg.attn_implementation!r} cannot load {path}: "
            f"{str(e).splitlines()[0]} (use 'auto')"
        ) from None
    except OSError as e:  # a hub id that cannot be fetched (no network, no cache, no access)
        if Path(path).exists():
            raise
        raise RecipeError(
            f"target.path: '{path}' could not be loaded from the hub ({str(e).splitlines()[0]}); with "
            f"no network, set HF_HUB_OFFLINE=1 to use the local cache, or give a local folder"
        ) from None
    model = text_only(model)
    if cfg.device_map is None or not weights:
        model.to(device)
    model.eval().requires_grad_(False)
    return model, tokenizer


def load_target_io(cfg: TargetConfig, norm: bool = False):
    """``(target, tokenizer)`` without the target's weights, for training from a complete feature cache:
    the model built on the meta device from its config (:func:`meta_target`), with only what a drafter copies
    read from the checkpoint's safetensors files by tensor name, in ``cfg.dtype`` on the CPU: the input
    embeddings, the LM head (one tensor when tied) and, with ``norm``, the final norm's weight. Running the
    target raises :class:`RecipeError`: its layers hold no weights."""
    path = resolve_target_path(cfg.path)
    with _whole_under_zero3():
        built, tokenizer = meta_target(path, DTYPES[cfg.dtype])
    model = text_only(built)
    wanted = {"input embeddings": model.get_input_embeddings().weight, "LM head": model.get_output_embeddings().weight}
    if norm:
        wanted["final norm"] = final_norm(model).weight
    names = _parameter_names(built)
    read = read_tensors(checkpoint_folder(path), {label: names[id(p)] for label, p in wanted.items()})
    loaded = {}
    for label, p in wanted.items():
        loaded.setdefault(id(p), torch.nn.Parameter(read[label].to(DTYPES[cfg.dtype]), requires_grad=False))
    _replace_parameters(model, loaded)
    _refuse_to_run(
        model,
        f"target.path {cfg.path}: the target was built without its weights (features.mode offline "
        "with complete feature caches reads none); it cannot run",
    )
    return model.eval().requires_grad_(False), tokenizer


def _parameter_names(model) -> dict[int, list[str]]:
    """Every parameter of ``model`` (by ``id``) and all its names (a tied one has several)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _replace_parameters(model, new: dict[int, torch.nn.Parameter]) -> None:
    """Every reference in ``model`` to a parameter whose ``id`` ``new`` holds replaced by its new one."""
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and id(p) in new:
                module._parameters[key] = new[id(p)]


def _refuse_to_run(model, message: str) -> None:
    """Any forward of ``model`` or of its decoder (what feature capture runs) raises ``RecipeError(message)``."""

    def refuse(_module, _args):
        raise RecipeError(message)

    model.register_forward_pre_hook(refuse)
    (getattr(model, "model", None) or model.base_model).register_forward_pre_hook(refuse)


@dataclass(frozen=True)
class ConfigTokenIds:
    """What a dry run reads of a tokenizer it cannot load: the special ids a target's config.json names
    (no mask token: recipes that need one set it, e.g. ``drafter.mask_token_id``)."""

    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    mask_token_id: int | None = None


def meta_target(path: str, dtype: torch.dtype):
    """``(model, tokenizer)``: the target at ``path`` (a folder or hub id) built on the meta device from
    its config, with its tokenizer. Inside :func:`distill.config.targets.allow_shipped_target_configs`, a
    hub id whose config and tokenizer are not both in the hub cache and that has a shipped config is built
    from that config (nothing is fetched), with :class:`ConfigTokenIds` for a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .config.targets import shipped_config_for_dry_run

    shipped = shipped_config_for_dry_run(path)
    if shipped is None:
        config, tokenizer = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    else:
        config = AutoConfig.from_pretrained(shipped)
        tokenizer = ConfigTokenIds(
            getattr(config, "bos_token_id", None),
            getattr(config, "eos_token_id", None),
            getattr(config, "pad_token_id", None),
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, tokenizer


def text_only(model):
    """The causal LM inside a multimodal checkpoint (Gemma 3's ``Gemma3ForConditionalGeneration``: a vision
    tower and projector beside the language model): the text config's own ``...ForCausalLM`` holding the
    checkpoint's decoder and head, the rest dropped. Drafters read and serve text; every layer lookup
    (``model.model.layers``) and config read (``config.vocab_size``) then works as for a text model.
    A text model is returned as it is; a multimodal one whose decoder does not fit its text class is refused."""
    from transformers import AutoModelForCausalLM

    config = model.config
    text = config.get_text_config()
    if text is config:
        return model
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(text)
    decoder = model.get_decoder()
    if type(shell.model) is not type(decoder):
        raise RecipeError(
            f"target: {type(model).__name__} is multimodal and its language model ({type(decoder).__name__}) does not "
            f"fit {type(shell).__name__}: give the text-only checkpoint"
        )
    shell.model, shell.lm_head = decoder, model.get_output_embeddings()
    shell.config._attn_implementation = decoder.config._attn_implementation
    shell.generation_config = model.generation_config
    shell.name_or_path = model.name_or_path  # the checkpoint it came from (target_fingerprint reads its files)
    return shell


def model_summary(model) -> dict:
    n = sum(p.numel() for p in model.parameters())
    return {
        "parameters": n,
        "matmul_parameters": matmul_params(model),
        "architecture": model.config.architectures or [type(model).__name__],
    }
