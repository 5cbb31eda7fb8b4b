"""The typed sections recipes share: model, data, training, target, drafter, prompts, quantization, export."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from drafters import DRAFTERS

from ..base.decoding import GateSettings
from ..base.schema import Strict
from .paths import HUB_ID, existing_path, local_or_hub, pretrained_folder, resolve_path
from .targets import shipped_config_for_dry_run

#: a drafter kind: a key of :data:`drafters.DRAFTERS`
DrafterKind = Literal[tuple(DRAFTERS)]  # type: ignore[valid-type]


class ParcaeSection(Strict):
    """The loop of a Parcae model (``model.arch: parcae``; see :mod:`parcae.model`). Its distinct
    blocks are ``prelude_layers + core_layers + coda_layers``, which must equal ``model.num_layers``."""

    prelude_layers: int = Field(1, ge=0)
    core_layers: int = Field(2, gt=0, description="blocks applied T times")
    coda_layers: int = Field(1, ge=0)
    injection: Literal["diagonal", "linear", "add"] = Field(
        "diagonal", description="diagonal = Parcae's stable LTI injection; linear (Huginn) and add for comparison"
    )
    mean_recurrence: int = Field(
        4, gt=0, description="training depth T ~ max(1, Poisson(mean_recurrence)); also the default inference depth"
    )
    backprop_depth: int = Field(2, gt=0, description="only the last min(T, backprop_depth) iterations carry gradients")
    eval_recurrences: list[int] = Field(
        default_factory=lambda: [1, 2, 4],
        min_length=1,
        description="depths of the test-time compute curve (mean and 2 x mean are added)",
    )

    @field_validator("eval_recurrences")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(t < 1 for t in v):
            raise ValueError("every depth must be >= 1")
        return v

    def curve_depths(self) -> list[int]:
        return sorted(set(self.eval_recurrences) | {self.mean_recurrence, 2 * self.mean_recurrence})


class ModelConfig(Strict):
    """Architecture of a causal LM built from scratch (the testbed target, students, Parcae models)."""

    arch: Literal["llama", "qwen3", "parcae", "target"] = Field(
        "llama",
        description="target: the target's own architecture and sizes (any family), num_layers of them; "
        "students only, with init_from_target_layers for PARD's layer dropping",
    )
    hidden_size: int = Field(320, gt=0)
    num_layers: int = Field(8, gt=0)
    num_heads: int = Field(5, gt=0)
    num_kv_heads: int | None = Field(None, gt=0, description="defaults to num_heads (no GQA)")
    head_dim: int | None = Field(None, gt=0, description="defaults to hidden_size // num_heads")
    intermediate_size: int = Field(864, gt=0)
    max_position_embeddings: int = Field(1024, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    tie_word_embeddings: bool = True
    initializer_range: float = Field(0.02, gt=0)
    parcae: ParcaeSection | None = Field(None, description="the loop, when arch = parcae (defaults apply)")

    @model_validator(mode="after")
    def _parcae_loop(self) -> ModelConfig:
        if self.arch != "parcae":
            if self.parcae is not None:
                raise ValueError(f"model.parcae is only read when model.arch = parcae (arch is {self.arch!r})")
            return self
        if self.parcae is None:
            self.parcae = ParcaeSection()
        p = self.parcae
        if p.prelude_layers + p.core_layers + p.coda_layers != self.num_layers:
            raise ValueError(
                f"model.num_layers ({self.num_layers}) must equal parcae.prelude_layers + core_layers + "
                f"coda_layers ({p.prelude_layers} + {p.core_layers} + {p.coda_layers})"
            )
        return self

    @model_validator(mode="after")
    def _target_shape(self) -> ModelConfig:
        shaped = sorted(self.model_fields_set - {"arch", "num_layers", "initializer_range"})
        if self.arch == "target" and shaped:
            raise ValueError(f"arch = target takes the target's sizes; {', '.join(shaped)} cannot be set with it")
        return self

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({kv})")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                "unless head_dim is given"
            )
        return self


class TokenizerConfig(Strict):
    """Either an existing tokenizer (``path``: local folder or hub id) or the testbed BPE."""

    path: str | None = Field(None, description="tokenizer folder or hub id; None = train the testbed BPE")
    vocab_size: int = Field(4096, ge=300, description="size of the testbed BPE when it is trained")

    @field_validator("path")
    @classmethod
    def _path_exists(cls, v: str | None) -> str | None:
        return None if v is None else local_or_hub(v, "tokenizer", "tokenizer_config.json")


#: data file suffix -> how it is read: a ``datasets`` builder, or ``document`` (each file is one text document)
DATA_SUFFIXES = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".py": "document",
    ".md": "document",
}


class DataConfig(Strict):
    """Where text comes from, and how it is cut into training windows.

    ``source: stdlib`` is the testbed corpus (the Python standard library's own source, test folders
    excluded); ``files`` reads local JSONL / JSON / parquet / text files through ``datasets``;
    ``hub`` names a dataset on the Hugging Face hub (where the network allows).
    """

    source: Literal["stdlib", "files", "hub"] = "stdlib"
    train_files: list[str] = Field(default_factory=list)
    val_files: list[str] = Field(default_factory=list)
    hub_name: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    format: Literal["text", "prompt_response", "messages"] = Field(
        "text",
        description="text: documents packed into windows; prompt_response / messages: one example per "
        "window, loss on the response only, rendered with the tokenizer's chat template if any",
    )
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    chat_schema: Literal["openai", "sharegpt", "ultrachat"] = Field(
        "openai",
        description="format messages: how a record holds its turns. openai: [{role, content}] (tool_calls, "
        "reasoning_content kept); sharegpt: [{from, value}] (human / gpt / system / function_call / observation); "
        "ultrachat: [text, ...], user and assistant in turn",
    )
    messages_field: str | None = Field(
        None, description="format messages: the column of turns; None = the schema's (messages / conversations / data)"
    )
    assistant_turns: Literal["all", "last"] = Field(
        "all", description="format messages: score every assistant turn, or the last one only"
    )
    seq_len: int = Field(256, gt=1)
    val_fraction: float = Field(0.02, gt=0, lt=0.5, description="held-out share when no val_files")
    max_documents: int | None = Field(None, gt=0, description="cap on documents read (tests)")

    @property
    def turns_field(self) -> str:
        """The column that holds a conversation's turns (format messages)."""
        from ..chat import SCHEMA_FIELDS

        return self.messages_field or SCHEMA_FIELDS[self.chat_schema]

    @field_validator("train_files", "val_files")
    @classmethod
    def _files_exist(cls, files: list[str]) -> list[str]:
        import glob

        expanded = []
        for f in files:  # glob patterns expand to the sorted files they match
            matches = sorted(glob.glob(f, recursive=True)) if glob.has_magic(f) else [resolve_path(f)]
            if not matches:
                raise ValueError(f"data file pattern '{f}' matches no file")
            expanded += matches
        for f in expanded:
            existing_path(f, "data file")
            if Path(f).suffix not in DATA_SUFFIXES:
                raise ValueError(
                    f"data file '{f}' has suffix '{Path(f).suffix}', expected one of {sorted(DATA_SUFFIXES)}"
                )
        return expanded

    @model_validator(mode="after")
    def _source_complete(self) -> DataConfig:
        if self.source == "files" and not self.train_files:
            raise ValueError("source 'files' needs train_files (a list of .jsonl/.json/.parquet/.txt files)")
        if self.source == "hub" and not self.hub_name:
            raise ValueError("source 'hub' needs hub_name")
        if self.source == "stdlib" and self.format != "text":
            raise ValueError("source 'stdlib' is plain text: use format 'text'")
        return self


