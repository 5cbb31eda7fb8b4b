"""Typed recipes: one YAML file describes a whole job, validated before any compute starts.

A recipe is a YAML mapping whose ``recipe:`` key names its entry point (``train_lm``,
``quickstart``, ...; :mod:`recipes.registry` maps each name to the module that declares its schema
and runs it). It is parsed into that pydantic model, with
``extra="forbid"`` everywhere, so every mistake is caught up front:

* an unknown key names the key and suggests the closest valid one (``train.max_stpes`` ->
  "did you mean 'max_steps'?");
* a wrong type or value names the key, the value given and what was expected;
* a path that must exist (data files, tokenizers, local targets) is checked here, not halfway
  through training.

Command-line overrides use dotted keys (``train.max_steps=20``); values are parsed as YAML scalars
so ``1e-3``, ``true`` and ``[1, 2]`` get their natural types. Every failure raises
:class:`RecipeError`, which the CLI turns into exit status 2 with nothing written.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import AfterValidator, BaseModel, Field, ValidationError, field_validator, model_validator

from drafters import DRAFTERS

from .base.decoding import DecodingSection, GateSettings
from .base.schema import Strict

__all__ = [
    "RecipeError",
    "ModelConfig",
    "TokenizerConfig",
    "DataConfig",
    "OptimConfig",
    "TrainConfig",
    "WandbConfig",
    "TargetConfig",
    "TrainLMRecipe",
    "QuickstartRecipe",
    "QuantSection",
    "QuantSchemeSpec",
    "QuantizeRecipe",
    "validate_recipe",
    "read_yaml_mapping",
    "apply_overrides",
]


#: a drafter kind: a key of :data:`drafters.DRAFTERS`
DrafterKind = Literal[tuple(DRAFTERS)]  # type: ignore[valid-type]


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the key, the value and what was expected."""


# --------------------------------------------------------------------------------------------------
# Sections shared by recipes
# --------------------------------------------------------------------------------------------------

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(value: str) -> str:
    """``value`` as given when it exists from here; else, for a relative path that exists under the
    project's root (a shipped asset or recipe named by a shipped recipe), that file; else as given.
    So shipped recipes run from any directory (``draftsmith run dflash_testbed``)."""
    path = Path(os.path.expanduser(value))
    if path.exists() or path.is_absolute() or not (PROJECT_ROOT / path).exists():
        return value
    return str(PROJECT_ROOT / path)


def _existing_path(value: str, what: str) -> str:
    value = resolve_path(value)
    if not Path(os.path.expanduser(value)).exists():
        raise ValueError(f"{what} '{value}' does not exist")
    return value


def _pretrained_folder(value: str, what: str) -> str:
    """An existing ``save_pretrained`` folder: a config.json that parses and weight files that are whole."""
    from .checks import check_checkpoint

    value = _existing_path(value, what)
    check_checkpoint(value, what)
    return value


def _local_config(path: str) -> dict | None:
    """The config.json of a target named by ``path`` when it is on disk ('testbed' or a folder), else None."""
    from .checks import read_config
    from .testbed import SHIPPED_TARGET

    folder = SHIPPED_TARGET if path == "testbed" else Path(os.path.expanduser(path))
    return read_config(folder, "target") if (folder / "config.json").exists() else None


def _local_or_hub(value: str, what: str, probe_file: str) -> str:
    """A local folder that exists, or a hub id (which, offline, must already be in the local cache)."""
    value = resolve_path(value)
    if Path(os.path.expanduser(value)).exists() or not HUB_ID.match(value):
        return _existing_path(value, what)
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(value, probe_file), str):
            raise ValueError(f"{what} '{value}' is neither a local folder nor in the hub cache, and HF_HUB_OFFLINE is set")
    return value


