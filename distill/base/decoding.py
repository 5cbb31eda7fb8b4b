"""Decoding settings: what the speculative-decoding loop (:mod:`serve_eval`) is asked to do, as the
``decoding:`` section of an eval recipe.

The section is the one source of truth for decoding options: their defaults, their descriptions and
every check that depends on the recipe alone live here. ``draftsmith eval`` derives one flag per leaf
from it (:mod:`recipes.cli`); checks that need the device or the loaded models (a CPU kernel asked for
on a GPU, a draft vocabulary larger than the drafter's head) are made where those are known
(:mod:`recipes.evaluate`, :mod:`serve_eval`), naming the key.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .schema import Strict


def _yaml_off(v: Any) -> Any:
    """A bare YAML ``on`` / ``off`` reads as a boolean (YAML 1.1): the setting of that name."""
    return {False: "off", True: "on"}.get(v, v) if isinstance(v, bool) else v


class BudgetSection(Strict):
    """How much of each draft a step verifies."""

    adaptive: bool = Field(
        True,
        description="verify, every step, the prefix of the draft (chain) or tree (of at most "
        "the tree budget) with the most expected tokens/s under measured costs "
        "(serve_eval.budget)",
    )
    verify_drafts: int = Field(
        0,
        ge=0,
        description="with budget.adaptive false, a chain verifies the first N drafts of each step: "
        "a fixed draft length (vLLM's num_speculative_tokens), the baseline "
        "adaptive choices are measured against; 0 = every draft",
    )


class DrafterOptions(Strict):
    """How the drafter drafts."""

    confidence_threshold: float = Field(
        0.0, ge=0, lt=1, description="DSpark: a draft stops where the drafter's confidence is below this; 0 = never"
    )
    draft_length: int = Field(
        7, gt=0, description="causal-LM drafters (students, Parcae, PARD): tokens drafted per step"
    )
    parallel_drafts: bool = Field(
        True,
        description="a PARD-trained LM (drafters.pard) drafts its block in one forward; "
        "false: one token a forward, drafter.draft_length tokens",
    )
    draft_recurrence: int | None = Field(
        None,
        gt=0,
        description="Parcae drafter: recurrences while drafting (self-speculation: the drafter is the target "
        "folder); unset = the model's own",
    )


class LookupSection(Strict):
    """Prompt-lookup continuations grafted onto the drafts (:mod:`serve_eval.lookup`)."""

    tokens: int = Field(
        0,
        ge=0,
        description="graft a prompt-lookup continuation of up to this many tokens onto every "
        "draft, chain or tree, greedy or sampled, one row or batches; 0 = off",
    )


class VocabSection(Strict):
    """The drafter's output vocabulary (:mod:`drafters.vocab`), for a drafter with its own output head
    (DFlash, DSpark, EAGLE-3, a PARD or student LM; not the target drafting for itself)."""

    size: int = Field(
        0, ge=0, description="draft from the N tokens the target emits most only; 0 = the whole vocabulary"
    )
    candidates: int = Field(
        0,
        ge=0,
        description="choose the draft vocabulary per step (drafters.vocab.CandidateHead): "
        "the vocab.size tokens plus the K likeliest in any of a call's rows under a "
        "low-rank approximation of the head; 0 = off",
    )
    rank: int = Field(64, gt=0, description="with vocab.candidates: the rank of the head's approximation")
    prompts: int = Field(
        256, gt=0, description="train-split prompts whose answers by the target count its tokens for vocab.size"
    )


class KVSection(Strict):
    """The target's KV cache (:mod:`serve_eval.kv`), in both loops; the report measures it against full precision."""

    format: Literal["full", "int8", "fp8", "int4"] = Field(
        "full", description="full precision, or int8 / fp8 / int4 codes with an fp16 scale per 32 channels"
    )
    rotate: bool = Field(
        False,
        description="quantize keys and values after a fixed random rotation (spreads outlier "
        "channels); needs a quantized format",
    )

    @model_validator(mode="after")
    def _rotate_quantized_only(self):
        if self.rotate and self.format == "full":
            raise ValueError(
                "decoding.kv.rotate rotates keys and values before quantizing them: it needs "
                "decoding.kv.format int8, fp8 or int4"
            )
        return self


