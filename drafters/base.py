"""What every drafter (DFlash, DSpark, EAGLE-3) shares: its config (:class:`DrafterConfig`), its
output (:class:`DrafterOutput`) and its model base (:class:`DrafterBase`: the target's frozen
embeddings and LM head, weight init, loading its own weights), and the default draft choice (greedy).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.utils import ModelOutput

from distill.base.features import LAYER_ID_CONVENTION

from .layers import RMSNorm
from .target_io import TARGET_IO, _as_input_of
from .vocab import restrict_vocab


class DrafterConfig(PretrainedConfig):
    """Fields every drafter records: its shape, the target it serves, how it reads the target, its loss."""

    default_loss_terms = {"ce": 1.0}
    #: what a builder must know of a kind without knowing its insides: the recipe keys (``drafter:``
    #: section) its config takes beside the common ones, how many target layers it reads (None: the
    #: recipe says), and whether it needs the tokenizer's mask token (block drafters fill blocks with it)
    recipe_keys: tuple[str, ...] = ()
    fixed_target_layers: int | None = None
    needs_mask_token = True

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 256,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int = 512,
        rms_norm_eps: float = 1e-6,
        rope_theta: float | None = None,
        rope_parameters: dict | None = None,
        max_position_embeddings: int = 32768,
        hidden_act: str = "silu",
        target_hidden_size: int | None = None,
        target_layer_ids: list[int] | None = None,
        layer_id_convention: str = LAYER_ID_CONVENTION,
        target_name_or_path: str | None = None,
        mask_token_id: int | None = None,
        block_size: int = 8,
        block_attention: str = "bidirectional",
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        sliding_block_attention: str = "causal",
        num_anchors: int = 16,
        initializer_range: float = 0.02,
        qk_norm: bool = False,
        loss_terms: dict[str, float] | None = None,
        position_weighting: str = "exp",
        loss_gamma: float = 4.0,
        loss_chunk: int | None = None,
        mask_implementation: str = "auto",
        draft_vocab_size: int | None = None,
        **kwargs,
    ):
        for key, value in (("block_attention", block_attention), ("sliding_block_attention", sliding_block_attention)):
            if value not in ("bidirectional", "causal"):
                raise ValueError(f"{key} must be 'bidirectional' or 'causal', got {value!r}")
        if layer_types is not None:
            if len(layer_types) != num_hidden_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
                raise ValueError(
                    f"layer_types must name each of the {num_hidden_layers} layers 'full_attention' or "
                    f"'sliding_attention', got {layer_types}"
                )
            if "sliding_attention" in layer_types and not (sliding_window and sliding_window > 0):
                raise ValueError(f"sliding_attention layers need a sliding_window > 0, got {sliding_window}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        # transformers' RoPE settings (type, theta, scaling); configs saved before they were recorded carry
        # only rope_theta, which is the default RoPE at that theta
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": rope_theta or 10000.0})
        self.rope_theta = self.rope_parameters["rope_theta"]
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.target_hidden_size = target_hidden_size or hidden_size
        self.target_layer_ids = list(target_layer_ids or [])
        self.layer_id_convention = layer_id_convention
        self.target_name_or_path = target_name_or_path
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        # what a block's queries see, per layer: full_attention layers the whole context before the anchor
        # and their block as block_attention says; sliding_attention layers the sliding_window positions
        # before the anchor and their block as sliding_block_attention says (speculators' DFlash layers)
        self.block_attention = block_attention
        self.layer_types = list(layer_types) if layer_types is not None else None
        self.sliding_window = sliding_window
        self.sliding_block_attention = sliding_block_attention
        self.num_anchors = num_anchors
        self.initializer_range = initializer_range
        self.qk_norm = qk_norm
        # the training loss (:mod:`drafters.losses`): term -> weight, and how block positions are weighted
        self.loss_terms = dict(loss_terms if loss_terms is not None else self.default_loss_terms)
        self.position_weighting = position_weighting
        self.loss_gamma = loss_gamma
        self.loss_chunk = loss_chunk  # positions whose vocabulary-sized logits the loss holds at once (None: all)
        if mask_implementation not in ("auto", "dense", "flex"):
            raise ValueError(f"mask_implementation must be 'auto', 'dense' or 'flex', got {mask_implementation!r}")
        self.mask_implementation = mask_implementation  # the blocks' mask: auto = flex for > 128 block queries on CUDA
        self.draft_vocab_size = (
            draft_vocab_size  # drafts only from these many target tokens (drafters.vocab); None: all
        )
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


@dataclass
class DrafterOutput(ModelOutput):
    """``loss`` for training; per drafted position [B, N, K-1] (EAGLE-3: [B, chains, steps]), as
    decoding would draft them: ``draft_tokens`` (the drafter's argmax), ``target_tokens`` (the
    target's), ``accept`` (``alpha = 1 - TV``), ``scored`` (the label is scored: ``loss_mask``);
    ``draft_logits`` / ``target_logits`` [..., V] unless the loss ran in chunks (``config.loss_chunk``);
    ``logs`` extra scalars."""

    loss: torch.Tensor | None = None
    draft_tokens: torch.Tensor | None = None
    target_tokens: torch.Tensor | None = None
    accept: torch.Tensor | None = None
    draft_logits: torch.Tensor | None = None
    target_logits: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    scored: torch.Tensor | None = None
    logs: dict | None = None


class DrafterBase(PreTrainedModel):
    """Frozen target embeddings and LM head, weight init, and copying them in from a target."""

    base_model_prefix = "drafter"
    supports_gradient_checkpointing = False
    _no_split_modules = ["InjectedLayer"]
    _keys_to_ignore_on_load_missing = [r"^embed_tokens\.weight$", r"^lm_head\.weight$"]  # shipped without them
    _supports_sdpa = True  # config._attn_implementation: sdpa by default, eager on request (see DraftAttention)
    _supports_flex_attn = True
    # set by the subclasses and _make_target_io (nn.Module's __getattr__ would type them Tensor | Module)
    fc: nn.Linear  # the target's concatenated features -> the drafter's width
    lm_head: nn.Linear  # the target's head, or a draft-vocabulary head (drafters.vocab: Linear subclasses)
    draft_vocab: torch.Tensor  # a buffer, when config.draft_vocab_size is set

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, LlamaRotaryEmbedding):  # its inverse frequencies, recomputed (a buffer not saved)
            super()._init_weights(module)

    def _make_target_io(self, cfg) -> None:
        # the target's raw table: a target that scales its embeddings (Gemma, by sqrt(hidden)) does so in its
        # own forward in vLLM and SGLang, whose drafters read the shared table unscaled, as this one does
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "draft_vocab_size", None):  # a saved draft vocabulary (drafters.vocab): its ids load into this
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size))
        self.freeze_target_io()

    def target_features(self, aux: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's features ``aux`` and last hidden states ``last`` in the dtypes of the weights that
        read them (``fc``'s, the LM head's), where they differ and autocast is off: a bf16 target's features
        feed an fp32 drafter (``target.dtype: bfloat16``, ``mixed_precision: no``), an fp32 target's (or a
        feature cache's, which batches read in fp32) feed a drafter cast whole to bf16 (DeepSpeed's ``bf16``).
        Under autocast they pass as they are (autocast casts a Linear's inputs itself); tensors already in
        their weights' dtype are returned as they are."""
        return _as_input_of(aux, self.fc.weight), _as_input_of(last, self.lm_head.weight)

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits over the whole vocabulary from its last hidden state (the frozen head is
        the target's; a draft vocabulary restricts only what the drafter proposes)."""
        return F.linear(hidden, self.lm_head.weight)

    def draft_vocab_ids(self) -> torch.Tensor | None:
        """The draft vocabulary's target ids, or None for the whole vocabulary."""
        return self.draft_vocab if getattr(self.config, "draft_vocab_size", None) else None

    def _restrict_to_draft_vocab(self) -> DrafterBase:
        """Re-restrict the heads to the saved draft vocabulary (if any) after their weights changed."""
        if getattr(self.config, "draft_vocab_size", None):
            restrict_vocab(self, self.draft_vocab)
        return self

    def freeze_target_io(self) -> None:
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        model = super().from_pretrained(*args, **kwargs)
        model.freeze_target_io()  # loading builds fresh Parameters, which would be trainable
        return model._restrict_to_draft_vocab()

    def _target_io(self, target) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's embedding and LM head weights, checked against the drafter's shapes."""
        emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        if emb.shape != self.embed_tokens.weight.shape or head.shape != self.lm_head.weight.shape:
            raise ValueError(
                f"drafter vocab/hidden {tuple(self.embed_tokens.weight.shape)} does not match the "
                f"target's embeddings {tuple(emb.shape)}: build the drafter with the target's sizes"
            )
        return emb, head

    @torch.no_grad()
    def load_own_weights(self, folder: str | Path) -> DrafterBase:
        """This drafter's weights (all but the target's embeddings and head, which stay as they are)
        from a saved drafter folder; every one must be there, with its shape."""
        from safetensors.torch import load_file

        state = {}
        for file in sorted(Path(folder).glob("*.safetensors")):
            state.update(load_file(file))
        state = {k: v for k, v in state.items() if k not in TARGET_IO}
        own = {k: v for k, v in self.state_dict().items() if k not in TARGET_IO}
        wrong = sorted(set(own) ^ set(state)) + [k for k in own if k in state and own[k].shape != state[k].shape]
        if wrong:
            raise ValueError(
                f"{folder}: its weights do not fit this drafter ({', '.join(wrong[:4])}"
                f"{' ...' if len(wrong) > 4 else ''} missing, unexpected or of another shape)"
            )
        self.load_state_dict(state, strict=False)
        return self

    @torch.no_grad()
    def copy_target_io(self, target) -> DrafterBase:
        """Copy (and keep frozen) the target's token embeddings and LM head."""
        emb, head = self._target_io(target)
        self.embed_tokens.weight.copy_(emb)
        self.lm_head.weight.copy_(head)
        return self._restrict_to_draft_vocab()

    def share_target_io(self, target) -> DrafterBase:
        """Use the target's own embedding and LM head tensors (no copy), as serving engines do: the
        drafter reads the very bytes the target's head just read, still in cache, and holds no second
        copy. Falls back to :meth:`copy_target_io` when dtype or device differ."""
        emb, head = self._target_io(target)
        mine = self.embed_tokens.weight
        if any((w.dtype, w.device) != (mine.dtype, mine.device) for w in (emb, head)):
            return self.copy_target_io(target)
        self.embed_tokens.weight, self.lm_head.weight = emb, head  # the target's Parameters, left as they are
        return self._restrict_to_draft_vocab()


def argmax_choice(logits: torch.Tensor) -> torch.Tensor:
    """The default way a drafter picks a draft token: greedy."""
    return logits.argmax(-1)