class ParcaeSection(Strict):
    """The loop of a Parcae model (``model.arch: parcae``; see :mod:`parcae.model`). Its distinct
    blocks are ``prelude_layers + core_layers + coda_layers``, which must equal ``model.num_layers``."""

    prelude_layers: int = Field(1, ge=0)
    core_layers: int = Field(2, gt=0, description="blocks applied T times")
    coda_layers: int = Field(1, ge=0)
    injection: Literal["diagonal", "linear", "add"] = Field(
        "diagonal", description="diagonal = Parcae's stable LTI injection; linear (Huginn) and add for comparison")
    mean_recurrence: int = Field(4, gt=0, description="training depth T ~ max(1, Poisson(mean_recurrence)); also the default inference depth")
    backprop_depth: int = Field(2, gt=0, description="only the last min(T, backprop_depth) iterations carry gradients")
    eval_recurrences: list[int] = Field(default_factory=lambda: [1, 2, 4], min_length=1,
                                        description="depths of the test-time compute curve (mean and 2 x mean are added)")

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

    arch: Literal["llama", "qwen3", "parcae"] = "llama"
    hidden_size: int = Field(320, gt=0)
    num_layers: int = Field(8, gt=0)
    num_heads: int = Field(5, gt=0)
    num_kv_heads: Optional[int] = Field(None, gt=0, description="defaults to num_heads (no GQA)")
    head_dim: Optional[int] = Field(None, gt=0, description="defaults to hidden_size // num_heads")
    intermediate_size: int = Field(864, gt=0)
    max_position_embeddings: int = Field(1024, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    tie_word_embeddings: bool = True
    initializer_range: float = Field(0.02, gt=0)
    parcae: Optional[ParcaeSection] = Field(None, description="the loop, when arch = parcae (defaults apply)")

    @model_validator(mode="after")
    def _parcae_loop(self) -> "ModelConfig":
        if self.arch != "parcae":
            if self.parcae is not None:
                raise ValueError(f"model.parcae is only read when model.arch = parcae (arch is {self.arch!r})")
            return self
        if self.parcae is None:
            self.parcae = ParcaeSection()
        p = self.parcae
        if p.prelude_layers + p.core_layers + p.coda_layers != self.num_layers:
            raise ValueError(f"model.num_layers ({self.num_layers}) must equal parcae.prelude_layers + core_layers + "
                             f"coda_layers ({p.prelude_layers} + {p.core_layers} + {p.coda_layers})")
        return self

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
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

    path: Optional[str] = Field(None, description="tokenizer folder or hub id; None = train the testbed BPE")
    vocab_size: int = Field(4096, ge=300, description="size of the testbed BPE when it is trained")

    @field_validator("path")
    @classmethod
    def _path_exists(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else _local_or_hub(v, "tokenizer", "tokenizer_config.json")


#: data file suffix -> how it is read: a ``datasets`` builder, or ``document`` (each file is one text document)
DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".py": "document",
                 ".md": "document"}


class DataConfig(Strict):
    """Where text comes from, and how it is cut into training windows.

    ``source: stdlib`` is the testbed corpus (the Python standard library's own source, test folders
    excluded); ``files`` reads local JSONL / JSON / parquet / text files through ``datasets``;
    ``hub`` names a dataset on the Hugging Face hub (where the network allows).
    """

    source: Literal["stdlib", "files", "hub"] = "stdlib"
    train_files: list[str] = Field(default_factory=list)
    val_files: list[str] = Field(default_factory=list)
    hub_name: Optional[str] = None
    hub_config: Optional[str] = None
    hub_split: str = "train"
    format: Literal["text", "prompt_response", "messages"] = Field(
        "text", description="text: documents packed into windows; prompt_response / messages: one example per "
                            "window, loss on the response only, rendered with the tokenizer's chat template if any")
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    seq_len: int = Field(256, gt=1)
    val_fraction: float = Field(0.02, gt=0, lt=0.5, description="held-out share when no val_files")
    max_documents: Optional[int] = Field(None, gt=0, description="cap on documents read (tests)")

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
            _existing_path(f, "data file")
            if Path(f).suffix not in DATA_SUFFIXES:
                raise ValueError(f"data file '{f}' has suffix '{Path(f).suffix}', expected one of {sorted(DATA_SUFFIXES)}")
        return expanded

    @model_validator(mode="after")
    def _source_complete(self) -> "DataConfig":
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
    grad_clip: Optional[float] = Field(1.0, gt=0)


class TrainConfig(Strict):
    max_steps: int = Field(100, gt=0)
    micro_batch_size: int = Field(8, gt=0, description="sequences per process per forward")
    grad_accum: int = Field(1, gt=0)
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    torch_threads: Optional[int] = Field(None, gt=0, description="torch.set_num_threads; None = torch default")
    eval_every: int = Field(50, gt=0)
    eval_batches: Optional[int] = Field(20, gt=0, description="validation batches per evaluation; None = all")
    save_every: int = Field(50, gt=0)
    log_every: int = Field(10, gt=0)
    resume: bool = Field(True, description="continue from output_dir's latest checkpoint when present")
    compile: bool = Field(False, description="torch.compile the trained model (inductor, through accelerate's "
                                             "dynamo plugin); worth it on a GPU, not on a small CPU")


class WandbConfig(Strict):
    enabled: bool = False
    project: str = "draftsmith"
    entity: Optional[str] = None
    name: Optional[str] = None
    tags: list[str] = Field(default_factory=list)


class TargetConfig(Strict):
    """A frozen target causal LM: a hub id or a local folder, or the shipped testbed target."""

    path: str = Field("testbed", description="'testbed' (shipped), a local folder or a hub id")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"

    @field_validator("path")
    @classmethod
    def _target_exists(cls, v: str) -> str:
        if v == "testbed":
            return v
        v = _local_or_hub(v, "target", "config.json")
        if Path(os.path.expanduser(v)).is_dir():  # a local folder: whole weights and a tokenizer
            from .checks import check_checkpoint, check_tokenizer

            check_checkpoint(v, "target")
            check_tokenizer(v, "target")
        return v


#: quantization schemes (see distill/quantize.py): 8da<N>w = int8 dynamic activations + intN weights,
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
    hint = (f"; did you mean 'w{bits.group(1)}' (int{bits.group(1)} weight-only) or '8da{bits.group(1)}w'?" if bits
            else f"; did you mean '{close[0]}'?" if close else "")
    raise ValueError(f"'{value}' is not a quantization scheme: expected 8da<N>w or w<N> (N = 2..8), "
                     f"int4_weight_only or float8{' or keep' if allow_keep else ''}{hint}")


class QuantSchemeSpec(Strict):
    """A quantization scheme and its per-layer map (torchao; resolved against the model in distill/quantize.py).

    ``layers`` is ordered: the first pattern that matches a Linear module decides its scheme (or
    ``keep``: full precision). A pattern is an exact module name, a glob (``*.mlp.*``) or
    ``re:<regex>`` (full match). Linear modules no pattern names get ``scheme``, except the output
    head (kept unless named); Parcae's ``A_log``, ``dt_bias`` (Delta) and ``B`` are always kept."""

    scheme: str = Field("8da4w", description="default scheme of every Linear the layer map does not name")
    group_size: Optional[int] = Field(32, gt=0, description="weights per scale; None = one scale per output channel")
    layers: dict[str, str] = Field(default_factory=dict, description="ordered: module name | glob | re:<regex> -> scheme | keep")

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
    def _int4_groups(self) -> "QuantSchemeSpec":
        uses = {self.scheme, *self.layers.values()}
        if "int4_weight_only" in uses and self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"int4_weight_only needs group_size 32, 64, 128 or 256 (got {self.group_size})")
        return self


