"""DSpark: the DFlash backbone plus a low-rank Markov head and a confidence head.

Semi-autoregressive drafting. The backbone drafts hidden states ``h_k`` for the whole block in
parallel; the **Markov head** adds a dependency on the previous token,

    logits_k = lm_head(h_k) + W_out W_in[x_{k-1}],      W_in: vocab -> r,  W_out: r -> vocab (zero-init)

so drafting position ``k`` needs the token drafted at ``k-1`` (a cheap sequential pass over the head
only; training uses the true previous token). The **confidence head** predicts, from ``h_k`` and the
same previous-token code, the probability that position ``k`` is accepted:

    c_k = sigmoid(w . [h_k ; W_in[x_{k-1}]]),   trained towards  1 - TV(p_k, q_k) = 1 - 0.5 ||p_k - q_k||_1

(``p`` the target's distribution, ``q`` the drafter's; ``1 - TV`` is exactly the acceptance probability
of speculative sampling at that position). After training, per-position temperatures ``T_k`` fitted on
held-out blocks against greedy acceptance (DSpark's temporal temperature scaling), with offsets ``b_k``
too, make ``sigmoid(z_k / T_k + b_k)`` calibrated (``recipes/calibrate_confidence.py``). ``c_k`` depends only on the prefix, so stopping a draft
where it is low keeps decoding lossless. Loss, with ``w_k = exp(-(k-1)/gamma)``:

    L = a_ce * CE + a_tv * TV + a_conf * BCE(c_k, 1 - TV_k)     (reference: 0.1, 0.9, 1.0, gamma = 4)

(the first two are ``loss_terms`` (recipe key ``drafter.loss``), any mix of :mod:`drafters.losses`, with its position weighting).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import DrafterConfig, DrafterOutput, argmax_choice
from .block import BlockDrafter
from .losses import weighted_mean
from .masks import gather_positions
from .vocab import CandidateHead


class DSparkConfig(DrafterConfig):
    model_type = "draftsmith_dspark"
    recipe_keys = ("markov_rank", "confidence_weight")
    default_loss_terms = {"ce": 0.1, "tv": 0.9}  # the reference's a_ce, a_tv

    def __init__(
        self,
        markov_rank: int = 64,
        confidence_weight: float = 1.0,
        confidence_temperature: list[float] | None = None,
        confidence_offset: list[float] | None = None,
        **kwargs,
    ):
        self.markov_rank = markov_rank
        self.confidence_weight = confidence_weight
        # per block position 1..K-1, fitted on held-out blocks after training (recipes/calibrate_confidence.py)
        self.confidence_temperature = confidence_temperature
        self.confidence_offset = confidence_offset
        super().__init__(**kwargs)


class DSparkDrafter(BlockDrafter):
    conditional_drafts = True  # the Markov head reads the previous draft
    config_class = DSparkConfig

    def build_heads(self, config: DSparkConfig) -> None:
        self.markov_in = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_out = nn.Linear(config.markov_rank, config.vocab_size, bias=False)
        self.confidence = nn.Linear(config.hidden_size + config.markov_rank, 1)

    def _init_weights(self, module):
        super()._init_weights(module)
        markov_out = getattr(self, "markov_out", None)
        if markov_out is not None and module is markov_out:
            nn.init.zeros_(markov_out.weight)  # start as plain DFlash

    def markov_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Logits for block positions with hidden ``hidden`` after ``prev_tokens``."""
        return self.lm_head(hidden) + self.markov_out(self.markov_in(prev_tokens))

    def confidence_logits(self, hidden: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """Confidence logits [..., K-1] from the positions' hidden states and previous-token codes."""
        return self.confidence(torch.cat([hidden, code], dim=-1)).squeeze(-1)

    def heads(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Logits and confidence logits for block positions with hidden ``hidden`` after ``prev_tokens``
        (teacher forcing; :meth:`propose` runs the same heads position by position)."""
        return self.markov_logits(hidden, prev_tokens), self.confidence_logits(hidden, self.markov_in(prev_tokens))

    def propose(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, choose=None):
        """Decode-time drafting over block positions 1..K-1: each uses the previous *drafted* token.
        Returns tokens, logits and confidence (probabilities) [B, N, K-1]."""
        choose = choose or argmax_choice
        # a per-step vocabulary (drafters.vocab.CandidateHead) picks each position's candidates with its Markov
        # term added, so the head runs position by position; otherwise once per block (all K rows: MKL is
        # faster at 8 than at 7)
        per_step = isinstance(self.lm_head, CandidateHead)
        base = None if per_step else self.lm_head(hidden)[:, :, 1:]
        prev, tokens, all_logits, codes = anchor_tokens, [], [], []
        for k in range(1, hidden.shape[2]):  # only the Markov code of the previous draft is sequential
            code = self.markov_in(prev)
            term = self.markov_out(code)
            logits = self.lm_head(hidden[:, :, k], shift=term) if base is None else base[:, :, k - 1] + term
            prev = choose(logits)
            tokens.append(prev)
            all_logits.append(logits)
            codes.append(code)
        conf = self.confidence_logits(hidden[:, :, 1:], torch.stack(codes, dim=2))  # heads(), batched
        return torch.stack(tokens, dim=2), torch.stack(all_logits, dim=2), self.calibrated(conf)

    def calibrated(self, conf_logits: torch.Tensor) -> torch.Tensor:
        """Confidence probabilities from confidence logits [..., K-1]: ``sigmoid(z_k / T_k + b_k)`` with
        the per-position temperatures (and offsets) fitted on held-out blocks, or ``sigmoid(z_k)``
        before any are fitted. A monotone map per position: lossless wherever used."""
        cfg = self.config
        if cfg.confidence_temperature is not None:
            conf_logits = conf_logits / conf_logits.new_tensor(cfg.confidence_temperature)
        if cfg.confidence_offset is not None:
            conf_logits = conf_logits + conf_logits.new_tensor(cfg.confidence_offset)
        return conf_logits.sigmoid()

    def forward(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        last: torch.Tensor,
        anchors: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> DrafterOutput:
        cfg = self.config
        K = cfg.block_size
        aux, last = self.target_features(aux, last)
        anchors = self.anchors_for(input_ids, anchors, loss_mask)
        anchor_tokens = gather_positions(input_ids, anchors)
        hidden = self.block_hidden(aux, anchor_tokens, anchors)
        targets = self.block_targets(input_ids, last, anchors, loss_mask)
        prev = gather_positions(input_ids, anchors[:, :, None] + torch.arange(K - 1, device=anchors.device))
        h = hidden[:, :, 1:]
        # teacher forcing: the Markov head reads the data's previous token
        sc = self.block_scores(self.markov_logits, (h, prev), targets)
        scored = targets[2]
        conf_logits = self.confidence_logits(h, self.markov_in(prev))
        bce = F.binary_cross_entropy_with_logits(
            conf_logits.float(), sc.accept, reduction="none"
        )  # c_k predicts 1 - TV
        parts = {**sc.parts, "confidence_bce": weighted_mean(bce, sc.weights, scored)}
        loss = sc.loss + cfg.confidence_weight * parts["confidence_bce"]

        if self.training:
            confidence = conf_logits.sigmoid()
        else:  # what decoding would actually draft: each position after the previous *drafted* token
            sc = self.block_scores(lambda h, a: self.propose(h[None], a[None])[1][0], (hidden, anchor_tokens), targets)
            drafted_prev = torch.cat([anchor_tokens[..., None], sc.draft_tokens[..., :-1]], dim=-1)
            confidence = self.calibrated(self.confidence_logits(h, self.markov_in(drafted_prev)))
        return DrafterOutput(
            loss=loss,
            draft_tokens=sc.draft_tokens,
            target_tokens=sc.target_tokens,
            accept=sc.accept,
            draft_logits=sc.draft_logits,
            target_logits=sc.target_logits,
            confidence=confidence,
            scored=scored,
            logs={k: v.detach() for k, v in parts.items()},
        )