class OptimConfig(Strict):
    """AdamW with linear warmup then cosine decay, WSD (warmup-stable-decay) or a constant rate."""

    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr / peak lr (cosine, wsd)")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="share of steps spent decaying (wsd)")
    grad_clip: float | None = Field(1.0, gt=0)


class TrainConfig(Strict):
    max_steps: int = Field(100, gt=0)
    micro_batch_size: int = Field(8, gt=0, description="sequences per process per forward")
    grad_accum: int = Field(1, gt=0)
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    torch_threads: int | None = Field(None, gt=0, description="torch.set_num_threads; None = torch default")
    eval_every: int = Field(50, gt=0)
    eval_batches: int | None = Field(20, gt=0, description="validation batches per evaluation; None = all")
    save_every: int = Field(50, gt=0)
    log_every: int = Field(10, gt=0)
    resume: bool = Field(True, description="continue from output_dir's latest checkpoint when present")
    compile: bool = Field(
        False,
        description="torch.compile the trained model (inductor, through accelerate's "
        "dynamo plugin); worth it on a GPU, not on a small CPU",
    )


class WandbConfig(Strict):
    enabled: bool = False
    project: str = "draftsmith"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = Field(default_factory=list)


class TargetConfig(Strict):
    """A frozen target causal LM: a hub id or a local folder, or the shipped testbed target."""

    path: str = Field("testbed", description="'testbed' (shipped), a local folder or a hub id")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", description="auto: transformers' choice for the model (SDPA where it supports it; gpt-oss: eager)"
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="passed to the chat template wherever a conversation is rendered (training data, regeneration, "
        "evaluation prompts), e.g. {enable_thinking: false}; recorded with the trained drafter",
    )
    device_map: Literal["auto", "cpu"] | None = Field(
        None,
        description="train_drafter, one process: transformers' device_map for the target (auto: split by layers over "
        "every visible GPU, e.g. to build an offline feature cache for a target one GPU cannot hold); "
        "None = whole on each process's device",
    )

    @field_validator("path")
    @classmethod
    def _target_exists(cls, v: str) -> str:
        if v == "testbed":
            return v
        if shipped_config_for_dry_run(v) is not None:
            return v  # a dry run builds it from its shipped config (distill.config.targets)
        v = local_or_hub(v, "target", "config.json")
        if Path(os.path.expanduser(v)).is_dir():  # a local folder: whole weights and a tokenizer
            from ..checks import check_checkpoint, check_tokenizer

            check_checkpoint(v, "target")
            check_tokenizer(v, "target")
        return v