class QuantSection(QuantSchemeSpec):
    """Quantization of the model a training recipe trains: ``qat`` (fake quantization while training,
    converted at the end) or ``ptq`` (quantized after training); ``none`` trains in full precision."""

    mode: Literal["none", "ptq", "qat"] = "none"
    fake_quant_after_steps: int = Field(0, ge=0, description="qat: train in full precision for this many steps first")


# --------------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------------


class RecipeBase(Strict):
    recipe: str
    output_dir: str
    seed: int = 0


class TrainingRecipe(RecipeBase):
    """Sections every recipe that trains something has."""

    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    quant: QuantSection = Field(default_factory=QuantSection)


class TrainLMRecipe(TrainingRecipe):
    """Train a causal LM from scratch with next-token cross-entropy (the testbed target)."""

    recipe: Literal["train_lm"]
    model: ModelConfig = Field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)

    @model_validator(mode="after")
    def _fits_context(self) -> "TrainLMRecipe":
        if self.data.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_position_embeddings "
                f"({self.model.max_position_embeddings})"
            )
        return self


RecipePath = Annotated[str, AfterValidator(lambda v: _existing_path(v, "recipe file"))]


class QuickstartTargetStage(Strict):
    """Where the quickstart's target comes from: the shipped testbed weights, or trained now."""

    source: Literal["shipped", "train"] = "shipped"
    train_recipe: RecipePath = Field("recipes/configs/testbed_target_quick.yaml", description="used when source=train")
    eval_batches: Optional[int] = Field(None, gt=0, description="held-out batches to evaluate; None = all")


class QuickstartStage(Strict):
    """A quickstart stage that runs another recipe, retargeted: on or off, the recipe, its overrides."""

    enabled: bool = True
    recipe: RecipePath
    overrides: list[str] = Field(default_factory=list, description="section.key=value overrides for that recipe")


class QuickstartDrafterStage(QuickstartStage):
    """The drafter the quickstart trains against its target (a ``train_drafter`` recipe)."""

    recipe: RecipePath = Field("recipes/configs/dflash_testbed.yaml", description="a train_drafter recipe")


