"""DFlash: a block-diffusion drafter. One forward drafts a whole block in parallel.

On the shared core (:mod:`drafters.core`): a block ``[x[a], MASK x (K-1)]`` attends bidirectionally
inside itself and to the target's features before the anchor; position ``k`` predicts ``x[a+k]``.
The loss is cross-entropy on the sequence's tokens, weighted per block position

    L = sum_k w_k CE(q_k, x[a+k]) / sum_k w_k,    w_k = exp(-(k-1) / gamma),   k = 1..K-1

so that early positions, whose acceptance gates all later ones, weigh most (gamma = 7 for K = 16 in
the reference). ``block_attention: causal`` turns the same model into a JetSpec-style causal drafter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .core import BlockDrafter, DrafterConfig, DrafterOutput, gather_positions, position_weights, sample_anchors, weighted_mean


class DFlashConfig(DrafterConfig):
    model_type = "draftsmith_dflash"

    def __init__(self, loss_gamma: float = 4.0, **kwargs):
        self.loss_gamma = loss_gamma
        super().__init__(**kwargs)


class DFlashDrafter(BlockDrafter):
    config_class = DFlashConfig

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor,
                anchors: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None) -> DrafterOutput:
        cfg = self.config
        if anchors is None:
            anchors = sample_anchors(input_ids.shape[1], cfg.block_size, cfg.num_anchors, input_ids.shape[0], input_ids.device)
        hidden = self.block_hidden(aux, gather_positions(input_ids, anchors), anchors)
        logits = self.lm_head(hidden[:, :, 1:])
        labels, target_logits, scored = self.block_targets(input_ids, last, anchors, loss_mask)
        ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none").view_as(labels)
        loss = weighted_mean(ce, position_weights(cfg.block_size - 1, cfg.loss_gamma, ce.device), scored)
        return DrafterOutput(loss=loss, draft_logits=logits, target_logits=target_logits, scored=scored,
                             logs={"ce": loss.detach()})
