"""EAGLE-3: the autoregressive baseline. One decoder layer fed a fusion of low, mid and high target layers.

Step 0 at position ``t``: the fused target feature ``g0[t] = fc([f_low ; f_mid ; f_high][t])`` and the
embedding of the next token ``x[t+1]`` are concatenated (2H) and run through one decoder layer; its
output ``g[t]`` (normed, through the target's LM head) predicts ``x[t+2]``. Drafting step ``s`` feeds the
layer its *own* previous output in place of the target feature, so the layer must be trained on its
own outputs: **training-time test** unrolls ``S`` steps, where step ``s`` at position ``p`` belongs to
the draft chain that started at ``t = p - s`` and sees exactly what decoding would show it:

    keys of step 0 (target features) at positions <= t,  and the key of step j at position t + j,
    for j = 1..s (its own earlier drafts).

Inputs: ``hidden_in_s[p] = g_{s-1}[p-1]`` and token ``x[p+1]`` (teacher-forced tokens, own hiddens).
Loss: soft cross-entropy against the target's distribution for the same token, averaged over steps.
Step ``s`` corresponds to block position ``k = s + 1`` of a block drafter anchored at ``t + 1``, which
makes the simulated acceptance of both families directly comparable.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import DrafterBase, DrafterConfig, DrafterOutput, argmax_choice
from .cache import ContextCache
from .layers import MLP, DraftAttention, RMSNorm, rms, store_rows
from .losses import block_scores


class Eagle3Config(DrafterConfig):
    model_type = "draftsmith_eagle3"
    fixed_target_layers = 3  # low, middle and high features, fused by its fc
    needs_mask_token = False

    def __init__(self, ttt_steps: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.ttt_steps = ttt_steps or self.block_size - 1


class Eagle3Layer(nn.Module):
    """A decoder layer over ``[embedding ; hidden]`` (2H in), with the residual on the hidden half."""

    def __init__(self, cfg):
        super().__init__()
        self.embed_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DraftAttention(cfg, 2 * cfg.hidden_size)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def layer_input(self, emb, hidden, lean: bool = False):
        """``[embed_norm(emb) ; hidden_norm(hidden)]``; ``lean``: decoding's fused norms (drafters.layers.rms)."""
        return torch.cat([rms(self.embed_norm, emb, lean), rms(self.hidden_norm, hidden, lean)], dim=-1)


def ttt_mask(step: int, seq_len: int, device=None) -> torch.Tensor:
    """Boolean [T, (step+1)*T]: query p of ``step`` sees step-0 keys q <= p - step and step-j key q = p - step + j."""
    p = torch.arange(seq_len, device=device)[:, None]
    q = torch.arange(seq_len, device=device)[None, :]
    blocks = [q <= p - step] + [q == p - step + j for j in range(1, step + 1)]
    mask = torch.cat(blocks, dim=1)
    mask[:, 0] |= ~mask.any(dim=1)  # rows with no valid chain (p < step) attend somewhere; their loss is masked
    return mask