class QuickstartEvalStage(QuickstartStage):
    """The quickstart's drafter in the decoding loop against plain decoding (an ``eval`` recipe)."""

    recipe: RecipePath = Field("recipes/configs/eval_testbed.yaml", description="an eval recipe")


class QuickstartExportStage(QuickstartStage):
    """The quickstart's drafter exported (an ``export`` recipe), behind the parity gate."""

    recipe: RecipePath = Field("recipes/configs/export_testbed.yaml", description="an export recipe")


class QuickstartShippedDrafterStage(QuickstartEvalStage):
    """The drafter shipped for the testbed target (trained once by its recipe), measured in the loop."""

    kind: DrafterKind = "dflash"
    tree_budget: Optional[int] = Field(None, gt=0, description="None = the budget with the best speedup the drafter "
                                                               "shipped with (results.json)")
    lookup: int = Field(10, ge=0, description="also measure the tree with prompt-lookup continuations of up to this "
                                              "many tokens grafted on (decoding.lookup); 0 = not")

    @model_validator(mode="after")
    def _shipped(self) -> "QuickstartShippedDrafterStage":
        from .testbed import SHIPPED_DRAFTERS

        if self.enabled and not (SHIPPED_DRAFTERS[self.kind] / "config.json").exists():
            shipped = sorted(k for k, f in SHIPPED_DRAFTERS.items() if (f / "config.json").exists())
            raise ValueError(f"no {self.kind} drafter is shipped at {SHIPPED_DRAFTERS[self.kind]} (shipped: {shipped}); "
                             "train and ship it (its recipe's header says how) or set shipped_drafter.enabled=false")
        return self


class QuickstartRecipe(RecipeBase):
    """The main job on the testbed: the target (shipped or trained) evaluated, a drafter trained,
    measured in the speculative-decoding loop and exported."""

    recipe: Literal["quickstart"]
    target: QuickstartTargetStage = Field(default_factory=QuickstartTargetStage)
    shipped_drafter: QuickstartShippedDrafterStage = Field(default_factory=QuickstartShippedDrafterStage)
    drafter: QuickstartDrafterStage = Field(default_factory=QuickstartDrafterStage)
    eval: QuickstartEvalStage = Field(default_factory=QuickstartEvalStage)
    export: QuickstartExportStage = Field(default_factory=QuickstartExportStage)
    torch_threads: Optional[int] = Field(None, gt=0)


class DrafterSection(Strict):
    """The drafter to train. Sizes default to the target's (embeddings and LM head are shared)."""

    kind: DrafterKind = "dflash"
    num_layers: int = Field(1, gt=0)
    num_heads: Optional[int] = Field(None, gt=0, description="defaults to the target's")
    intermediate_size: Optional[int] = Field(None, gt=0, description="defaults to the target's")
    block_size: int = Field(8, ge=2, description="tokens per block (anchor + K-1 drafts); EAGLE-3 drafts K-1 steps")
    block_attention: Literal["bidirectional", "causal"] = "bidirectional"
    qk_norm: bool = Field(False, description="per-head RMSNorm on queries and keys (Qwen3-style); vLLM's DFlash/DSpark "
                                            "layers have it, so block drafters need it to export to speculators")
    target_layer_ids: Optional[list[int]] = Field(None, description="output of layer i; None = spread over the target")
    num_target_layers: int = Field(3, gt=0, description="used when target_layer_ids is None")
    num_anchors: int = Field(16, gt=0, description="blocks per training sequence (block drafters)")
    mask_token_id: Optional[int] = Field(None, ge=0, description="None = the tokenizer's mask token")
    loss: Optional[dict[str, float]] = Field(
        None, description="block drafters: loss term -> weight, terms ce | kl | tv | lk (drafters.losses); "
                          "None = the kind's default (DFlash {ce: 1}, DSpark {ce: 0.1, tv: 0.9})")
    position_weighting: Literal["exp", "dpace"] = Field(
        "exp", description="block positions weighted exp(-(k-1)/gamma), or by the detached probability of reaching them")
    loss_gamma: float = Field(4.0, gt=0, description="position weights exp(-(k-1)/gamma)")
    loss_chunk: Optional[int] = Field(
        None, gt=0, description="positions whose vocabulary-sized logits the loss holds at once (whole blocks; "
                                "recomputed in backward); None = the whole batch at once. Set it for large "
                                "vocabularies: 8 x 512 anchors x 15 positions x 152k tokens is 37 GB of fp32 logits")
    init_norm_scale: Optional[float] = Field(
        None, gt=0, description="start the output norm at this times the target's final norm (None: ones)")
    markov_rank: int = Field(64, gt=0, description="DSpark Markov head rank")
    confidence_weight: float = Field(1.0, ge=0, description="DSpark")
    init_from: Optional[str] = Field(
        None, description="a saved drafter folder of the same kind and sizes whose weights start training (a second "
                          "schedule after a first; the optimizer and schedule start fresh); None = random init")

    @field_validator("init_from")
    @classmethod
    def _init_folder(cls, v: Optional[str]) -> Optional[str]:
        return v if v is None else _pretrained_folder(v, "drafter.init_from")

    @field_validator("loss")
    @classmethod
    def _loss_terms(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
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
    def _fixed_layers(self) -> "DrafterSection":
        fixed = DRAFTERS[self.kind][0].fixed_target_layers
        if fixed and (len(self.target_layer_ids or []) not in (0, fixed) or self.num_target_layers != fixed):
            raise ValueError(f"{self.kind} fuses exactly {fixed} target layers (low, mid, high)")
        return self

    @model_validator(mode="after")
    def _init_matches(self) -> "DrafterSection":
        if self.init_from is None:
            return self
        from .checks import read_config

        saved = read_config(self.init_from, "drafter.init_from")
        want = {"model_type": DRAFTERS[self.kind][0].model_type, "num_hidden_layers": self.num_layers, "block_size": self.block_size,
                "qk_norm": self.qk_norm}
        wrong = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
        if wrong:
            raise ValueError("drafter.init_from '" + self.init_from + "' is another drafter: " + ", ".join(
                f"{k} {got!r} where this recipe builds {v!r}" for k, (got, v) in wrong.items()))
        return self


class FeaturesSection(Strict):
    """Where target features come from: the target running beside the drafter, or a cache on disk."""

    mode: Literal["online", "offline"] = "online"
    cache_dir: Optional[str] = Field(None, description="offline cache folder; None = <output_dir>/feature_cache")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="storage dtype of cached features")
    max_windows: Optional[int] = Field(None, gt=0, description="cap on training windows (both modes)")