#: quantization schemes (see distill/quantize/): 8da<N>w = int8 dynamic activations + intN weights,
#: w<N> = intN weight-only (N = 2..8), int4_weight_only = torchao's GPU int4 kernel, float8 = float8
#: activations and weights (Hopper-class GPUs)
QUANT_SCHEME = re.compile(r"^(8da[2-8]w|w[2-8]|int4_weight_only|float8)$")
QUANT_SCHEME_EXAMPLES = ["8da4w", "8da8w", "w2", "w3", "w4", "w8", "int4_weight_only", "float8"]


def _quant_scheme(value: str, allow_keep: bool) -> str:
    if (allow_keep and value == "keep") or QUANT_SCHEME.match(value):
        return value
    names = QUANT_SCHEME_EXAMPLES + (["keep"] if allow_keep else [])
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.5)
    bits = re.fullmatch(r"u?int([2-8])(_?wo|_weight_only)?", value)
    hint = (
        f"; did you mean 'w{bits.group(1)}' (int{bits.group(1)} weight-only) or '8da{bits.group(1)}w'?"
        if bits
        else f"; did you mean '{close[0]}'?"
        if close
        else ""
    )
    raise ValueError(
        f"'{value}' is not a quantization scheme: expected 8da<N>w or w<N> (N = 2..8), "
        f"int4_weight_only or float8{' or keep' if allow_keep else ''}{hint}"
    )