class Eagle3Drafter(DrafterBase):
    config_class = Eagle3Config
    _no_split_modules = ["Eagle3Layer"]  # what FSDP's transformer-based policy wraps

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        if len(config.target_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 target layers (low, mid, high); got {config.target_layer_ids}")
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.layer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._make_target_io(config)
        self.post_init()

    def forward(
        self, input_ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> DrafterOutput:
        cfg = self.config
        B, T = input_ids.shape
        S = cfg.ttt_steps
        dev = input_ids.device
        aux, last = self.target_features(aux, last)
        # token x[p+1] at position p; the last position has no next token and never gets a loss
        next_tokens = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
        emb = self.embed_tokens(next_tokens)
        pos = torch.arange(T, device=dev)[None].expand(B, -1)
        # the target's distribution for x[p+2] is read at position p+1: its logits once, or (chunked) its
        # hidden state, whose logits each chunk recomputes
        target_last = torch.cat([last[:, 1:], last[:, -1:]], dim=1)[:, :, None]
        chunk = getattr(cfg, "loss_chunk", None)
        if chunk is None:
            with torch.no_grad():
                target_in, target_fn = self.target_logits(target_last), (lambda logits: logits)
        else:
            target_in, target_fn = target_last, self.target_logits
        # the token predicted at position p is x[p+2]: is it scored?
        if loss_mask is None:
            scored_next = torch.ones(B, T, dtype=torch.bool, device=dev)
        else:
            scored_next = torch.cat([loss_mask[:, 2:], loss_mask.new_zeros(B, 2)], dim=1).bool()

        hidden_in = self.fc(aux)
        keys, values = [], []
        losses, steps = [], []
        p_idx = torch.arange(T, device=dev)
        starts = torch.arange(T - 2 - (S - 1), device=dev)  # chain t, depth s sits at position t + s
        for s in range(S):
            x = self.layer.layer_input(emb, hidden_in)
            k, v = self.layer.attn.project_kv(x, pos)
            keys.append(k)
            values.append(v)
            mask = ttt_mask(s, T, dev)[None, None]
            h = hidden_in + self.layer.attn.attend(x, pos, torch.cat(keys, 2), torch.cat(values, 2), mask)
            g = h + self.layer.mlp(self.layer.post_norm(h))
            valid = ((p_idx >= s) & (p_idx <= T - 3))[None] & scored_next  # chain start t = p - s >= 0, label x[p+2]
            sc = block_scores(
                {"soft_ce": 1.0},
                "exp",
                1.0,
                lambda g: self.lm_head(self.norm(g)),
                target_fn,
                (g[:, :, None],),
                target_in,
                next_tokens[:, :, None],
                valid[:, :, None],
                chunk,
                self.draft_vocab_ids(),
            )
            losses.append(sc.loss)
            steps.append({k: getattr(sc, k)[:, starts + s, 0] for k in ("draft_tokens", "target_tokens", "accept")})
            if chunk is None:
                assert sc.draft_logits is not None and sc.target_logits is not None  # unchunked: returned
                steps[-1].update(
                    draft_logits=sc.draft_logits[:, starts + s, 0], target_logits=sc.target_logits[:, starts + s, 0]
                )
            steps[-1]["scored"] = scored_next[:, starts + s]
            hidden_in = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # own output, one position on
        loss = torch.stack(losses).mean()
        # [B, chains, S], aligned by chain start
        return DrafterOutput(
            loss=loss,
            **{k: torch.stack([st[k] for st in steps], dim=2) for k in steps[0]},
            logs={"soft_ce": loss.detach()},
        )

    # ---------------------------------------------------------------------------------------------
    # Decoding: keys/values of step-0 entries (one per position the target has verified) in a
    # ContextCache, written in place, and the layer output at the newest position; drafts write their
    # entries after the context as scratch space, overwritten by the next append. The lean operations
    # of the block drafters' decode path (drafters.layers: fused norms, a rotary table, SDPA called directly).

    def _decode_step(self, emb, hidden, pos, cache: ContextCache, mask):
        """The layer over ``[emb ; hidden]`` at ``pos`` [B, n] whose keys/values are written at
        ``cache.length + i`` (uncounted: the caller counts them) and see the cache before them (``mask``:
        None, or which of them each sees)."""
        layer = self.layer
        x = layer.layer_input(emb, hidden, lean=True)
        end = cache.write([layer.attn.project_kv(x, pos, lean=True)])
        h = hidden + layer.attn.attend(x, pos, cache.keys[0][:, :, :end], cache.values[0][:, :, :end], mask, lean=True)
        return h + layer.mlp(rms(layer.post_norm, h))

    def extend(self, state: dict, aux: torch.Tensor, next_tokens: torch.Tensor, start: int) -> dict:
        """Add positions ``start .. start+n-1`` (target features ``aux`` [B, n, F], each with its next
        token ``next_tokens`` [B, n]) to the cache and keep the layer output at the last one."""
        n = aux.shape[1]
        cache = state.get("cache") or ContextCache(spare=self.config.block_size)
        if cache.length != start:
            raise ValueError(f"the cache holds {cache.length} positions, the new ones start at {start}")
        pos = torch.arange(start, start + n, device=aux.device)[None].expand(aux.shape[0], -1)
        mask = None if n == 1 else (torch.arange(start + n, device=aux.device)[None, :] <= pos[0, :, None])[None, None]
        g = self._decode_step(self.embed_tokens(next_tokens), self.fc(aux), pos, cache, mask)
        cache.length += n
        return {"cache": cache, "g": g[:, -1:]}

    def propose_chain(self, state: dict, steps: int, choose=None, stop=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts for the ``steps`` tokens after the newest token's successor: (tokens [B, steps],
        logits [B, steps, V]); ``choose(logits) -> tokens`` picks each (argmax by default); drafting
        ends early after the first position whose logits ``stop(logits)`` is true for (fewer tokens)."""
        choose = choose or argmax_choice
        g, cache = state["g"], state["cache"]
        length = cache.length  # the newest verified position is length - 1
        logits, tokens = [], []
        try:
            for s in range(steps):
                step_logits = self.lm_head(rms(self.norm, g))
                logits.append(step_logits)
                tokens.append(choose(step_logits))
                if s == steps - 1 or (stop is not None and stop(step_logits)):
                    break
                pos = torch.full((g.shape[0], 1), length + s, device=g.device)
                g = self._decode_step(self.embed_tokens(tokens[-1]), g, pos, cache, None)
                cache.length += 1  # the draft's entry, seen by the next draft
        finally:
            cache.length = length  # the drafts' entries are scratch: the next extend overwrites them
        return torch.cat(tokens, dim=1), torch.cat(logits, dim=1)

    # ---------------------------------------------------------------------------------------------
    # The same decoding over R rows in shapes fixed from call to call (the static step, serve_eval.static):
    # each row's length a tensor, its entries written at its own slots of buffers [R, heads, S, D] (zero
    # where never written), attention over whole buffers under masks; no value is read on the host.

    def _rows_step(self, emb, hidden, pos, slots, keys, values, mask):
        layer, end = self.layer, keys.shape[2]
        x = layer.layer_input(emb, hidden, lean=True)
        k, v = layer.attn.project_kv(x, pos, lean=True, end=end)
        store_rows(keys, values, k, v, slots)
        h = hidden + layer.attn.attend(x, pos, keys, values, mask[:, None], lean=True, end=end)
        return h + layer.mlp(rms(layer.post_norm, h))

    def extend_rows(self, aux, next_tokens, counts, lengths, keys, values) -> torch.Tensor:
        """:meth:`extend` over R rows: row ``r`` appends the first ``counts[r]`` of ``aux`` [R, A, F] (each
        position with its next token, ``next_tokens`` [R, A]) after its ``lengths[r]`` cached positions;
        the rest is padding, written to the buffers' last slot, which no query sees. Returns the layer
        output at each row's last appended position [R, 1, H] (meaningless where ``counts`` is 0)."""
        S = keys.shape[2]
        i = torch.arange(aux.shape[1], device=aux.device)
        pos = lengths[:, None] + i
        slots = torch.where(i < counts[:, None], pos, S - 1)
        slot = torch.arange(S, device=aux.device)
        mask = (slot <= pos[:, :, None]) & (slot < S - 1)
        g = self._rows_step(self.embed_tokens(next_tokens), self.fc(aux), pos, slots, keys, values, mask)
        return g.gather(1, (counts - 1).clamp_min(0)[:, None, None].expand(-1, 1, g.shape[-1]))

    def draft_rows(self, g, lengths, keys, values, steps: int, choose=None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`propose_chain` over R rows from the layer outputs ``g`` [R, 1, H] at each row's newest of
        ``lengths[r]`` cached positions: ``steps`` drafts [R, steps] and their logits [R, steps, V]; each
        draft's entry is scratch at the row's slot ``lengths[r] + s``."""
        choose = choose or argmax_choice
        slot = torch.arange(keys.shape[2], device=g.device)
        tokens, logits = [], []
        for s in range(steps):
            step_logits = self.lm_head(rms(self.norm, g))
            logits.append(step_logits)
            tokens.append(choose(step_logits))
            if s == steps - 1:
                break
            pos = (lengths + s)[:, None]
            g = self._rows_step(self.embed_tokens(tokens[-1]), g, pos, pos, keys, values, slot <= pos[:, :, None])
        return torch.cat(tokens, dim=1), torch.cat(logits, dim=1)
