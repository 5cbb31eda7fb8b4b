"""Decoding settings: what the speculative-decoding loop (:mod:`serve_eval`) is asked to do, as the
``decoding:`` section of eval, export and quantize recipes."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from .schema import Strict


class DecodingSection(Strict):
    """How the evaluation decodes: greedy or sampled, chain or tree verification."""

    max_new_tokens: int = Field(128, gt=0)
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="0 = off")
    top_p: float = Field(1.0, gt=0, le=1)
    mode: Literal["chain", "tree"] = Field("chain", description="chain, or DDTree trees (block drafters)")
    tree_budgets: list[int] = Field(default_factory=lambda: [16], min_length=1,
                                    description="tree nodes per step; several budgets are each measured and plotted")
    adaptive: bool = Field(True, description="verify, every step, the prefix of the draft (chain) or tree (of at most "
                                              "the tree budget) with the most expected tokens/s under measured costs "
                                              "(serve_eval.budget)")
    confidence_threshold: float = Field(0.0, ge=0, lt=1, description="DSpark: stop a draft where confidence < this")
    verify_drafts: int = Field(0, ge=0, description="with adaptive: false, a chain verifies the first N drafts of each "
                                                    "step: a fixed draft length (vLLM's num_speculative_tokens), the "
                                                    "baseline adaptive choices are measured against; 0 = every draft")
    draft_length: int = Field(7, gt=0, description="causal-LM drafters (students, Parcae): tokens drafted per step")
    parallel_drafts: bool = Field(True, description="a PARD-trained LM (drafters.pard) drafts its block in one forward; "
                                                     "false: one token a forward, draft_length tokens")
    draft_recurrence: Optional[int] = Field(
        None, gt=0, description="Parcae drafter: recurrences while drafting (self-speculation: drafter = target folder)")
    torch_threads: int = Field(1, gt=0, description="benchmark threads; 1 avoids spin contention on small CPUs")
    lookup: int = Field(0, ge=0, description="graft a prompt-lookup continuation of up to this many tokens onto every "
                                             "draft, chain or tree, greedy or sampled (serve_eval.lookup); in batches a row "
                                             "verifies its copy instead of its drafts where that pays; 0 = off")
    draft_vocab: int = Field(0, ge=0, description="a drafter with its own output head (DFlash, DSpark, EAGLE-3, a "
                                                  "PARD or student LM; not the target itself): draft from the N tokens "
                                                  "the target emits most only (drafters.vocab); 0 = the whole vocabulary")
    draft_vocab_candidates: int = Field(0, ge=0, description="choose the draft vocabulary per step (drafters.vocab."
                                        "CandidateHead, SpecVocab's way): the draft_vocab tokens plus the K likeliest "
                                        "in any of a call's rows under a low-rank approximation of the head; 0 = off")
    draft_vocab_rank: int = Field(64, gt=0, description="draft_vocab_candidates: the rank of the head's approximation")
    draft_vocab_prompts: int = Field(256, gt=0, description="train-split prompts whose greedy answers count the "
                                                            "target's tokens for draft_vocab")
    drafter_int8: Literal["auto", "off", "head", "all"] = Field(
        "auto", description="serve the drafter's projections onto the vocabulary (head) or all its Linears (all) from "
                            "int8 weight codes and int8 activations (serve_eval.int8, a CPU kernel); auto: all on "
                            "the CPU, off on a GPU or when the drafter is the target itself. The target is untouched")
    prepack: Literal["auto", "on", "panels", "onednn", "off"] = Field(
        "auto", description="serve the target's Linears from weights prepacked once for a CPU kernel (serve_eval.prepack): "
                            "panels (our AVX2 kernel) or onednn; on: the first of them that serves here; both loops "
                            "use it; auto: on on the CPU where a kernel serves, off on a GPU")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="a block drafter's draft as one torch.compile graph (serve_eval.compiled: inductor's "
                            "fused CPU kernels, compiled once in the warm-up); auto: on for block drafters on the "
                            "CPU where a C++ compiler is found, off on a GPU (not measured there) and for other drafters")
    kv_cache: Literal["full", "int8", "fp8", "int4"] = Field(
        "full", description="the target's KV cache: full precision, or int8 / fp8 / int4 codes with an fp16 scale per "
                            "32 channels (serve_eval.kv); both loops use it, the report measures it against full")
    kv_rotate: bool = Field(False, description="quantize keys and values after a fixed random rotation (spreads "
                                               "outlier channels, serve_eval.kv)")
    ssd: bool = Field(False, description="speculative speculative decoding (serve_eval.ssd), causal-LM and PARD "
                                         "drafters: the drafter drafts after the likeliest verification outcomes while "
                                         "the target verifies; the report also runs plain speculative decoding")
    ssd_branches: int = Field(8, gt=0, description="ssd: outcomes drafted after per step (the speculation cache's size)")
    ssd_exponent: float = Field(1.0, gt=0, description="ssd: r of the miss rate's power law F^-r; branches per "
                                                       "outcome ~ P(outcome)^(1/(1+r))")
    ssd_backup: Literal["none", "draft"] = Field("none", description="ssd, on a miss: verify the bonus alone while the "
                                                                    "cache is built for it (none), or draft just in time")
    ssd_concurrent: bool = Field(True, description="ssd: the drafter in a worker process on a core of its own (CPU); "
                                                   "false: inline, no overlap, each cost timed alone (the report models "
                                                   "a drafter on a device of its own from them)")
    batch_sizes: list[int] = Field(default_factory=list, description="block drafters, chain: also decode the prompts "
                                   "in batches of these sizes (batched plain vs batched speculative; serve_eval.batch)")
    batch_rounds: int = Field(1, ge=1, description="batch_sizes: time plain, speculative, speculative, plain this many "
                                                   "times per batch size; the speedup pools every round's tokens and "
                                                   "seconds, and each half's own ratio is reported (its spread)")

    @field_validator("drafter_int8", "prepack", "compile", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        return {False: "off", True: "on"}.get(v, v) if isinstance(v, bool) else v  # YAML 1.1 reads bare on / off as booleans

    @field_validator("batch_sizes")
    @classmethod
    def _positive_batches(cls, v: list[int]) -> list[int]:
        if any(b < 1 for b in v):
            raise ValueError(f"batch sizes must be >= 1, got {v}")
        return v

    @model_validator(mode="after")
    def _rotate_quantized_only(self):
        if self.kv_rotate and self.kv_cache == "full":
            raise ValueError("kv_rotate rotates keys and values before quantizing them: it needs kv_cache int8, fp8 or int4")
        return self

    @model_validator(mode="after")
    def _fixed_length(self):
        if self.verify_drafts and (self.adaptive or self.mode != "chain" or self.batch_sizes):
            raise ValueError(f"verify_drafts {self.verify_drafts}: a fixed draft length is a chain's without a budget: it "
                             f"needs mode: chain, adaptive: false and no batch_sizes (got mode {self.mode!r}, adaptive "
                             f"{self.adaptive}, batch_sizes {self.batch_sizes})")
        return self

    @model_validator(mode="after")
    def _ssd_chains(self):
        if self.ssd and (self.mode != "chain" or self.adaptive or self.lookup or self.batch_sizes):
            raise ValueError("ssd verifies every draft of a chain the speculation made: it needs mode: chain, "
                             "adaptive: false, lookup: 0 and no batch_sizes (got mode "
                             f"{self.mode!r}, adaptive {self.adaptive}, lookup {self.lookup}, batch_sizes {self.batch_sizes})")
        return self


class GateSettings(Strict):
    """The train-to-serve parity gate (:mod:`serve_eval.parity`): its tolerances and the fixed batch
    whose logits it compares. The one home of its defaults; an export recipe's ``gate:`` extends it."""

    logits_atol: float = Field(0.0, ge=0, description="max |logit difference| between the trained and reloaded drafter")
    tau_rel_tolerance: float = Field(0.25, ge=0, description="allowed |measured - simulated tau|, as a share of simulated - 1")
    tau_abs_tolerance: float = Field(0.03, ge=0, description="plus this absolute slack")
    batch_size: int = Field(2, gt=0, description="rows of the fixed batch whose logits are compared")
    seq_len: int = Field(64, gt=0, description="positions per row of that batch")
    seed: int = Field(0, description="seeds the batch's anchors and any random rows")