class BatchesSection(Strict):
    """Batched decoding (:mod:`serve_eval.measure`): batched speculative against batched plain decoding."""

    sizes: list[int] = Field(
        default_factory=list,
        description="also decode the prompts in batches of these sizes "
        "(any drafter, chain or tree); empty = no batches",
    )
    rounds: int = Field(
        1,
        ge=1,
        description="time plain, speculative, speculative, plain this many times per batch "
        "size; the speedup pools every round's tokens and seconds, and each "
        "half's own ratio is reported (its spread)",
    )

    @field_validator("sizes")
    @classmethod
    def _positive_batches(cls, v: list[int]) -> list[int]:
        if any(b < 1 for b in v):
            raise ValueError(f"batch sizes must be >= 1, got {v}")
        return v


class SSDSection(Strict):
    """Speculative speculative decoding (:mod:`serve_eval.ssd`)."""

    enabled: bool = Field(
        False,
        description="causal-LM and PARD drafters: the drafter drafts after the likeliest "
        "verification outcomes while the target verifies; the report also runs "
        "plain speculative decoding. Needs mode chain, budget.adaptive false, "
        "lookup.tokens 0 and no batches",
    )
    branches: int = Field(8, gt=0, description="outcomes drafted after per step (the speculation cache's size)")
    exponent: float = Field(
        1.0, gt=0, description="r of the miss rate's power law F^-r; branches per outcome ~ P(outcome)^(1/(1+r))"
    )
    backup: Literal["none", "draft"] = Field(
        "none",
        description="on a miss: verify the bonus alone while the cache is "
        "built for it (none), or draft just in time (draft)",
    )
    concurrent: bool = Field(
        True,
        description="the drafter in a worker process on a core of its own (CPU only); "
        "false: inline, no overlap, each cost timed alone (the report models a "
        "drafter on a device of its own from them)",
    )


def static_unsupported(drafter: bool, budget: bool, lookup: int, quantized_kv: bool) -> str | None:
    """Why the static step (:mod:`serve_eval.static`) cannot serve a run (None: it can): ``drafter``, whether
    it drafts with the run's drafter (a block drafter, EAGLE-3, a causal LM whose layers keep attention caches,
    or none); ``budget``, whether a per-step budget chooses; ``quantized_kv``, a quantized cache."""
    if not drafter:
        return "its drafters keep attention caches only; this drafter has layers of another kind (torch backend)"
    if budget:
        return "it verifies a fixed number of drafts a step (decoding.budget.adaptive: false)"
    if lookup:
        return "prompt-lookup copies (decoding.lookup.tokens) run on the torch backend"
    if quantized_kv:
        return "it keeps the KV cache in the model's dtype (decoding.kv.format: full)"
    return None


class StaticSection(Strict):
    """The ``static`` backend's step (:mod:`serve_eval.static`)."""

    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile the target's verify and the drafter's draft once per (rows, length) shape: "
        "reduce-overhead (CUDA graphs) on a GPU, inductor's default elsewhere; auto: on",
    )
    buckets: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32],
        min_length=1,
        description="verify lengths a step is padded up to (one compiled graph each)",
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _bare_yaml_off(cls, v: Any) -> Any:
        return _yaml_off(v)

    @field_validator("buckets")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if min(v) < 1:
            raise ValueError(f"decoding.static.buckets {v}: verify lengths of at least 1")
        return sorted(set(v))


