"""Draft vocabularies (drafters.vocab) in the decoding loop: static and per-step restrictions stay
lossless and draft only the tokens they allow."""

from __future__ import annotations

import pytest
import torch

from serve_eval.budget import Budget
from serve_eval.loop import plain_generate, speculative_generate
from serve_eval.proposers import make_proposer

from ..conftest import KINDS, MAX_NEW


@pytest.mark.parametrize("kind", [*KINDS, "causal_lm"])
def test_draft_vocabularies_stay_lossless_and_draft_only_their_tokens(target_and_prompts, trained_drafters, kind):
    """A drafter restricted to a quarter of the vocabulary (drafters.vocab): greedy chains and trees still
    equal plain decoding, and every drafted token is one of the draft vocabulary's. causal_lm: a copy of
    the target drafting as an LM (a student's or PARD's proposer path)."""
    import copy

    from drafters.vocab import restrict_vocab

    target, tok, prompts = target_and_prompts
    vocab = target.config.vocab_size
    ids = torch.arange(0, vocab, 4)
    drafter = restrict_vocab(copy.deepcopy(target if kind == "causal_lm" else trained_drafters[kind]), ids)
    drafted = []
    proposer = make_proposer(drafter)
    inner = proposer.propose

    def propose(*args, **kwargs):
        out = inner(*args, **kwargs)
        drafted.append(out.tokens[0])
        return out

    proposer.propose = propose
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        assert speculative_generate(target, drafter, prompt, MAX_NEW, proposer=proposer)[0] == reference
        assert (
            speculative_generate(target, drafter, prompt, MAX_NEW, mode="tree", budget=Budget({1: 1.0, 16: 1.3}))[0]
            == reference
        )
    tokens = torch.cat(drafted)
    assert len(tokens) and bool(torch.isin(tokens, ids).all()), "a token outside the draft vocabulary was drafted"


@pytest.mark.parametrize("kind", [*KINDS, "causal_lm"])
def test_per_step_vocabularies_stay_lossless_and_draft_from_their_subsets(target_and_prompts, trained_drafters, kind):
    """A per-step vocabulary (drafters.vocab.CandidateHead: a few static tokens plus the 4 likeliest in any
    row under a rank-8 approximation of the head): greedy chains and trees equal plain decoding, every
    drafted token is in a subset its draft's head calls chose, and the subsets change from call to call."""
    import copy

    from drafters.vocab import speculate_vocab

    target, tok, prompts = target_and_prompts
    drafter = copy.deepcopy(target if kind == "causal_lm" else trained_drafters[kind])
    head = speculate_vocab(drafter, torch.arange(0, drafter.config.vocab_size, 16), candidates=4, rank=8)
    subsets, drafted = [], []
    select = head.select

    def chosen(x, shift=None):
        ids = select(x, shift)
        subsets.append(ids)
        return ids

    head.select = chosen
    proposer = make_proposer(drafter)
    inner = proposer.propose

    # a draft's tokens against the subsets its head calls chose (one a position or a block)
    def propose(*args, **kwargs):
        start = len(subsets)
        out = inner(*args, **kwargs)
        drafted.append((out.tokens[0], torch.cat(subsets[start:])))
        return out

    proposer.propose = propose
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        assert speculative_generate(target, drafter, prompt, MAX_NEW, proposer=proposer)[0] == reference
        assert (
            speculative_generate(target, drafter, prompt, MAX_NEW, mode="tree", budget=Budget({1: 1.0, 16: 1.3}))[0]
            == reference
        )
    assert all(bool(torch.isin(tokens, ids).all()) for tokens, ids in drafted), (
        "a token outside its subsets was drafted"
    )
    assert len({tuple(ids.tolist()) for ids in subsets}) > 1 and all(
        len(ids) == head.summary()["size"] for ids in subsets
    )
