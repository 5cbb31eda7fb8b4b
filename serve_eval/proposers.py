"""What the loop asks of a drafter, over R rows: :class:`Proposer`.

A row's newest token, its *bonus* ``b``, sits at position ``a`` (the row's verified length) and has not
been read by the target yet. A proposer drafts the tokens after it, for every row at once:

* :class:`BlockProposer` (DFlash, DSpark): one block forward over every row's context cache of target
  features (:class:`~drafters.cache.ContextCache`), through a compiled draft where the backend built one
  (:meth:`~serve_eval.backend.Backend.draft_graph`);
* :class:`Eagle3Proposer`, :class:`LMProposer` (any causal LM: a distilled student, a Parcae model at
  fewer recurrences), :class:`PardProposer` (a PARD-trained LM, its block in one forward): one state
  per row (:class:`PerRow`), each drafting its row alone;
* :class:`LookupProposer`: prompt-lookup copies (:mod:`serve_eval.lookup`), point masses with no logits.

Contract (lossless): a proposal depends on the verified tokens, their features, the sampler's draws
and nothing the target has not yet verified; its logits are the distributions its tokens were drawn
from (``q``), which verification reads. DSpark's ``confidence_threshold`` stops a row's draft before the
first position whose predicted acceptance, computed from the anchor, the context and the drafts
before it only, falls below the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from drafters import Eagle3Drafter, is_block_drafter
from drafters.cache import ContextCache

from .backend import TORCH, Backend
from .lookup import NgramIndex
from .sampling import Sampler
from .verify import choose_rows


@dataclass
class Proposal:
    """Drafts for R rows: ``tokens`` [R, D]; ``logits`` [R, D, V] they were drawn from (None: copies,
    point masses); ``lengths``: each row's drafts where some row has fewer than ``D`` (the rest padding)."""

    tokens: torch.Tensor
    logits: torch.Tensor | None
    lengths: list[int] | None = None

    def length(self, r: int) -> int:
        return self.tokens.shape[1] if self.lengths is None else self.lengths[r]


class Proposer:
    """Drafts for R rows. The loop calls :meth:`start` with a new batch's prompts (their prefill's
    features and first tokens), :meth:`put` when waiting prompts take finished rows' places,
    :meth:`select` when rows leave, :meth:`observe` with each row's verified tokens after a step, and
    :meth:`propose` for the next drafts.

    ``target_layer_ids``: the target layers whose features it reads (None: none, tokens only).
    ``conditional``: a draft's distribution depends on the drafts before it, so a budget chooses causally
    at T > 0 (:mod:`serve_eval.budget`). ``incremental``: one forward per draft; one row's
    :meth:`propose` then takes ``stop(logits) -> bool``, asked after each position: on yes that position's
    draft is the last."""

    target_layer_ids: list[int] | None = None
    conditional = incremental = False
    block_size: int

    @property
    def needs_features(self) -> bool:
        return self.target_layer_ids is not None

    def start(self, prompts: list[torch.Tensor], features: torch.Tensor | None, firsts: torch.Tensor) -> None:
        """A new batch of ``len(prompts)`` rows: row ``i`` read ``prompts[i]``, whose positions have
        features ``features[i]`` (aux [R, L, F], row ``i`` valid up to its prompt's length, or None), and
        its bonus is ``firsts[i]``."""
        raise NotImplementedError

    def put(
        self, rows: torch.Tensor, prompts: list[torch.Tensor], features: torch.Tensor | None, firsts: torch.Tensor
    ) -> None:
        """Rows ``rows`` start over with ``prompts`` (as in :meth:`start`)."""
        raise NotImplementedError

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows``."""
        raise NotImplementedError

    def observe(self, starts: list[int], tokens: list[torch.Tensor], features: torch.Tensor | None) -> None:
        """Row ``r`` verified the tokens at positions ``starts[r]`` (its last bonus) onward, with features
        ``features[r, :len(tokens[r])]``; ``tokens[r]`` are the tokens that follow them (its accepted
        drafts and its new bonus)."""
        raise NotImplementedError

    def propose(self, anchors: torch.Tensor, positions: list[int], samplers: list[Sampler], stop=None) -> Proposal:
        """Drafts after each row's bonus ``anchors[r]`` at ``positions[r]``, drawn with ``samplers[r]``."""
        raise NotImplementedError