class QuantSchemeSpec(Strict):
    """A quantization scheme and its per-layer map (torchao; resolved against the model in distill/quantize/plan.py).

    ``layers`` is ordered: the first pattern that matches a Linear module decides its scheme (or
    ``keep``: full precision). A pattern is an exact module name, a glob (``*.mlp.*``) or
    ``re:<regex>`` (full match). Linear modules no pattern names get ``scheme``, except the output
    head (kept unless named); Parcae's ``A_log``, ``dt_bias`` (Delta) and ``B`` are always kept."""

    scheme: str = Field("8da4w", description="default scheme of every Linear the layer map does not name")
    group_size: int | None = Field(32, gt=0, description="weights per scale; None = one scale per output channel")
    layers: dict[str, str] = Field(
        default_factory=dict, description="ordered: module name | glob | re:<regex> -> scheme | keep"
    )

    @field_validator("scheme")
    @classmethod
    def _scheme(cls, v: str) -> str:
        return _quant_scheme(v, allow_keep=False)

    @field_validator("layers")
    @classmethod
    def _layers(cls, layers: dict[str, str]) -> dict[str, str]:
        for pattern, scheme in layers.items():
            if not pattern.strip():
                raise ValueError("an empty layer pattern")
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as e:
                    raise ValueError(f"layer pattern '{pattern}' is not a valid regular expression: {e}") from None
            try:
                _quant_scheme(str(scheme), allow_keep=True)
            except ValueError as e:
                raise ValueError(f"layer pattern '{pattern}': {e}") from None
        return layers

    @model_validator(mode="after")
    def _int4_groups(self) -> QuantSchemeSpec:
        uses = {self.scheme, *self.layers.values()}
        if "int4_weight_only" in uses and self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"int4_weight_only needs group_size 32, 64, 128 or 256 (got {self.group_size})")
        return self


class QuantSection(QuantSchemeSpec):
    """Quantization of the model a training recipe trains: ``qat`` (fake quantization while training,
    converted at the end) or ``ptq`` (quantized after training); ``none`` trains in full precision."""

    mode: Literal["none", "ptq", "qat"] = "none"
    fake_quant_after_steps: int = Field(0, ge=0, description="qat: train in full precision for this many steps first")


