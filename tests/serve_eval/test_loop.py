"""The speculative loop is lossless: at temperature 0 it emits exactly the target's greedy tokens,
for every drafter, when every draft is rejected and when every draft is accepted."""

from __future__ import annotations

import pytest
import torch

from serve_eval.backend import Backend
from serve_eval.budget import Budget
from serve_eval.loop import plain_generate, speculative_generate
from serve_eval.proposers import PerRow, make_proposer
from serve_eval.session import TargetSession

from ..conftest import KINDS, MAX_NEW


class ScriptedProposer(PerRow):
    """Proposes the baseline's own continuation (always accepted) or a wrong token (always rejected)."""

    def __init__(self, reference: list[int], prompt_len: int, block_size: int, vocab: int, wrong: bool):
        self.reference, self.prompt_len, self.block_size, self.vocab, self.wrong = (
            reference,
            prompt_len,
            block_size,
            vocab,
            wrong,
        )

    def row(self):
        return _Script(self)


class _Script:
    """A row of :class:`ScriptedProposer`: it reads nothing, it knows the answer."""

    def __init__(self, script: ScriptedProposer):
        self.script = script

    def begin(self, prompt):
        pass

    def observe(self, aux, start, next_tokens):
        pass

    def propose(self, anchor, anchor_pos, sampler):
        s = self.script
        i = anchor_pos - s.prompt_len + 1  # reference index of the token after the anchor
        nxt = (s.reference + [0] * s.block_size)[i : i + s.block_size - 1]
        tokens = (torch.tensor(nxt) + int(s.wrong)) % s.vocab
        return tokens, torch.nn.functional.one_hot(tokens, s.vocab).float() * 100  # trees: the same chain first


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_equals_greedy(target_and_prompts, trained_drafters, kind):
    target, tok, prompts = target_and_prompts
    drafter = trained_drafters[kind]
    taus, chosen = [], set()
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        assert len(reference) == MAX_NEW
        ours, stats = speculative_generate(target, drafter, prompt, MAX_NEW)
        assert ours == reference
        taus.append(stats.tau)
        for mode in ("chain", "tree"):  # per-step budgets from (made-up) costs: other steps, the same tokens
            budget = Budget({1: 1.0, 2: 1.02, 16: 1.3})
            assert speculative_generate(target, drafter, prompt, MAX_NEW, mode=mode, budget=budget)[0] == reference
            chosen.update(budget.chosen)
        K = drafter.config.block_size
        for wrong, mode in ((True, "chain"), (False, "chain"), (True, "tree"), (False, "tree")):
            scripted = ScriptedProposer(reference, len(prompt), K, len(tok), wrong)
            out, s = speculative_generate(
                target, drafter, prompt, MAX_NEW, proposer=scripted, mode=mode, tree_budget=K - 1
            )
            assert out == reference, f"wrong={wrong}, {mode}"
            if wrong:  # every draft rejected: one token per target forward
                assert s.tau == 1.0 and sum(s.accepted_by_position) == 0
            else:  # every draft accepted: K tokens per forward but for the last, cut by max_new_tokens
                assert s.target_forwards == 1 + -(-(MAX_NEW - 1) // K), (mode, s)
    assert max(taus) > 1.0, f"a trained {kind} drafter should get some drafts accepted: {taus}"
    assert len(chosen) > 2, f"the budgets should have verified steps of several sizes: {chosen}"


def test_eos_stops_both_loops_identically(target_and_prompts, trained_drafters):
    target, tok, prompts = target_and_prompts
    reference, _ = plain_generate(target, prompts[0], MAX_NEW)
    eos = reference[10]  # pretend a token the target emits is the end of sequence
    ref_eos, _ = plain_generate(target, prompts[0], MAX_NEW, eos_token_id=eos)
    ours, _ = speculative_generate(target, trained_drafters["dflash"], prompts[0], MAX_NEW, eos_token_id=eos)
    assert ours == ref_eos and ref_eos[-1] == eos and len(ref_eos) <= 11


def test_rollback_equals_recomputing_from_scratch(target_and_prompts):
    """A step of four tokens of which one is kept leaves the cache a prefill of the kept token gives."""
    target, _, prompts = target_and_prompts
    ids = prompts[0]
    rolled = TargetSession(target)
    rolled.prefill([ids])
    rolled.step(torch.tensor([[5, 6, 7, 8]]))
    rolled.keep([1])
    fresh = TargetSession(target)
    fresh.prefill([torch.cat([ids, torch.tensor([5])])])
    for layer_a, layer_b in zip(rolled.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(layer_a.keys, layer_b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer_a.values, layer_b.values, rtol=1e-5, atol=1e-5)
    # and the next step agrees
    a, _ = rolled.step(torch.tensor([[9]]))
    b, _ = fresh.step(torch.tensor([[9]]))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_tree_compaction_equals_recomputing_the_accepted_path(target_and_prompts):
    from distill.base.features import FeatureCapture
    from serve_eval.tree import DraftTree

    target, _, prompts = target_and_prompts
    ids = prompts[0]
    capture = FeatureCapture(target, [0])
    tree_session = TargetSession(target, capture)
    tree_session.prefill([ids])
    # root 5 -> (6 -> 8), (7); accept root, 6, 8
    tree = DraftTree(torch.tensor([6, 7, 8]), torch.tensor([-1, -1, 0]), torch.tensor([1, 1, 2]))
    nodes = torch.tensor([[5, 6, 7, 8]])
    logits, _ = tree_session.step_tree(nodes, torch.tensor([[0, 1, 1, 2]]), tree.ancestor_mask()[None])
    tree_session.keep_paths([[0, 1, 3]])
    fresh = TargetSession(target)
    fresh.prefill([ids])
    fresh_logits, _ = fresh.step(torch.tensor([[5, 6, 8]]))
    fresh.keep([3])
    torch.testing.assert_close(logits[0, [0, 1, 3]], fresh_logits[0], rtol=1e-4, atol=1e-4)
    for a, b in zip(tree_session.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    assert tree_session.length == fresh.length


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_drafts_match_training_drafts(target_and_prompts, trained_drafters, kind):
    """The cached decoding path proposes what the training forward would (same masks, same inputs), its
    context appended in two pieces."""
    from distill.base.features import FeatureCapture

    target, tok, prompts = target_and_prompts
    drafter = trained_drafters[kind]
    reference, _ = plain_generate(target, prompts[0], MAX_NEW)
    seq = torch.cat([prompts[0], torch.tensor(reference)])[None]
    feats = FeatureCapture(target, drafter.config.target_layer_ids)(seq)
    a = prompts[0].shape[0]  # the first bonus token's position
    proposer = make_proposer(drafter)
    proposer.start(
        [seq[0, : a - 3]], feats.aux[:, : a - 3], seq[0, a - 3 : a - 2]
    )  # positions < a - 3, then a - 3's token
    proposer.observe([a - 3], [seq[0, a - 2 : a + 1]], feats.aux[:, a - 3 : a])
    from serve_eval.sampling import Sampler

    proposal = proposer.propose(seq[0, a : a + 1], [a], [Sampler()])
    decoded, logits = proposal.tokens[0], proposal.logits[0]
    if kind == "eagle3":
        out = drafter(seq, feats.aux, feats.last)  # chain starting at t = a - 1
        trained_logits = out.draft_logits[0, a - 1]
    else:
        out = drafter(seq, feats.aux, feats.last, anchors=torch.tensor([[a]]))
        trained_logits = out.draft_logits[0, 0]
    trained = trained_logits.argmax(-1)
    if kind != "dspark":  # DSpark's training logits follow the answer's tokens, its drafts its own
        torch.testing.assert_close(logits, trained_logits, rtol=1e-4, atol=1e-4)
    if kind == "dspark":
        trained = drafter.propose(
            drafter.block_hidden(feats.aux, seq[:, a : a + 1], torch.tensor([[a]])), seq[:, a : a + 1]
        )[0][0, 0]
    assert torch.equal(decoded, trained)


def test_dspark_confidence_scheduling_stays_lossless_and_drafts_less(target_and_prompts, trained_drafters):
    target, _, prompts = target_and_prompts
    drafter = trained_drafters["dspark"]
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        full, full_stats = speculative_generate(target, drafter, prompt, MAX_NEW)
        short, short_stats = speculative_generate(target, drafter, prompt, MAX_NEW, confidence_threshold=0.999999)
        assert full == short == reference
        # a threshold no position reaches leaves one draft per block
        assert sum(short_stats.drafted_by_position[1:]) == 0 and short_stats.drafted_by_position[0] > 0


def test_a_fixed_draft_length_verifies_that_many_drafts(target_and_prompts, trained_drafters):
    """Without a budget, verify_drafts = N verifies a chain's first N drafts each step (a fixed draft
    length): output equal to plain decoding, at most N + 1 tokens a step, and no position past N drafted."""
    target, _, prompts = target_and_prompts
    for n in (1, 3):
        for p in prompts:
            out, stats = speculative_generate(target, trained_drafters["dflash"], p, MAX_NEW, verify_drafts=n)
            assert out == plain_generate(target, p, MAX_NEW)[0]
            assert stats.tokens <= (n + 1) * (stats.target_forwards - 1) + 1
            assert sum(stats.drafted_by_position[n:]) == 0 < stats.drafted_by_position[0]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_drafts_with_lookup_equal_greedy(target_and_prompts, trained_drafters, kind):
    """Prompt-lookup continuations grafted onto the drafter's chain or tree, with and without a budget:
    the output is the target's greedy output, and a repetitive prompt gets copies verified."""
    target, _, prompts = target_and_prompts
    repetitive = torch.cat([prompts[0], prompts[0]])  # the target is likely to continue by copying
    for mode in ("chain", "tree"):
        budget = Budget({1: 1.0, 4: 1.1, 16: 1.5, 40: 3.0})
        for prompt in [*prompts, repetitive]:
            reference, base = plain_generate(target, prompt, MAX_NEW)
            for b in (None, budget):
                ours, stats = speculative_generate(
                    target, trained_drafters[kind], prompt, MAX_NEW, mode=mode, tree_budget=4, lookup=8, budget=b
                )
                assert ours == reference, mode
        assert budget.lookup is not None and sum(budget.lookup.trials) > budget.lookup.prior * len(budget.lookup.trials)


class CountingBackend(Backend):
    """The generic backend, counting the greedy choices the loop asks of it."""

    def __init__(self):
        self.calls = 0

    def top_tokens(self, logits, with_prob=False):
        self.calls += 1
        return super().top_tokens(logits, with_prob)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_choices_come_from_the_backend(target_and_prompts, trained_drafters, mode):
    """Every greedy token the loop picks (plain steps, drafts, verification, the budget's top
    probabilities) comes from the backend's rule, which a backend may compute with its own kernel."""
    target, _, prompts = target_and_prompts
    backend = CountingBackend()
    reference, _ = plain_generate(target, prompts[0], MAX_NEW)
    ours, stats = speculative_generate(
        target,
        trained_drafters["dflash"],
        prompts[0],
        MAX_NEW,
        mode=mode,
        budget=Budget({1: 1.0, 2: 1.02, 16: 1.3}),
        backend=backend,
    )
    assert ours == reference
    assert backend.calls >= 2 * (
        stats.target_forwards - 1
    )  # each step: the drafts' top probabilities and the verification
    calls = backend.calls
    assert plain_generate(target, prompts[0], MAX_NEW, backend=backend)[0] == reference
    assert backend.calls - calls == MAX_NEW
