"""DFlash: a block-diffusion drafter. One forward drafts a whole block in parallel.

On the shared block backbone (:mod:`drafters.block`): a block ``[x[a], MASK x (K-1)]`` attends bidirectionally
inside itself and to the target's features before the anchor; position ``k`` predicts ``x[a+k]``.
The loss is any mix of :mod:`drafters.losses` terms over block positions ``k = 1..K-1``,

    L = sum_t c_t sum_k w_k l_t(k) / sum_k w_k,     default: CE on the data's tokens, w_k = exp(-(k-1) / gamma)

with ``w_k`` a fixed decay or D-PACE's detached probability of reaching position k, so that early
positions, whose acceptance gates all later ones, weigh most (gamma = 7 for K = 16 in the reference).
``block_attention: causal`` turns the same model into a JetSpec-style causal drafter.
"""

from __future__ import annotations

import torch

from .base import DrafterConfig, DrafterOutput
from .block import BlockDrafter
from .masks import gather_positions


class DFlashConfig(DrafterConfig):
    model_type = "draftsmith_dflash"

    def __init__(self, **kwargs):  # transformers' config machinery needs each subclass's own __init__
        super().__init__(**kwargs)


class DFlashDrafter(BlockDrafter):
    config_class = DFlashConfig

    def forward(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        last: torch.Tensor,
        anchors: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> DrafterOutput:
        aux, last = self.target_features(aux, last)
        anchors = self.anchors_for(input_ids, anchors, loss_mask)
        hidden = self.block_hidden(aux, gather_positions(input_ids, anchors), anchors)
        targets = self.block_targets(input_ids, last, anchors, loss_mask)
        sc = self.block_scores(self.lm_head, (hidden[:, :, 1:],), targets)
        return DrafterOutput(
            loss=sc.loss,
            draft_tokens=sc.draft_tokens,
            target_tokens=sc.target_tokens,
            accept=sc.accept,
            draft_logits=sc.draft_logits,
            target_logits=sc.target_logits,
            scored=targets[2],
            logs={k: v.detach() for k, v in sc.parts.items()},
        )