class BlockProposer(Proposer):
    """DFlash / DSpark over R rows: each row's context keys and values in one :class:`ContextCache`, its
    newly verified features queued until the next draft, whose forward (the drafter's one decoding
    forward, :meth:`~drafters.block.BlockDrafter.decode`, compiled where the backend built its graph) reads
    up to ``K`` of them with the block, one product a layer."""

    def __init__(self, drafter, confidence_threshold: float = 0.0, backend: Backend = TORCH):
        self.drafter = drafter
        self.target_layer_ids = drafter.config.target_layer_ids
        self.block_size = drafter.config.block_size
        self.conditional = drafter.conditional_drafts
        self.confidence_threshold = confidence_threshold
        self.compiled = backend.draft_graph(drafter)  # the draft as one graph, where the backend built one
        self.context = self._new_context()
        self.pending: list[
            tuple[torch.Tensor, torch.Tensor | None]
        ] = []  # (features [R, m, F], counts [R]; None: all m)

    def _new_context(self) -> ContextCache:
        return ContextCache(spare=self.block_size, capacity=self.compiled.positions if self.compiled else 0)

    # -- rows --------------------------------------------------------------------------------------
    def start(self, prompts, features, firsts) -> None:
        self.context = self._new_context()
        self.context.start(len(prompts))
        if features is None:
            raise ValueError("a block drafter drafts from the target's features: start its rows with them")
        if len(prompts) == 1:  # read with the first draft
            self.pending = [(features, None)]
        else:
            self.pending = []
            self._append(features, torch.tensor([len(p) for p in prompts]))

    @torch.inference_mode()
    def put(self, rows, prompts, features, firsts) -> None:
        # features queued for the rows' former occupants count as none of the new rows'
        R = len(self.context.lengths)
        self.pending = [
            (aux, (torch.full((R,), aux.shape[1]) if counts is None else counts).index_fill(0, rows, 0))
            for aux, counts in self.pending
        ]
        m = features.shape[1]
        kv = self.drafter.context_kv(
            features, torch.arange(m, device=features.device)[None].expand(len(rows), m), lean=True
        )
        self.context.put(rows, kv, torch.tensor([len(p) for p in prompts]))

    def select(self, rows) -> None:
        self.pending = [
            (aux[rows.to(aux.device)], None if counts is None else counts[rows]) for aux, counts in self.pending
        ]
        self.context.select(rows)

    def observe(self, starts, tokens, features) -> None:
        counts = None
        if len(tokens) > 1:
            counts = torch.tensor([len(t) for t in tokens])
            if bool((counts == features.shape[1]).all()):
                counts = None
        self.pending.append((features, counts))

    # -- the context -------------------------------------------------------------------------------
    @torch.inference_mode()
    def _append(self, aux: torch.Tensor, counts: torch.Tensor) -> None:
        """Every row appends ``aux`` [R, m, F] after its context, counting its first ``counts[r]``."""
        positions = self.context.lengths[:, None] + torch.arange(aux.shape[1])
        self.context.append_rows(self.drafter.context_kv(aux, positions.to(aux.device), lean=True), counts)

    def _flush(self) -> None:
        """Append every queued feature; a run of entries where every row keeps all it read goes in one product."""
        run: list[torch.Tensor] = []
        for aux, counts in self.pending + [(None, None)]:
            if aux is not None and counts is None:
                run.append(aux)
                continue
            if run:
                merged = torch.cat(run, dim=1)
                self._append(merged, torch.full((merged.shape[0],), merged.shape[1], dtype=torch.long))
                run = []
            if aux is not None and counts is not None:
                self._append(aux, counts)
        self.pending = []

    # -- drafts ------------------------------------------------------------------------------------
    def _arriving(self, R: int) -> tuple[torch.Tensor | None, list[int]]:
        """The features the next draft reads with its block, [R, m, F] with ``m <= K`` (or None), and how
        many of them are each row's own; features queued before them are appended to the context first
        (one product for a run of entries every row keeps whole)."""
        K = self.block_size
        pending = self.pending
        if len(pending) > 1 and all(counts is None for _, counts in pending):
            pending = [(torch.cat([aux for aux, _ in pending], dim=1), None)]
        self.pending = pending[:-1]
        self._flush()
        if not pending:
            return None, [0] * R
        aux, kept = pending[-1]
        m = aux.shape[1]
        counts = [m] * R if kept is None else kept.tolist()
        if m > K:  # a prompt's features, or a step's after undrafted ones: all but the last K into the context
            self._append(aux[:, : m - K], torch.tensor([min(c, m - K) for c in counts]))
            aux, counts = aux[:, m - K :], [max(c - (m - K), 0) for c in counts]
        return aux, counts

    @torch.inference_mode()
    def propose(self, anchors, positions, samplers, stop=None) -> Proposal:
        """Every row's block through the drafter's one decoding forward (:meth:`~drafters.block.BlockDrafter.decode`):
        the backend's compiled graph of it where it :meth:`~serve_eval.cpu.compiled.CompiledDraft.fits`,
        else eagerly, reading up to ``K`` newly verified features with the block."""
        drafter, context, graph = self.drafter, self.context, self.compiled
        R, K = len(anchors), self.block_size
        greedy = samplers[0].greedy
        aux, counts = self._arriving(R)
        lengths = context.row_lengths()
        ends = [length + count for length, count in zip(lengths, counts)]
        if ends != [int(p) for p in positions]:
            raise ValueError(
                f"the context cache holds {lengths} positions and {counts} arrive; the blocks are anchored at "
                f"{[int(p) for p in positions]}"
            )
        anchors = anchors.to(drafter.device)
        features = torch.zeros(R, K, drafter.fc.in_features, dtype=drafter.dtype, device=drafter.device)
        if aux is not None:
            features[:, : aux.shape[1]] = aux
        starts = torch.tensor(list(zip(lengths, counts)), device=drafter.device)  # [R, 2]
        end = max(ends)
        if graph is not None and graph.fits(context, end, 0 if aux is None else aux.shape[1]):
            hidden, proposal = graph.run(anchors, starts, features, context, graph.proposes_for(greedy))
        else:
            kv = features.new_empty(R, drafter.config.num_key_value_heads, 0, drafter.config.head_dim)
            context.ensure(end + K + 1, kv, len(drafter.layers))
            hidden, proposal = drafter.decode(anchors, starts, features, context), None
        context.lengths = ends
        tokens, logits, confidence = _proposal(
            drafter, hidden, proposal, anchors[:, None], lambda x: choose_rows(samplers, x), greedy
        )
        cut = None
        if confidence is not None and self.confidence_threshold > 0:
            low = confidence[:, 0] < self.confidence_threshold  # [R, K-1]
            first = torch.where(low.any(1), low.int().argmax(1), torch.full((R,), low.shape[1]))
            cut = first.clamp_min(1).tolist()  # always draft at least one token
        return Proposal(tokens[:, 0], logits[:, 0], cut)