class CpuSection(Strict):
    """CPU kernels of the ``cpu`` backend; ``auto`` settles each for the device and the drafter, and
    every setting but ``auto`` and ``off`` needs ``decoding.backend`` auto or cpu."""

    int8: Literal["auto", "off", "head", "all"] = Field(
        "auto",
        description="serve the drafter's projections onto the vocabulary (head) or all its Linears (all) from "
        "int8 weight codes and int8 activations (serve_eval.int8); auto: all on the CPU, off on a "
        "GPU or when the drafter is the target itself. The target is untouched",
    )
    prepack: Literal["auto", "on", "panels", "onednn", "off"] = Field(
        "auto",
        description="serve the target's Linears from weights prepacked once (serve_eval.prepack): panels (the "
        "AVX2 kernel) or onednn; on: the first of them that serves here; both loops use it; auto: "
        "on on the CPU where a kernel serves, off on a GPU",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="a block drafter's draft as one torch.compile graph (serve_eval.compiled: inductor's fused "
        "CPU kernels, compiled once in the warm-up); auto: on for block drafters on the CPU where a "
        "C++ compiler is found, off on a GPU and for other drafters",
    )

    @field_validator("int8", "prepack", "compile", mode="before")
    @classmethod
    def _bare_yaml_off(cls, v: Any) -> Any:
        return _yaml_off(v)


# keys of the flat section and where each lives now; lookup and ssd moved only where their value is not a section
MOVED = {
    "adaptive": "budget.adaptive",
    "verify_drafts": "budget.verify_drafts",
    "confidence_threshold": "drafter.confidence_threshold",
    "draft_length": "drafter.draft_length",
    "parallel_drafts": "drafter.parallel_drafts",
    "draft_recurrence": "drafter.draft_recurrence",
    "lookup": "lookup.tokens",
    "draft_vocab": "vocab.size",
    "draft_vocab_candidates": "vocab.candidates",
    "draft_vocab_rank": "vocab.rank",
    "draft_vocab_prompts": "vocab.prompts",
    "kv_cache": "kv.format",
    "kv_rotate": "kv.rotate",
    "batch_sizes": "batches.sizes",
    "batch_rounds": "batches.rounds",
    "ssd": "ssd.enabled",
    "ssd_branches": "ssd.branches",
    "ssd_exponent": "ssd.exponent",
    "ssd_backup": "ssd.backup",
    "ssd_concurrent": "ssd.concurrent",
    "drafter_int8": "cpu.int8",
    "prepack": "cpu.prepack",
    "compile": "cpu.compile",
}