class DrafterSection(Strict):
    """The drafter to train. Sizes default to the target's (embeddings and LM head are shared)."""

    kind: DrafterKind = "dflash"
    num_layers: int = Field(1, gt=0)
    num_heads: int | None = Field(None, gt=0, description="defaults to the target's")
    intermediate_size: int | None = Field(None, gt=0, description="defaults to the target's")
    block_size: int = Field(8, ge=2, description="tokens per block (anchor + K-1 drafts); EAGLE-3 drafts K-1 steps")
    block_attention: Literal["bidirectional", "causal"] = Field(
        "bidirectional", description="how a block's tokens see each other in full-context layers"
    )
    sliding_window: int | None = Field(
        None,
        gt=0,
        description="block drafters: layers that see only the last N context positions before the anchor "
        "(speculators' sliding_attention layers); None = every layer sees the whole context",
    )
    sliding_layers: Literal["all", "alternate"] = Field(
        "all", description="with sliding_window: every layer slides, or every other one (the first slides)"
    )
    sliding_block_attention: Literal["bidirectional", "causal"] = Field(
        "causal", description="with sliding_window: how a block's tokens see each other in the sliding layers"
    )
    qk_norm: bool = Field(
        False,
        description="per-head RMSNorm on queries and keys (Qwen3-style); vLLM's DFlash/DSpark "
        "layers have it, so block drafters need it to export to speculators",
    )
    target_layer_ids: list[int] | None = Field(None, description="output of layer i; None = spread over the target")
    num_target_layers: int = Field(3, gt=0, description="used when target_layer_ids is None")
    num_anchors: int = Field(16, gt=0, description="blocks per training sequence (block drafters)")
    mask_token_id: int | None = Field(None, ge=0, description="None = the tokenizer's mask token")
    loss: dict[str, float] | None = Field(
        None,
        description="block drafters: loss term -> weight, terms ce | kl | tv | lk (drafters.losses); "
        "None = the kind's default (DFlash {ce: 1}, DSpark {ce: 0.1, tv: 0.9})",
    )
    position_weighting: Literal["exp", "dpace"] = Field(
        "exp", description="block positions weighted exp(-(k-1)/gamma), or by the detached probability of reaching them"
    )
    loss_gamma: float = Field(4.0, gt=0, description="position weights exp(-(k-1)/gamma)")
    loss_chunk: int | None = Field(
        None,
        gt=0,
        description="positions whose vocabulary-sized logits the loss holds at once (whole blocks; "
        "recomputed in backward); None = the whole batch at once. Set it for large "
        "vocabularies: 8 x 512 anchors x 15 positions x 152k tokens is 37 GB of fp32 logits",
    )
    init_norm_scale: float | None = Field(
        None, gt=0, description="start the output norm at this times the target's final norm (None: ones)"
    )
    draft_vocab: int = Field(
        0,
        ge=0,
        description="draft from the N tokens the training answers use most (drafters.vocab; "
        "the loss over them, saved and exported with the drafter); 0 = all",
    )
    markov_rank: int = Field(64, gt=0, description="DSpark Markov head rank")
    confidence_weight: float = Field(1.0, ge=0, description="DSpark")
    init_from: str | None = Field(
        None,
        description="a saved drafter folder of the same kind and sizes whose weights start training (a second "
        "schedule after a first; the optimizer and schedule start fresh); None = random init",
    )

    @field_validator("init_from")
    @classmethod
    def _init_folder(cls, v: str | None) -> str | None:
        return v if v is None else pretrained_folder(v, "drafter.init_from")

    @field_validator("loss")
    @classmethod
    def _loss_terms(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        from drafters.losses import LOSS_TERMS

        if v is None:
            return v
        unknown = sorted(set(v) - set(LOSS_TERMS))
        if unknown:
            raise ValueError(f"unknown loss terms {unknown}; expected some of {list(LOSS_TERMS)}")
        if any(w < 0 for w in v.values()) or not any(w > 0 for w in v.values()):
            raise ValueError(f"loss weights must be >= 0 with at least one > 0, got {v}")
        return v

    @model_validator(mode="after")
    def _fixed_layers(self) -> DrafterSection:
        fixed = DRAFTERS[self.kind][0].fixed_target_layers
        if fixed and (len(self.target_layer_ids or []) not in (0, fixed) or self.num_target_layers != fixed):
            raise ValueError(f"{self.kind} fuses exactly {fixed} target layers (low, mid, high)")
        return self

    @model_validator(mode="after")
    def _init_matches(self) -> DrafterSection:
        if self.init_from is None:
            return self
        from ..checks import read_config

        saved = read_config(self.init_from, "drafter.init_from")
        want = {
            "model_type": DRAFTERS[self.kind][0].model_type,
            "num_hidden_layers": self.num_layers,
            "block_size": self.block_size,
            "qk_norm": self.qk_norm,
        }
        wrong = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
        if wrong:
            raise ValueError(
                "drafter.init_from '"
                + self.init_from
                + "' is another drafter: "
                + ", ".join(f"{k} {got!r} where this recipe builds {v!r}" for k, (got, v) in wrong.items())
            )
        return self


class FeaturesSection(Strict):
    """Where target features come from: the target running beside the drafter, or a cache on disk."""

    mode: Literal["online", "offline"] = "online"
    cache_dir: str | None = Field(None, description="offline cache folder; None = <output_dir>/feature_cache")
    format: Literal["draftsmith", "vllm"] = Field(
        "draftsmith",
        description="offline: draftsmith's shards, or vLLM's hidden-states files (hs_{i}.safetensors per window, "
        "as speculators' generate-offline-data writes them) under <cache_dir>/<split>/, read as they are or written "
        "here where missing",
    )
    vllm_layer_ids: list[int] | None = Field(
        None,
        description="format vllm: the layer ids the files were extracted with, in that convention (id i = the input "
        "of decoder layer i; the last = the number of layers, the state before the final norm); None = the "
        "drafter's target layers + 1, then the number of layers",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="storage dtype of cached features")
    max_windows: int | None = Field(None, gt=0, description="cap on training windows (both modes)")
    build_only: bool = Field(
        False,
        description="offline: build both splits' caches and stop (no training); training "
        "from complete caches then reads none of the target's weights but what "
        "the drafter copies",
    )

    @model_validator(mode="after")
    def _build_only_offline(self) -> FeaturesSection:
        if self.build_only and self.mode != "offline":
            raise ValueError("features.build_only builds the offline feature cache: set features.mode: offline")
        return self


class DistillSection(Strict):
    """Logit distillation (see :mod:`distill.kd`): loss = (1 - ce_weight) * divergence + ce_weight * CE."""

    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "forward_kl",
        description="forward_kl = KL(target || student); reverse_kl = KL(student || target); jsd uses beta",
    )
    beta: float = Field(0.5, gt=0, lt=1, description="generalized JSD interpolation (divergence = jsd)")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of both distributions")
    ce_weight: float = Field(0.0, ge=0, le=1, description="share of cross-entropy on the data's tokens")
    loss_chunk: int | None = Field(
        None,
        gt=0,
        description="scored positions per chunk of the KD loss, computed from the "
        "last hidden states so no [B, T, V] logits exist; None = whole logits",
    )