class PerRow(Proposer):
    """A drafter whose state is one sequence's (a KV cache of its own): one state per row, made by
    :meth:`row`, each with the one-row contract ``begin(prompt)``, ``observe(aux, start, tokens)`` and
    ``propose(anchor, anchor_pos, sampler[, stop]) -> (tokens [d], logits [d, V])``."""

    def row(self):
        raise NotImplementedError

    def _begun(self, prompt: torch.Tensor, features: torch.Tensor | None, i: int, first: torch.Tensor):
        state = self.row()
        state.begin(prompt.view(1, -1))
        aux = None if features is None else features[i : i + 1, : len(prompt)]
        state.observe(aux, 0, torch.cat([prompt.view(-1)[1:], first.view(1).to(prompt.device)]))
        return state

    @torch.inference_mode()
    def start(self, prompts, features, firsts) -> None:
        self.states = [self._begun(p, features, i, firsts[i]) for i, p in enumerate(prompts)]

    @torch.inference_mode()
    def put(self, rows, prompts, features, firsts) -> None:
        for j, r in enumerate(rows.tolist()):
            self.states[r] = self._begun(prompts[j], features, j, firsts[j])

    def select(self, rows) -> None:
        self.states = [self.states[r] for r in rows.tolist()]

    @torch.inference_mode()
    def observe(self, starts, tokens, features) -> None:
        for r, state in enumerate(self.states):
            state.observe(None if features is None else features[r : r + 1, : len(tokens[r])], starts[r], tokens[r])

    @torch.inference_mode()
    def propose(self, anchors, positions, samplers, stop=None) -> Proposal:
        extra = {} if stop is None else {"stop": stop}
        drafted = [state.propose(anchors[r], positions[r], samplers[r], **extra) for r, state in enumerate(self.states)]
        if len(drafted) == 1:
            tokens, logits = drafted[0]
            return Proposal(tokens[None], logits[None])
        lengths = [len(tokens) for tokens, _ in drafted]
        D = max(lengths)
        tokens = torch.stack([torch.nn.functional.pad(t, (0, D - len(t))) for t, _ in drafted])
        logits = torch.stack([torch.nn.functional.pad(lg, (0, 0, 0, D - len(lg))) for _, lg in drafted])
        return Proposal(tokens, logits, None if min(lengths) == D else lengths)