class DecodingSection(Strict):
    """How the evaluation decodes: greedy or sampled, chain or tree verification, on which backend."""

    max_new_tokens: int = Field(128, gt=0, description="tokens generated per prompt")
    temperature: float = Field(0.0, ge=0, description="0 = greedy; > 0 samples")
    top_k: int = Field(0, ge=0, description="sampling: keep the K likeliest tokens; 0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="sampling: nucleus mass; 1 = off")
    torch_threads: int = Field(
        1, gt=0, description="torch threads of the benchmark; 1 avoids spin contention on small CPUs"
    )
    mode: Literal["chain", "tree"] = Field("chain", description="chain verification, or DDTree trees (any drafter)")
    tree_budgets: list[int] = Field(
        default_factory=lambda: [16],
        min_length=1,
        description="tree mode: tree nodes per step; several budgets are each measured and plotted",
    )
    backend: Literal["auto", "torch", "static", "cpu"] = Field(
        "auto",
        description="cpu: the CPU kernels and their settings (decoding.cpu); torch: plain torch / transformers "
        "modules on any device (no C++ ops, no prepacked weights, no int8 drafter, no compiled "
        "draft, no lean forward); static: torch with the static-shape step (decoding.static: fixed "
        "caches, one host read a step, compiled; every drafter kind, no adaptive budget, no "
        "lookup, a full KV cache); auto: cpu on a CPU device, static on a GPU where it serves the "
        "run, else torch",
    )
    budget: BudgetSection = Field(default_factory=BudgetSection)
    drafter: DrafterOptions = Field(default_factory=DrafterOptions)
    lookup: LookupSection = Field(default_factory=LookupSection)
    vocab: VocabSection = Field(default_factory=VocabSection)
    kv: KVSection = Field(default_factory=KVSection)
    batches: BatchesSection = Field(default_factory=BatchesSection)
    ssd: SSDSection = Field(default_factory=SSDSection)
    cpu: CpuSection = Field(default_factory=CpuSection)
    static: StaticSection = Field(default_factory=StaticSection)

    def static_refusal(self, drafter_served: bool = True) -> str | None:
        """Why the static step cannot serve these settings with a drafter it serves or another (None: it can)."""
        why = static_unsupported(drafter_served, self.budget.adaptive, self.lookup.tokens, self.kv.format != "full")
        return why or ("speculative speculation (decoding.ssd) runs on the torch backend" if self.ssd.enabled else None)

    @model_validator(mode="after")
    def _static_serves(self):
        why = self.static_refusal() if self.backend == "static" else None
        if why:
            raise ValueError(f"decoding.backend = 'static': {why}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """A key of the flat section is an error naming its key now (``decoding.kv_cache`` is
        ``decoding.kv.format``; ``decoding.lookup: 7`` is ``decoding.lookup.tokens: 7``)."""
        if not isinstance(data, dict):
            return data
        moved = [
            f"decoding.{old} is now decoding.{new}"
            for old, new in MOVED.items()
            if old in data and not (old in cls.model_fields and isinstance(data[old], (dict, Strict)))
        ]
        if moved:
            raise PydanticCustomError("moved_key", "{moved}", {"moved": "; ".join(moved)})
        return data

    @model_validator(mode="after")
    def _fixed_length(self):
        if self.budget.verify_drafts and (self.budget.adaptive or self.mode != "chain"):
            raise ValueError(
                f"decoding.budget.verify_drafts {self.budget.verify_drafts}: a fixed draft length is a chain's "
                f"without a budget: it needs mode: chain, budget.adaptive: false (got mode {self.mode!r}, "
                f"budget.adaptive {self.budget.adaptive})"
            )
        return self

    @model_validator(mode="after")
    def _ssd_chains(self):
        if self.ssd.enabled and (
            self.mode != "chain" or self.budget.adaptive or self.lookup.tokens or self.batches.sizes
        ):
            raise ValueError(
                "decoding.ssd.enabled: ssd verifies every draft of a chain the speculation made: it needs "
                "mode: chain, budget.adaptive: false, lookup.tokens: 0 and no batches.sizes (got mode "
                f"{self.mode!r}, budget.adaptive {self.budget.adaptive}, lookup.tokens {self.lookup.tokens}, "
                f"batches.sizes {self.batches.sizes})"
            )
        return self

    @model_validator(mode="after")
    def _candidates_own_head(self):
        if self.vocab.candidates and self.cpu.int8 == "head":
            raise ValueError(
                "decoding.cpu.int8 = 'head' with decoding.vocab.candidates: the per-step vocabulary computes "
                "its own rows (auto and all serve the rest in int8 and leave the head to it)"
            )
        return self

    @model_validator(mode="after")
    def _torch_backend_has_no_cpu_kernels(self):
        if self.backend in ("torch", "static"):
            asked = [f"decoding.cpu.{k} = {v!r}" for k, v in self.cpu.model_dump().items() if v not in ("auto", "off")]
            if asked:
                raise ValueError(
                    f"{', '.join(asked)}: a CPU kernel, which decoding.backend = {self.backend!r} does not serve: "
                    "set it to auto or off, or decoding.backend to auto or cpu"
                )
        return self


class GateSettings(Strict):
    """The train-to-serve parity gate (:mod:`serve_eval.parity`): its tolerances and the fixed batch
    whose logits it compares. The one home of its defaults; an export recipe's ``gate:`` extends it."""

    logits_atol: float = Field(0.0, ge=0, description="max |logit difference| between the trained and reloaded drafter")
    tau_rel_tolerance: float = Field(
        0.25, ge=0, description="allowed |measured - simulated tau|, as a share of simulated - 1"
    )
    tau_abs_tolerance: float = Field(0.03, ge=0, description="plus this absolute slack")
    batch_size: int = Field(2, gt=0, description="rows of the fixed batch whose logits are compared")
    seq_len: int = Field(64, gt=0, description="positions per row of that batch")
    seed: int = Field(0, description="seeds the batch's anchors and any random rows")