class DistillSection(Strict):
    """Logit distillation (see :mod:`distill.kd`): loss = (1 - ce_weight) * divergence + ce_weight * CE."""

    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "forward_kl", description="forward_kl = KL(target || student); reverse_kl = KL(student || target); jsd uses beta")
    beta: float = Field(0.5, gt=0, lt=1, description="generalized JSD interpolation (divergence = jsd)")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of both distributions")
    ce_weight: float = Field(0.0, ge=0, le=1, description="share of cross-entropy on the data's tokens")


class DistillStudentRecipe(TrainingRecipe):
    """Distill a compact student (a transformer or a Parcae model) from a frozen target's logits."""

    recipe: Literal["distill_student"]
    target: TargetConfig = Field(default_factory=TargetConfig)
    student: ModelConfig = Field(default_factory=lambda: ModelConfig(hidden_size=192, num_layers=4, num_heads=3,
                                                                     intermediate_size=512))
    distill: DistillSection = Field(default_factory=DistillSection)

    @model_validator(mode="after")
    def _fits_context(self) -> "DistillStudentRecipe":
        if self.data.seq_len > self.student.max_position_embeddings:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) exceeds student.max_position_embeddings "
                             f"({self.student.max_position_embeddings})")
        return self


class ServerSection(Strict):
    """An OpenAI-compatible completions endpoint that serves the target (vLLM, SGLang, ``transformers
    serve``): regeneration sends it every prompt's text, ``concurrency`` requests at a time, and keeps
    the token ids it returns (vLLM: ``extra_body: {return_token_ids: true}``) or re-tokenizes its text."""

    base_url: str = Field(description="e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="the served model's name, as GET /v1/models lists it")
    api_key_env: Optional[str] = Field("OPENAI_API_KEY", description="environment variable holding the key; unset: 'EMPTY'")
    concurrency: int = Field(32, gt=0, description="requests in flight (the server batches them)")
    timeout_s: float = Field(600.0, gt=0)
    extra_body: dict[str, Any] = Field(default_factory=dict, description="server-specific request fields")

    @field_validator("base_url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"expected an http(s) URL such as http://127.0.0.1:8000/v1, got {v!r}")
        return v.rstrip("/")


class RegenerateStage(Strict):
    """Train on the target's own answers (:mod:`distill.regenerate`): prompts cut from ``data``'s corpus,
    answered by the target in-process, cached and reused by any later run with the same settings."""

    train_prompts: int = Field(4096, gt=0, description="train-split prompts, shared evenly by the temperatures")
    val_prompts: int = Field(128, gt=0, description="held-out prompts answered greedily: the evaluation set")
    prompt_tokens: int = Field(64, gt=0)
    max_new_tokens: int = Field(128, gt=0)
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 0.7], min_length=1,
                                      description="0 = greedy; each gets train_prompts / len(temperatures) prompts")
    top_p: float = Field(0.95, gt=0, le=1, description="sampled temperatures only")
    top_k: int = Field(0, ge=0, description="0 = off")
    batch_size: int = Field(64, gt=0)
    server: Optional[ServerSection] = Field(None, description="answer through this endpoint instead of in-process")

    @field_validator("temperatures")
    @classmethod
    def _non_negative(cls, v: list[float]) -> list[float]:
        if any(t < 0 for t in v) or len(set(v)) != len(v):
            raise ValueError(f"temperatures must be distinct and >= 0, got {v}")
        return v