class PardSection(Strict):
    """PARD (:mod:`drafters.pard`): the student also learns to draft ``draft_tokens`` tokens in one forward."""

    draft_tokens: int = Field(8, ge=2, description="K: tokens drafted per forward (K - 1 appended mask tokens)")
    anchors: int = Field(16, gt=0, description="mask blocks appended to each training window")
    keep: float = Field(0.5, gt=0, le=1, description="conditional drop: P(a block keeps mask i + 1 | it kept mask i)")
    mask_token_id: int | None = Field(None, ge=0, description="None = the tokenizer's mask token")


class ServerSection(Strict):
    """An OpenAI-compatible completions endpoint that serves the target (vLLM, SGLang, ``transformers
    serve``): regeneration sends it every prompt's text, ``concurrency`` requests at a time, and keeps
    the token ids it returns (vLLM: ``extra_body: {return_token_ids: true}``) or re-tokenizes its text."""

    base_url: str = Field(description="e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="the served model's name, as GET /v1/models lists it")
    api_key_env: str | None = Field(
        "OPENAI_API_KEY", description="environment variable holding the key; unset: 'EMPTY'"
    )
    api: Literal["completions", "chat"] = Field(
        "completions",
        description="completions: /v1/completions, the prompt rendered here with the target's template; "
        "chat: /v1/chat/completions, the server applies its template (chat_template_kwargs sent along)",
    )
    concurrency: int = Field(32, gt=0, description="requests in flight (the server batches them)")
    timeout_s: float = Field(600.0, gt=0)
    extra_body: dict[str, Any] = Field(default_factory=dict, description="server-specific request fields")

    @field_validator("base_url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"expected an http(s) URL such as http://127.0.0.1:8000/v1, got {v!r}")
        return v.rstrip("/")


def distinct_temperatures(v: list[float]) -> list[float]:
    """A list of temperatures to measure or sample at: each >= 0, none twice."""
    if any(t < 0 for t in v) or len(set(v)) != len(v):
        raise ValueError(f"temperatures must be distinct and >= 0, got {v}")
    return v


class RegenerateStage(Strict):
    """Train on the target's own answers (:mod:`distill.regenerate`): prompts cut from ``data``'s corpus,
    answered by the target in-process, cached and reused by any later run with the same settings."""

    train_prompts: int = Field(4096, gt=0, description="train-split prompts, shared evenly by the temperatures")
    val_prompts: int = Field(128, gt=0, description="held-out prompts answered greedily: the evaluation set")
    prompt_tokens: int = Field(64, gt=0)
    max_new_tokens: int = Field(128, gt=0)
    temperatures: list[float] = Field(
        default_factory=lambda: [0.0, 0.7],
        min_length=1,
        description="0 = greedy; each gets train_prompts / len(temperatures) prompts",
    )
    top_p: float = Field(0.95, gt=0, le=1, description="sampled temperatures only")
    top_k: int = Field(0, ge=0, description="0 = off")
    batch_size: int = Field(64, gt=0)
    server: ServerSection | None = Field(None, description="answer through this endpoint instead of in-process")

    @field_validator("temperatures")
    @classmethod
    def _non_negative(cls, v: list[float]) -> list[float]:
        return distinct_temperatures(v)


class PromptsSection(Strict):
    """Prompts to regenerate answers for: a JSONL file, or snippets cut from the data section's corpus."""

    file: str | None = Field(None, description="JSONL with one {prompt_field: ...} or {messages_field: [...]} per line")
    field: str = "prompt"
    from_corpus: int = Field(0, ge=0, description="number of prompts cut from the data section's corpus (file unset)")
    split: Literal["train", "val"] = Field("train", description="corpus split the prompts are cut from")
    prompt_tokens: int = Field(64, gt=0, description="length of corpus prompts")

    @field_validator("file")
    @classmethod
    def _file_exists(cls, v: str | None) -> str | None:
        return None if v is None else existing_path(v, "prompts file")

    @model_validator(mode="after")
    def _one_source(self) -> PromptsSection:
        if (self.file is None) == (self.from_corpus == 0):
            raise ValueError("give exactly one of prompts.file or prompts.from_corpus")
        if self.file is not None:
            from ..checks import read_prompts

            read_prompts(self.file, self.field)  # every line, before any compute
        return self


class GenerationSection(Strict):
    max_new_tokens: int = Field(128, gt=0)
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    batch_size: int = Field(8, gt=0)
    reasoning: Literal["keep", "drop"] = Field(
        "keep",
        description="conversations answered turn by turn: an answer's <think> block kept in the written "
        "messages (reasoning_content) or dropped; the turns' token ids stay what the target wrote",
    )


class QuantMeasureSection(Strict):
    """Drafters: the decoding loop (greedy, chain) on held-out corpus prompts, for measured tau and speed."""

    prompts: int = Field(8, ge=0, description="held-out prompts; 0 = skip the decoding loop")
    prompt_tokens: int = Field(64, gt=0)
    max_new_tokens: int = Field(64, gt=0)


VARIANT_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")


class ExportGateSection(GateSettings):
    """The parity gate an export must pass (see serve_eval/parity.py)."""

    allow_failure: bool = Field(
        False, description="publish even when the gate fails (printed loudly, written into the card)"
    )
    max_new_tokens: int = Field(64, gt=0, description="tokens generated per evaluation prompt")
    simulated_tau: float | None = Field(None, ge=1, description="when the checkpoint recorded none (else read from it)")


class PushToHubSection(Strict):
    """Upload the export folder in one commit (huggingface_hub); only when enabled."""

    enabled: bool = False
    repo_id: str | None = Field(None, description="owner/name")
    private: bool = True
    revision: str | None = Field(None, description="branch to commit to (created if missing); None = main")
    primary_format: Literal["speculators", "transformers", "sglang_eagle3"] = Field(
        "speculators", description="the format whose files go to the repository root"
    )
    commit_message: str = "Upload drafter exported by draftsmith"

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, v: str | None) -> str | None:
        if v is not None and not HUB_ID.match(v):
            raise ValueError(f"repo_id '{v}' is not of the form owner/name")
        return v

    @model_validator(mode="after")
    def _needs_repo(self) -> PushToHubSection:
        if self.enabled and not self.repo_id:
            raise ValueError("push_to_hub.enabled needs push_to_hub.repo_id (owner/name)")
        return self