class Eagle3Draft:
    """One row of EAGLE-3: a KV cache of step-0 entries for verified positions; drafts autoregressively."""

    def __init__(self, drafter):
        self.drafter, self.steps, self.state = drafter, drafter.config.block_size - 1, {}

    def begin(self, prompt: torch.Tensor) -> None:
        self.state = {}

    def observe(self, aux: torch.Tensor, start: int, next_tokens: torch.Tensor) -> None:
        self.state = self.drafter.extend(self.state, aux, next_tokens.view(1, -1), start)

    def propose(self, anchor, anchor_pos: int, sampler: Sampler, stop=None):
        tokens, logits = self.drafter.propose_chain(self.state, self.steps, sampler.choose, stop)
        return tokens[0], logits[0]


class Eagle3Proposer(PerRow):
    """EAGLE-3 over rows, one :class:`Eagle3Draft` per row."""

    conditional = incremental = True

    def __init__(self, drafter):
        self.drafter = drafter
        self.target_layer_ids = drafter.config.target_layer_ids
        self.block_size = drafter.config.block_size
        self.states: list = []

    def row(self) -> Eagle3Draft:
        return Eagle3Draft(self.drafter)


class LMDraft:
    """One row of a causal-LM drafter: its own KV cache of the tokens it has read (``read``, position by
    position), the verified sequence (``sequence``, the bonus last). After a verification it keeps the
    cache up to the first position where what it read differs from the verified sequence (a rejected
    draft, or a tree branch the target did not take), and catches up from there on the next draft."""

    def __init__(self, model, draft_length: int, **forward_kwargs):
        self.model = model
        self.block_size = draft_length + 1
        self.forward_kwargs = forward_kwargs
        self.cache = DynamicCache()  # begin() makes each sequence's
        self.sequence: list[int] = []
        self.read: list[int] = []

    def begin(self, prompt: torch.Tensor) -> None:
        self.cache, self.sequence, self.read = DynamicCache(), prompt.view(-1).tolist(), []

    def observe(self, aux, start: int, next_tokens: torch.Tensor) -> None:
        self.sequence = self.sequence[: start + 1] + next_tokens.view(-1).tolist()
        keep = min(start, len(self.read))
        last = len(self.sequence) - 1  # the bonus is always (re)read by the next draft: its logits start it
        while keep < min(len(self.read), last) and self.read[keep] == self.sequence[keep]:
            keep += 1
        if keep < len(self.read):
            self.cache.crop(keep - len(self.read))
            self.read = self.read[:keep]

    def _read(self, tokens: list[int], device) -> torch.Tensor:
        start = len(self.read)
        ids = torch.tensor([tokens], device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        logits = self.model(
            input_ids=ids,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
            **self.forward_kwargs,
        ).logits[0, -1]  # the head on the last position only
        self.read += tokens
        return logits

    def propose(self, anchor, anchor_pos: int, sampler: Sampler, stop=None):
        tokens, all_logits = [], []
        pending = self.sequence[len(self.read) : anchor_pos + 1]  # catch up to the bonus (at anchor_pos)
        for _ in range(self.block_size - 1):
            logits = self._read(pending, anchor.device)
            token = sampler.choose(logits)
            tokens.append(token)
            all_logits.append(logits)
            if stop is not None and stop(logits):
                break
            pending = [int(token)]
        return torch.stack(tokens).view(-1), torch.stack(all_logits)


class PardDraft(LMDraft):
    """One row of a PARD-trained causal LM (:mod:`drafters.pard`): one forward reads the tokens it has not
    read yet (the bonus last) and ``K - 1`` mask tokens after them; the bonus's output and the masks'
    give ``K`` drafts, none conditioned on another (a block), and the mask entries leave the cache at once."""

    def __init__(self, model, draft_tokens: int, mask_token_id: int):
        super().__init__(model, draft_tokens)
        self.masks = [mask_token_id] * (draft_tokens - 1)

    def propose(self, anchor, anchor_pos: int, sampler: Sampler, stop=None):
        pending = self.sequence[len(self.read) : anchor_pos + 1]
        start, n = len(self.read), len(pending) + len(self.masks)
        ids = torch.tensor([pending + self.masks], device=anchor.device)
        positions = torch.arange(start, start + n, device=anchor.device)[None]
        logits = self.model(
            input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True, logits_to_keep=len(self.masks) + 1
        ).logits[0]
        self.cache.crop(-len(self.masks))
        self.read += pending
        return sampler.choose(logits), logits


class LMProposer(PerRow):
    """Any causal LM as an autoregressive drafter, ``draft_length`` tokens a step, one :class:`LMDraft` per
    row (``forward_kwargs``: e.g. a Parcae drafter's ``num_steps``)."""

    conditional = incremental = True

    def __init__(self, model, draft_length: int, **forward_kwargs):
        self.model, self.draft_length, self.forward_kwargs = model, draft_length, forward_kwargs
        self.block_size = draft_length + 1
        self.states: list = []

    def row(self) -> LMDraft:
        return LMDraft(self.model, self.draft_length, **self.forward_kwargs)


class PardProposer(PerRow):
    """A PARD-trained causal LM (``config.pard``): ``draft_tokens`` drafts from one forward, one
    :class:`PardDraft` per row; verified as a block (no draft conditions on another)."""

    def __init__(self, model, draft_tokens: int, mask_token_id: int):
        self.model, self.draft_tokens, self.mask_token_id = model, draft_tokens, mask_token_id
        self.block_size = draft_tokens + 1
        self.states: list = []

    def row(self) -> PardDraft:
        return PardDraft(self.model, self.draft_tokens, self.mask_token_id)


class LookupProposer(Proposer):
    """Prompt lookup (:mod:`serve_eval.lookup`): each row's continuation of up to ``length`` tokens after
    the last earlier occurrence of its text's final n-gram; copies carry no logits (point masses)."""

    def __init__(self, length: int):
        self.length = length
        self.block_size = length + 1
        self.indexes: list[NgramIndex] = []

    def start(self, prompts, features, firsts) -> None:
        self.indexes = [NgramIndex(p.tolist() + [int(f)]) for p, f in zip(prompts, firsts)]

    def put(self, rows, prompts, features, firsts) -> None:
        for j, r in enumerate(rows.tolist()):
            self.indexes[r] = NgramIndex(prompts[j].tolist() + [int(firsts[j])])

    def select(self, rows) -> None:
        self.indexes = [self.indexes[r] for r in rows.tolist()]

    def observe(self, starts, tokens, features) -> None:
        for index, t in zip(self.indexes, tokens):
            index.extend(t.tolist())

    def copies(self) -> list[list[int]]:
        """Each row's copy (empty where its text's final n-grams occur nowhere earlier)."""
        return [index.continuation(self.length) for index in self.indexes]

    def propose(self, anchors, positions, samplers, stop=None) -> Proposal:
        copies = self.copies()
        D = max(map(len, copies), default=0)
        tokens = torch.tensor([c + [0] * (D - len(c)) for c in copies], dtype=torch.long)
        return Proposal(tokens, None, [len(c) for c in copies])


def _proposal(drafter, hidden: torch.Tensor, graphs: tuple | None, anchors: torch.Tensor, choose, greedy: bool):
    """The drafter's proposal (tokens, logits, confidence) over a block's ``hidden`` states: a compiled
    graph's own where it gave one (``graphs``; its tokens drawn from its logits when sampling), else the
    drafter's ``propose`` with ``choose``."""
    if graphs is None:
        return drafter.propose(hidden, anchors, choose)
    return graphs if greedy else (choose(graphs[1]), *graphs[1:])


def make_proposer(
    drafter,
    confidence_threshold: float = 0.0,
    draft_length: int = 7,
    draft_recurrence: int | None = None,
    parallel: bool = True,
    backend: Backend = TORCH,
) -> Proposer:
    """The proposer for a drafter: its own kind for DFlash / DSpark / EAGLE-3, :class:`PardProposer` for a
    PARD-trained LM (``config.pard``; ``parallel=False`` drafts with it autoregressively), :class:`LMProposer`
    for any other causal LM (``draft_length`` tokens a step; ``draft_recurrence`` for Parcae)."""
    if isinstance(drafter, Eagle3Drafter):
        return Eagle3Proposer(drafter)
    if is_block_drafter(drafter):
        return BlockProposer(drafter, confidence_threshold, backend)
    pard = getattr(drafter.config, "pard", None)
    if pard and parallel:
        return PardProposer(drafter, pard["draft_tokens"], pard["mask_token_id"])
    return LMProposer(drafter, draft_length, **({"num_steps": draft_recurrence} if draft_recurrence else {}))