class TrainDrafterRecipe(TrainingRecipe):
    """Distill a drafter from a frozen target whose hidden states are captured while it runs."""

    recipe: Literal["train_drafter"]
    target: TargetConfig = Field(default_factory=TargetConfig)
    drafter: DrafterSection = Field(default_factory=DrafterSection)
    features: FeaturesSection = Field(default_factory=FeaturesSection)
    regenerate: Optional[RegenerateStage] = Field(
        None, description="train on the target's own answers to prompts cut from data's corpus (data.format text)")

    @model_validator(mode="after")
    def _corpus_for_prompts(self) -> "TrainDrafterRecipe":
        if self.regenerate is not None and self.data.format != "text":
            raise ValueError(f"regenerate cuts its prompts from a text corpus: data.format must be 'text', "
                             f"got {self.data.format!r}")
        if self.regenerate is not None and self.regenerate.prompt_tokens + self.regenerate.max_new_tokens + 1 > self.data.seq_len + 1:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) is shorter than a regenerated example "
                             f"(regenerate.prompt_tokens + max_new_tokens + EOS = "
                             f"{self.regenerate.prompt_tokens + self.regenerate.max_new_tokens + 1})")
        return self

    @model_validator(mode="after")
    def _blocks_fit(self) -> "TrainDrafterRecipe":
        if self.data.seq_len < 2 * self.drafter.block_size:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) must be at least twice drafter.block_size "
                             f"({self.drafter.block_size})")
        return self


