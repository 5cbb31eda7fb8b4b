"""Parcae: a looped causal LM whose recurrence is a stable linear dynamical system.

Shape (Prairie et al. 2026, arXiv 2604.12946)::

    e       = RMSNorm(Prelude(embed(x)))                    # the input, injected at every iteration
    h_0     = 0
    h_{t+1} = Core(inject(h_t, e))          t = 0 .. T-1    # the same blocks, T times
    logits  = Head(RMSNorm(Coda(h_T)))

``Core`` is a stack of pre-norm residual blocks, so with the ``diagonal`` injection one iteration is
exactly the discretised linear dynamical system plus a learned nonlinearity::

    h_{t+1} = A_bar h_t + B_bar e + R_bar(h_t, e)
    A = -exp(A_log) (diagonal),  Delta = softplus(dt_bias),  A_bar = exp(Delta * A),  B_bar = Delta * B

Every entry of ``A_bar`` lies in (0, 1) for *any* parameter values, so the linear part of the
recurrence is a contraction by construction (spectral radius < 1). Initialisation follows the paper's
code: ``A_log = 0``, ``A_bar = sqrt(1/5) ~ 0.447``, ``B = I``. For comparison, ``add`` (``h + e``,
marginally stable, radius 1) and ``linear`` (Huginn's ``W [h; e]``, radius unconstrained).

Training draws a depth per sequence, ``T ~ max(1, Poisson(mean_recurrence))``; the first
``T - min(T, backprop_depth)`` iterations run without gradients and only the last
``min(T, backprop_depth)`` carry them (truncated backprop through the loop, constant memory in T).
Sequences of one batch stop at their own depth (``torch.where`` freezes finished ones).

Blocks are ``transformers``' Llama decoder layers (RMSNorm, RoPE, SwiGLU), so a Parcae model and a
fixed-depth Llama of the same width differ only in the recurrence. Each application of a core block
has its own KV-cache slot (``prelude + t * core + j``), so ``generate`` and the speculative-decoding
loop cache a looped model like any other; the depth used outside training is ``config.recurrence``
(settable, or ``num_steps=`` per call). Deviations from the paper's code, and why: the initial state
is zero rather than random, so the model is a deterministic function of its prefix (lossless
self-speculation and exact greedy parity need that); blocks use Llama's SwiGLU and init rather than
ReLU^2 and "scaled-zero", so the fixed-depth baseline is the project's own transformer; the state has
the model's width (``d_state = d_model``), so the projection ``C`` is the identity and omitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GenerationMixin, LlamaConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

INJECTIONS = ("diagonal", "linear", "add")


@strict
class ParcaeConfig(LlamaConfig):
    """A Llama config plus the loop: ``n_prelude`` / ``n_core`` / ``n_coda`` distinct blocks, the
    training depth distribution (``mean_recurrence``, ``mean_backprop_depth``), the injection, and
    ``recurrence``, the depth used outside training (default ``mean_recurrence``).
    ``num_hidden_layers`` is derived: the number of KV-cache slots at that depth."""

    model_type = "draftsmith_parcae"
    n_prelude: int = 1
    n_core: int = 2
    n_coda: int = 1
    mean_recurrence: int = 4
    mean_backprop_depth: int = 2
    injection_type: str = "diagonal"
    recurrence: int | None = None

    def __post_init__(self, **kwargs):
        if self.injection_type not in INJECTIONS:
            raise ValueError(f"injection_type must be one of {INJECTIONS}, got {self.injection_type!r}")
        for name in ("n_core", "mean_recurrence", "mean_backprop_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.recurrence is None:
            self.recurrence = self.mean_recurrence
        self.num_hidden_layers = self.cache_slots(self.recurrence)
        super().__post_init__(**kwargs)

    def cache_slots(self, recurrence: int) -> int:
        return self.n_prelude + self.n_core * recurrence + self.n_coda

    def set_recurrence(self, recurrence: int) -> None:
        """The depth used outside training (``generate``, evaluation, the decoding loop)."""
        if recurrence < 1:
            raise ValueError(f"recurrence must be >= 1, got {recurrence}")
        self.recurrence = recurrence
        self.num_hidden_layers = self.cache_slots(recurrence)


# --------------------------------------------------------------------------------------------------
# Injections: u_t = inject(h_t, e), the input of the core blocks at iteration t
# --------------------------------------------------------------------------------------------------


class DiagonalInjection(nn.Module):
    """``u = A_bar * h + Delta * (e @ B^T)`` with ``A_bar = exp(-softplus(dt_bias) * exp(A_log))``."""

    #: the injection's dynamics stay in full precision under quantization (:func:`distill.quantize.always_kept`)
    quantization_keep = ("A_log", "dt_bias", "B")

    def __init__(self, d: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(d))
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.B = nn.Parameter(torch.empty(d, d))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        delta = -math.log(math.sqrt(1 / 5))  # A_bar = exp(-delta) = sqrt(1/5) at A_log = 0
        self.A_log.zero_()
        self.dt_bias.fill_(math.log(math.expm1(delta)))  # softplus^-1(delta)
        nn.init.eye_(self.B)

    def a_bar(self) -> torch.Tensor:
        return torch.exp(-F.softplus(self.dt_bias) * torch.exp(self.A_log))

    def prepare(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What does not change across iterations: ``(A_bar, B_bar e)``, computed once per forward."""
        dt = F.softplus(self.dt_bias)
        return torch.exp(-dt * torch.exp(self.A_log)), dt * (e @ self.B.T)

    def forward(self, h: torch.Tensor, prepared: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a_bar, b_bar_e = prepared
        return h * a_bar + b_bar_e

    def spectral_radius(self) -> torch.Tensor:
        return self.a_bar().max()


class AddInjection(nn.Module):
    """``u = h + e`` (A_bar = I: marginally stable)."""

    def prepare(self, e: torch.Tensor) -> torch.Tensor:
        return e

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return h + e

    def spectral_radius(self) -> torch.Tensor:
        return torch.ones(())


class LinearInjection(nn.Module):
    """Huginn's adapter ``u = W [h; e]`` (A_bar = W[:, :d]: nothing bounds its spectral radius)."""

    def __init__(self, d: int):
        super().__init__()
        self.adapter = nn.Linear(2 * d, d, bias=False)

    def prepare(self, e: torch.Tensor) -> torch.Tensor:
        return e  # the adapter stays one Linear (so quantization sees it whole): nothing to hoist

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.adapter(torch.cat([h, e], dim=-1))

    def spectral_radius(self) -> torch.Tensor:
        d = self.adapter.out_features
        return torch.linalg.eigvals(self.adapter.weight[:, :d].float()).abs().max()


def build_injection(kind: str, d: int) -> nn.Module:
    return {"diagonal": lambda: DiagonalInjection(d), "add": AddInjection, "linear": lambda: LinearInjection(d)}[kind]()


# --------------------------------------------------------------------------------------------------
# Depth sampling
# --------------------------------------------------------------------------------------------------


def sample_depths(
    batch_size: int, mean_recurrence: int, backprop_depth: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence ``(n, k)``: ``T ~ max(1, Poisson(mean))``, ``k = min(T, backprop_depth)`` iterations
    with gradients after ``n = T - k`` without. A pure function of ``seed``, so a resumed run (which
    derives the seed from its data position, i.e. step, micro-batch and rank) draws the same depths."""
    gen = torch.Generator().manual_seed(seed)
    total = torch.poisson(torch.full((batch_size,), float(mean_recurrence)), generator=gen).long().clamp(min=1)
    k = total.clamp(max=backprop_depth)
    return total - k, k


def expected_depths(mean_recurrence: int, backprop_depth: int, terms: int = 200) -> tuple[float, float]:
    """``(E[T], E[k])`` of :func:`sample_depths` (for FLOP accounting)."""
    log_p = [-mean_recurrence + t * math.log(mean_recurrence) - math.lgamma(t + 1) for t in range(terms)]
    p = [math.exp(v) for v in log_p]
    e_t = sum(pi * max(1, t) for t, pi in enumerate(p))
    e_k = sum(pi * min(max(1, t), backprop_depth) for t, pi in enumerate(p))
    return e_t, e_k


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


@dataclass
class ParcaeOutput(CausalLMOutputWithPast):
    """Adds ``diagnostics``: largest A_bar entry, mean final-state norm, relative change of the state
    over the last iteration ``|h_T - h_{T-1}| / |h_T|`` (mean over tokens), and mean depth."""

    diagnostics: dict | None = None


class ParcaePreTrainedModel(PreTrainedModel):
    config_class = ParcaeConfig
    base_model_prefix = "parcae"
    supports_gradient_checkpointing = False
    _no_split_modules = ["LlamaDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DiagonalInjection):
            module.reset_parameters()


class ParcaeForCausalLM(ParcaePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}

    def __init__(self, config: ParcaeConfig):
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d, config.pad_token_id)
        self.prelude = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.n_prelude))
        self.prelude_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.injection = build_injection(config.injection_type, d)
        self.core = nn.ModuleList(LlamaDecoderLayer(config, config.n_prelude + j) for j in range(config.n_core))
        self.coda = nn.ModuleList(LlamaDecoderLayer(config, 0) for _ in range(config.n_coda))
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def spectral_radius(self) -> torch.Tensor:
        return self.injection.spectral_radius()

    @staticmethod
    def _run(block: nn.Module, slot: int, h: torch.Tensor, **kw) -> torch.Tensor:
        block.self_attn.layer_idx = slot  # each application of a shared block owns a KV-cache slot
        return block(h, **kw)

    def forward(  # noqa: PLR0912, PLR0915 prelude, recurrence, coda and head, in order
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_steps: int | None = None,
        depths: tuple[torch.Tensor, torch.Tensor] | None = None,
        return_diagnostics: bool | None = None,
        past_key_values=None,
        **kwargs,
    ) -> ParcaeOutput:
        """``num_steps``: the depth for every sequence (default ``config.recurrence``, all with
        gradients); ``depths``: per-sequence ``(n, k)`` no-grad / grad iterations (training);
        ``return_diagnostics`` (default: in training) fills ``output.diagnostics``."""
        cfg = self.config
        cache = cache if cache is not None else past_key_values  # generate() still passes the old name
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B = x.shape[0]
        if depths is None:
            n = torch.zeros(B, dtype=torch.long)
            k = torch.full((B,), num_steps or cfg.recurrence, dtype=torch.long)
        else:
            n, k = (t.to("cpu", torch.long) for t in depths)
        uniform = bool((n == n[0]).all() and (k == k[0]).all())
        use_cache = cfg.use_cache if use_cache is None else use_cache
        if use_cache and cache is None and depths is None and not self.training:
            cache = DynamicCache(config=cfg)
        if cache is not None:
            if not uniform:
                raise ValueError("a KV cache needs the same depth for every sequence")
            needed = cfg.cache_slots(int(n[0] + k[0]))
            while len(cache.layers) < needed:  # a deeper num_steps than the config the cache was made for
                cache.layers.append(DynamicLayer())
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + x.shape[1], device=x.device)[None]
        mask = create_causal_mask(
            config=cfg, inputs_embeds=x, attention_mask=attention_mask, cache=cache, position_ids=position_ids
        )
        kw = dict(
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=self.rotary_emb(x, position_ids=position_ids),
            **kwargs,
        )

        ### Prelude: e, the injected input
        for j, block in enumerate(self.prelude):
            x = self._run(block, j, x, **kw)
        e = self.prelude_norm(x)

        ### Recurrence: n_i iterations without gradients, then k_i with
        h = torch.zeros_like(e)
        h_prev = h
        injected = self.injection.prepare(e)  # what does not change across iterations, computed once
        iteration = 0
        for phase_steps, grad in ((n, False), (k, True)):
            with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
                for t in range(int(phase_steps.max())):
                    u = self.injection(h, injected)
                    for j, block in enumerate(self.core):
                        u = self._run(block, cfg.n_prelude + iteration * cfg.n_core + j, u, **kw)
                    if uniform:
                        h_prev, h = h, u
                    else:  # sequences past their depth keep their state (and their last change)
                        active = (t < phase_steps).to(h.device)[:, None, None]
                        h_prev, h = torch.where(active, h, h_prev), torch.where(active, u, h)
                    iteration += 1

        ### Coda and head
        x = h
        total = int((n + k).max())
        for j, block in enumerate(self.coda):
            x = self._run(block, cfg.cache_slots(total) - cfg.n_coda + j, x, **kw)
        x = self.norm(x)
        logits = self.lm_head(slice_logits_to_keep(x, logits_to_keep))

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=cfg.vocab_size, **kwargs)
        diagnostics = None
        if self.training if return_diagnostics is None else return_diagnostics:
            h_norm = h.detach().float().norm(dim=-1)
            diagnostics = {
                "max_a_bar": float(self.spectral_radius().detach()),
                "state_norm": float(h_norm.mean()),
                "rel_change": float(((h - h_prev).detach().float().norm(dim=-1) / h_norm.clamp(min=1e-6)).mean()),
                "mean_depth": float((n + k).float().mean()),
            }
        return ParcaeOutput(loss=loss, logits=logits, cache=cache, diagnostics=diagnostics)

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Matmul FLOPs per token (PaLM accounting, see :mod:`distill.models`) at the training depth
        distribution (training) or at ``config.recurrence`` (inference): every iteration runs
        forward, only the gradient-carrying ones run backward (2x forward)."""
        cfg = self.config
        from distill.base.flops import matmul_params

        per_block = sum(p.numel() for p in self.core[0].parameters() if p.dim() >= 2)
        attn_block = 2 * cfg.num_attention_heads * cfg.head_dim * seq_len
        once = matmul_params(self) - per_block * cfg.n_core
        once_blocks = cfg.n_prelude + cfg.n_coda
        if training:
            e_t, e_k = expected_depths(cfg.mean_recurrence, cfg.mean_backprop_depth)
            core_fwd, core_bwd = e_t * cfg.n_core, e_k * cfg.n_core
            return (
                6 * once
                + 6 * once_blocks * attn_block / 2
                + (2 * core_fwd + 4 * core_bwd) * per_block
                + (core_fwd + 2 * core_bwd) * attn_block
            )
        core = cfg.recurrence * cfg.n_core
        return 2 * once + once_blocks * attn_block + 2 * core * per_block + core * attn_block
