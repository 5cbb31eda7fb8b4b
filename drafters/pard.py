"""PARD: a causal LM that drafts ``K`` tokens in one forward, from ``K - 1`` appended mask tokens.

PARD (parallel draft, An et al., ICLR 2026) adapts a small causal LM in the target's tokenizer: after
the last real token ``x_a`` at position ``a``, append ``K - 1`` mask tokens ``m`` at positions
``a + 1 .. a + K - 1``; one causal forward then gives

    draft 1      from the output at ``x_a``       (the LM's own next-token prediction of ``x_{a+1}``)
    draft 1 + i  from the output at mask ``i``    (a prediction of ``x_{a+1+i}``, ``i = 1 .. K-1``)

The mask outputs see the real tokens up to ``x_a`` and the masks before them, never a drafted token, so
every draft's distribution is fixed before any is drawn (like DFlash's block, unlike an autoregressive
drafter): the loop verifies them as a block (:class:`serve_eval.proposers.PardProposer`) and stays
lossless at any temperature. It needs no target features: one PARD drafter serves every target that
shares the tokenizer.

**Training** (:func:`mask_blocks`). A window ``x_0 .. x_{L-1}`` is read as usual (every position
predicts the next token) and, appended after it, mask blocks anchored at random positions ``a``: mask
``i`` of a block sits at position id ``a + i``, attends to ``x_0 .. x_a`` and to the masks ``1 .. i``
of its own block, and is trained towards ``x_{a+1+i}`` (or, when distilling, the target's distribution
at position ``a + i``, which predicts that token). **Conditional drop** (PARD's cost saving): a block
keeps mask ``i + 1`` only if it kept mask ``i``, with probability ``keep``, so a block has ``n`` masks
with probability ``keep^(n-1) (1 - keep)`` (``n < K - 1``): later masks, whose drafts matter less (they
count only when every earlier one is accepted), cost fewer tokens. The appended tokens never change
what the window's own positions see (they attend to the window only), so the window's loss is the
plain LM loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MaskBlocks:
    """A window batch with mask blocks appended: ``input_ids`` / ``position_ids`` [B, L + M] and the
    boolean attention mask [B, 1, L + M, L + M] (True: may attend); for the ``M`` appended slots,
    ``source`` [B, M] is the window position whose output distribution the slot learns (``a + i``,
    so its label is the window's label there) and ``valid`` [B, M] marks real slots (not padding)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    source: torch.Tensor
    valid: torch.Tensor


def block_lengths(count: int, masks: int, keep: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Masks kept per block (conditional drop): ``1 + #{successes before the first failure}``, at most ``masks``."""
    draws = torch.rand(count, max(masks - 1, 0), generator=generator) < keep
    return 1 + draws.int().cumprod(-1).sum(-1)


def mask_blocks(
    inputs: torch.Tensor,
    scored: torch.Tensor,
    mask_token_id: int,
    draft_tokens: int,
    anchors: int,
    keep: float,
    generator: torch.Generator | None = None,
) -> MaskBlocks:
    """Append PARD mask blocks (module doc) to ``inputs`` [B, L] whose next-token labels are scored
    where ``scored`` [B, L]. Anchors are drawn among positions ``a`` whose first masked label
    (``a + 1``) is scored and in the window; a block stops at the window's end."""
    B, L = inputs.shape
    masks = draft_tokens - 1
    device = inputs.device
    rows = []
    for b in range(B):
        allowed = scored[b, 1:].nonzero().view(-1).cpu()  # a + 1 scored, a + 1 <= L - 1
        chosen = allowed[torch.randperm(len(allowed), generator=generator)[:anchors]].sort().values
        lengths = block_lengths(len(chosen), masks, keep, generator)
        source = (
            torch.cat([a + torch.arange(1, int(n) + 1) for a, n in zip(chosen.tolist(), lengths.tolist())])
            if len(chosen)
            else torch.zeros(0, dtype=torch.long)
        )
        block = torch.cat([torch.full((int(n),), k) for k, n in enumerate(lengths.tolist())]) if len(chosen) else source
        keepable = source <= L - 1
        rows.append((source[keepable], block[keepable]))
    M = max([1] + [len(s) for s, _ in rows])
    ids = torch.full((B, L + M), mask_token_id, dtype=inputs.dtype, device=device)
    ids[:, :L] = inputs
    pos = torch.zeros(B, L + M, dtype=torch.long)
    pos[:, :L] = torch.arange(L)
    attend = torch.zeros(B, L + M, L + M, dtype=torch.bool)
    attend[:, :L, :L] = torch.ones(L, L, dtype=torch.bool).tril()
    source = torch.zeros(B, M, dtype=torch.long)
    valid = torch.zeros(B, M, dtype=torch.bool)
    for b, (src, blk) in enumerate(rows):
        n = len(src)
        source[b, :n], valid[b, :n] = src, True
        pos[b, L : L + n] = src
        anchor = src - (torch.arange(n) - first_of_block(blk)) - 1  # a = source - i, i = 1.. within the block
        attend[b, L : L + n, :L] = torch.arange(L)[None] <= anchor[:, None]
        same = (blk[:, None] == blk[None]) & (torch.arange(n)[None] <= torch.arange(n)[:, None])
        attend[b, L : L + n, L : L + n] = same
        attend[b, L + n :, L + n :] = torch.eye(M - n, dtype=torch.bool)  # padding sees itself only
        pos[b, L + n :] = 0
    return MaskBlocks(ids, pos.to(device), attend[:, None].to(device), source.to(device), valid.to(device))


def first_of_block(block: torch.Tensor) -> torch.Tensor:
    """For each slot, the index of its block's first slot (slots of a block are contiguous)."""
    start = torch.ones_like(block, dtype=torch.bool)
    start[1:] = block[1:] != block[:-1]
    return torch.cummax(torch.where(start, torch.arange(len(block)), 0), 0).values
