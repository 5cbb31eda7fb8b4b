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

The package's modules, each one seam:

    errors    RecipeError
    paths     local files and folders a recipe names (shipped ones found from any directory), hub ids
    sections  the typed sections recipes share (model, data, training, target, drafter, prompts, ...)
    recipes   each recipe's schema (which module runs which name: recipes.registry)
    loading   YAML files, dotted overrides, validation with errors that name the key
    flags     command-line flags derived from a schema, one per leaf field
    targets   shipped configs of real hub targets, which dry runs build from without the hub

Every public name is importable from ``distill.config`` itself.
"""

from .errors import (  # noqa: F401
    RecipeError,
)
from .loading import (  # noqa: F401
    apply_overrides,
    read_yaml_mapping,
    set_key,
    validate_recipe,
)
from .paths import (  # noqa: F401
    HUB_ID,
    PROJECT_ROOT,
    RecipePath,
    resolve_path,
)
from .recipes import (  # noqa: F401
    BenchRecipe,
    BenchSet,
    DistillStudentRecipe,
    EvalRecipe,
    ExportRecipe,
    QuantizeRecipe,
    QuickstartDrafterStage,
    QuickstartEvalStage,
    QuickstartExportStage,
    QuickstartRecipe,
    QuickstartShippedDrafterStage,
    QuickstartStage,
    QuickstartTargetStage,
    RecipeBase,
    RegenerateRecipe,
    TrainDrafterRecipe,
    TrainingRecipe,
    TrainLMRecipe,
)
from .sections import (  # noqa: F401
    DATA_SUFFIXES,
    QUANT_SCHEME,
    QUANT_SCHEME_EXAMPLES,
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
    ParcaeSection,
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
)

__all__ = [
    "RecipeError",
    "HUB_ID",
    "PROJECT_ROOT",
    "RecipePath",
    "resolve_path",
    "DATA_SUFFIXES",
    "DataConfig",
    "DistillSection",
    "PardSection",
    "DrafterKind",
    "DrafterSection",
    "ExportGateSection",
    "FeaturesSection",
    "GenerationSection",
    "ModelConfig",
    "OptimConfig",
    "ParcaeSection",
    "PromptsSection",
    "PushToHubSection",
    "QUANT_SCHEME",
    "QUANT_SCHEME_EXAMPLES",
    "QuantMeasureSection",
    "QuantSchemeSpec",
    "QuantSection",
    "RegenerateStage",
    "ServerSection",
    "TargetConfig",
    "TokenizerConfig",
    "TrainConfig",
    "VARIANT_NAME",
    "WandbConfig",
    "DistillStudentRecipe",
    "BenchRecipe",
    "BenchSet",
    "EvalRecipe",
    "ExportRecipe",
    "QuantizeRecipe",
    "QuickstartDrafterStage",
    "QuickstartEvalStage",
    "QuickstartExportStage",
    "QuickstartRecipe",
    "QuickstartShippedDrafterStage",
    "QuickstartStage",
    "QuickstartTargetStage",
    "RecipeBase",
    "RegenerateRecipe",
    "TrainDrafterRecipe",
    "TrainLMRecipe",
    "TrainingRecipe",
    "apply_overrides",
    "read_yaml_mapping",
    "set_key",
    "validate_recipe",
]