class PromptsSection(Strict):
    """Prompts to regenerate answers for: a JSONL file, or snippets cut from the data section's corpus."""

    file: Optional[str] = Field(None, description="JSONL with one {prompt_field: ...} or {messages_field: [...]} per line")
    field: str = "prompt"
    from_corpus: int = Field(0, ge=0, description="number of prompts cut from the data section's corpus (file unset)")
    split: Literal["train", "val"] = Field("train", description="corpus split the prompts are cut from")
    prompt_tokens: int = Field(64, gt=0, description="length of corpus prompts")

    @field_validator("file")
    @classmethod
    def _file_exists(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else _existing_path(v, "prompts file")

    @model_validator(mode="after")
    def _one_source(self) -> "PromptsSection":
        if (self.file is None) == (self.from_corpus == 0):
            raise ValueError("give exactly one of prompts.file or prompts.from_corpus")
        if self.file is not None:
            from .checks import read_prompts

            read_prompts(self.file, self.field)  # every line, before any compute
        return self


class GenerationSection(Strict):
    max_new_tokens: int = Field(128, gt=0)
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    batch_size: int = Field(8, gt=0)


class RegenerateRecipe(RecipeBase):
    """Let the target answer prompts itself, so drafters learn the target's own distribution."""

    recipe: Literal["regenerate"]
    target: TargetConfig = Field(default_factory=TargetConfig)
    prompts: PromptsSection
    generation: GenerationSection = Field(default_factory=GenerationSection)
    server: Optional[ServerSection] = Field(None, description="answer through this endpoint (the target's weights "
                                                               "are not loaded; its tokenizer is); None = in-process")
    data: DataConfig = Field(default_factory=DataConfig, description="the corpus for prompts.from_corpus")
    torch_threads: Optional[int] = Field(None, gt=0)


class EvalRecipe(RecipeBase):
    """Run the speculative-decoding loop and plain decoding on the same prompts; report tau and speedup."""

    recipe: Literal["eval"]
    target: TargetConfig = Field(default_factory=TargetConfig)
    drafter: str = Field(..., description="a drafter folder (save_pretrained output), or any causal LM folder "
                                          "with the target's vocabulary (a student; the target itself for Parcae self-speculation)")
    peer_assistant: Optional[str] = Field(
        None, description="a small causal LM folder: also measure transformers' assisted generation with it (greedy)")
    peer_prompt_lookup: int = Field(0, ge=0, description="tokens per draft of transformers' prompt-lookup decoding, "
                                                         "measured as a drafter-free peer (greedy); 0 = off")
    prompts: PromptsSection
    decoding: DecodingSection = Field(default_factory=DecodingSection)
    data: DataConfig = Field(default_factory=DataConfig, description="the corpus for prompts.from_corpus")

    @field_validator("drafter")
    @classmethod
    def _drafter_exists(cls, v: str) -> str:
        return _pretrained_folder(v, "drafter folder")

    @field_validator("peer_assistant")
    @classmethod
    def _assistant_exists(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else _local_or_hub(v, "peer assistant", "config.json")

    @model_validator(mode="after")
    def _drafter_fits_target(self) -> "EvalRecipe":
        _check_fit(self.drafter, self.target.path)
        return self


def _check_fit(drafter: str, target: str) -> None:
    """A drafter folder against a target on disk (a hub target is checked when it loads)."""
    from .checks import check_drafter_fits, read_config

    target_config = _local_config(target)
    if target_config is not None:
        check_drafter_fits(read_config(drafter, "drafter folder"), target_config, drafter, target)


class QuantMeasureSection(Strict):
    """Drafters: the decoding loop (greedy, chain) on held-out corpus prompts, for measured tau and speed."""

    prompts: int = Field(8, ge=0, description="held-out prompts; 0 = skip the decoding loop")
    prompt_tokens: int = Field(64, gt=0)
    max_new_tokens: int = Field(64, gt=0)


VARIANT_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")


class QuantizeRecipe(RecipeBase):
    """Full precision vs PTQ vs QAT of one trained drafter or causal LM, for one or more schemes.

    ``model`` is a trained folder (a drafter's or an LM's ``save_pretrained`` output). Every variant
    is PTQ'd from it and, separately, QAT fine-tuned from it for ``train.max_steps`` steps on ``data``
    and converted; with ``compute_matched`` the full-precision model is also fine-tuned for the same
    steps (no fake quantization) and PTQ'd, so QAT is compared with a baseline that had equal compute."""

    recipe: Literal["quantize"]
    model: str = Field(..., description="a trained drafter or causal LM folder")
    target: TargetConfig = Field(default_factory=TargetConfig, description="drafters: the target they serve")
    variants: dict[str, QuantSchemeSpec] = Field(..., min_length=1, description="name -> scheme, group_size, layers")
    compute_matched: bool = Field(True, description="also fine-tune full precision for the same steps and PTQ that")
    fake_quant_after_steps: int = Field(0, ge=0, description="QAT fine-tunes in full precision for this many steps first")
    min_gap: Optional[float] = Field(None, ge=0, description="report recovered only where |full - PTQ| >= this (tau "
                                     "or nats); None = 0.01; below it the ratio divides noise by noise")
    measure: QuantMeasureSection = Field(default_factory=QuantMeasureSection)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: str) -> str:
        return _pretrained_folder(v, "model folder")

    @field_validator("variants")
    @classmethod
    def _variant_names(cls, variants: dict) -> dict:
        for name in variants:
            if not VARIANT_NAME.match(name) or name in ("full", "full_ft"):
                raise ValueError(f"variant name '{name}' must be a folder-safe word (letters, digits, _ . -), not full/full_ft")
        return variants


class ExportGateSection(GateSettings):
    """The parity gate an export must pass (see serve_eval/parity.py)."""

    allow_failure: bool = Field(False, description="publish even when the gate fails (printed loudly, written into the card)")
    max_new_tokens: int = Field(64, gt=0, description="tokens generated per evaluation prompt")
    simulated_tau: Optional[float] = Field(None, ge=1, description="when the checkpoint recorded none (else read from it)")


class PushToHubSection(Strict):
    """Upload the export folder in one commit (huggingface_hub); only when enabled."""

    enabled: bool = False
    repo_id: Optional[str] = Field(None, description="owner/name")
    private: bool = True
    revision: Optional[str] = Field(None, description="branch to commit to (created if missing); None = main")
    primary_format: Literal["speculators", "transformers", "sglang_eagle3"] = Field(
        "speculators", description="the format whose files go to the repository root")
    commit_message: str = "Upload drafter exported by draftsmith"

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not HUB_ID.match(v):
            raise ValueError(f"repo_id '{v}' is not of the form owner/name")
        return v

    @model_validator(mode="after")
    def _needs_repo(self) -> "PushToHubSection":
        if self.enabled and not self.repo_id:
            raise ValueError("push_to_hub.enabled needs push_to_hub.repo_id (owner/name)")
        return self


def _default_export_prompts() -> "PromptsSection":
    return PromptsSection(from_corpus=8, split="val", prompt_tokens=64)


class ExportRecipe(RecipeBase):
    """Write a trained drafter in the formats serving engines load, behind the train-to-serve parity gate."""

    recipe: Literal["export"]
    drafter: str = Field(..., description="a trained drafter folder (checkpoints/best or model)")
    target: TargetConfig = Field(default_factory=TargetConfig)
    formats: Optional[list[Literal["transformers", "speculators", "sglang_eagle3"]]] = Field(
        None, description="None = every format that can express the drafter; naming one that cannot is an error")
    verifier_name_or_path: Optional[str] = Field(None, description="the verifier recorded for serving; None = the drafter's target")
    prompts: PromptsSection = Field(default_factory=_default_export_prompts, description="the gate's evaluation prompts")
    data: DataConfig = Field(default_factory=DataConfig, description="the corpus for prompts.from_corpus")
    gate: ExportGateSection = Field(default_factory=ExportGateSection)
    push_to_hub: PushToHubSection = Field(default_factory=PushToHubSection)
    eval_reports: list[str] = Field(default_factory=list, description="report.json files of eval runs, cited in the card")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="an export run: gate, tables, the folder as an artifact")
    torch_threads: int = Field(1, gt=0)

    @field_validator("drafter")
    @classmethod
    def _drafter_folder(cls, v: str) -> str:
        return _pretrained_folder(v, "drafter folder")

    @field_validator("eval_reports")
    @classmethod
    def _reports_exist(cls, reports: list[str]) -> list[str]:
        return [_existing_path(r, "eval report") for r in reports]

    @model_validator(mode="after")
    def _drafter_fits_target(self) -> "ExportRecipe":
        _check_fit(self.drafter, self.target.path)
        return self


# --------------------------------------------------------------------------------------------------
# Loading, overrides and error messages
# --------------------------------------------------------------------------------------------------


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (values parsed as YAML scalars)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"override '{item}' is not of the form section.key=value")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RecipeError(f"override '{item}': '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = _scalar(value)
    return raw


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _scalar(text: str) -> Any:
    """A YAML scalar, except that ``1e-3`` is a float (YAML 1.1 would read it as a string)."""
    if text == "":
        return None
    value = yaml.safe_load(text)
    return float(value) if isinstance(value, str) and _FLOAT.match(value) else value


def _model_at(root: type[BaseModel], loc: tuple) -> Optional[type[BaseModel]]:
    """The pydantic model class that owns the field at ``loc`` (for key suggestions)."""
    model: Any = root
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return model if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = model.model_fields[part].annotation
        # Optional[Section] -> Section
        for arg in getattr(model, "__args__", ()):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                model = arg
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _format_error(cls: type[BaseModel], err: dict, source: str) -> str:
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        owner = _model_at(cls, loc[:-1])
        valid = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        elsewhere = [f"{name}.{loc[-1]}" for name, f in cls.model_fields.items()
                     if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel) and loc[-1] in f.annotation.model_fields]
        if close:
            hint = f"did you mean '{'.'.join(loc[:-1] + (close[0],))}'?"
        elif elsewhere:
            hint = f"did you mean '{elsewhere[0]}'?"
        else:
            hint = f"valid keys here: {', '.join(valid)}"
        return f"{source}: unknown key '{key}'; {hint}"
    if err["type"] == "missing":
        return f"{source}: missing required key '{key}'"
    msg = err["msg"].removeprefix("Value error, ")
    where = f"key '{key}'" if key else "recipe"
    return f"{source}: {where} = {err.get('input')!r}: {msg}"


def validate_recipe(schema: type[RecipeBase], raw: dict, source: str = "recipe") -> RecipeBase:
    """``raw`` validated into ``schema`` (a recipe's typed config), or :class:`RecipeError` naming every
    bad key. Which schema a ``recipe:`` name has is :mod:`recipes.registry`'s to say."""
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        raise RecipeError("\n".join(_format_error(schema, err, source) for err in e.errors())) from None


def read_yaml_mapping(path: str | os.PathLike) -> dict:
    """A recipe file's top-level mapping, or :class:`RecipeError` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file '{path}' does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: expected a YAML mapping at the top level")
    return raw
