"""Speculative speculative decoding (serve_eval.ssd): the fan-out, a drafter state after a hit equal
to one recomputed from scratch, greedy outputs equal to plain decoding (hits and misses, both drafter
kinds, both backups, inline and in a worker process), and samples from the target's distribution."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers import DynamicCache

from distill.config import ModelConfig
from distill.models import build_causal_lm
from serve_eval.loop import plain_generate
from serve_eval.proposers import LMProposer, PardProposer
from serve_eval.sampling import Sampler
from serve_eval.ssd import Speculator, fan_out, open_speculation, ssd_generate

from .test_sampling import ALPHA, PROMPT, SAMPLES, VOCAB, chi_square_pvalue, exact_joint, toy_lm, toy_target  # noqa: F401


def test_fan_out_shares_the_branches_as_the_power_law_says():
    assert fan_out([0.5, 0.25, 0.25], 8, 1.0) == [3, 3, 2]  # ~ sqrt(P): 3.31, 2.34, 2.34, largest remainders first
    assert fan_out([0.9, 0.1], 10, 1e-9) == [9, 1]  # r -> 0: proportional to P
    assert fan_out([0.9, 0.1], 10, 1e9) == [5, 5]  # r -> infinity: even
    counts = fan_out([0.6, 0.2, 0.1, 0.05, 0.05], 16, 0.5)
    assert sum(counts) == 16 and counts == sorted(counts, reverse=True)


def lm(seed: int, vocab: int = 64, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_causal_lm(
        ModelConfig(
            hidden_size=32,
            num_layers=layers,
            num_heads=4,
            intermediate_size=64,
            max_position_embeddings=256,
            initializer_range=0.2,
        ),
        vocab,
    ).eval()


class CheckedSpeculator(Speculator):
    """After every outcome, the drafter's KV cache holds exactly what reading its tokens from scratch gives."""

    @torch.no_grad()
    def resolve(self, n, token):
        answer = super().resolve(n, token)
        p = self.proposer
        expected = p.sequence[: self.anchor + 1] + self.drafts.tolist()  # the bonus, then drafts it has read
        assert p.cache.get_seq_length() == len(p.read) and p.read == expected[: len(p.read)]
        fresh = DynamicCache()
        p.model(input_ids=torch.tensor([p.read]), cache=fresh, use_cache=True)
        for mine, ref in zip(p.cache.layers, fresh.layers):
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-5)
        return answer


def proposer_for(kind: str, model):
    return PardProposer(model, 4, mask_token_id=3) if kind == "pard" else LMProposer(model, 3)


@pytest.mark.parametrize("kind", ["lm", "pard"])
@pytest.mark.parametrize("backup", ["none", "draft"])
def test_greedy_ssd_is_plain_greedy_decoding_on_hits_and_misses(kind, backup):
    """The target drafting for itself (its guesses are right: hits) and another LM (misses)."""
    from serve_eval.ssd import InlineSpeculation

    target = lm(0)
    prompts = [torch.randint(4, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 12)]
    for drafter, expect in ((target, "hits"), (lm(1), "misses")):
        speculator = CheckedSpeculator(proposer_for(kind, drafter), branches=6, backup=backup)
        with InlineSpeculation(speculator) as speculation:
            for prompt in prompts:
                reference, _ = plain_generate(target, prompt, 40)
                out, stats, verify_ms = ssd_generate(target, speculation, prompt, 40)
                assert out == reference
                assert len(verify_ms) == stats.target_forwards - 2  # every step but the prefill and the last
        s = speculator.stats
        assert s.steps > 0 and (s.hits > s.steps // 2 if expect == "hits" else s.hits < s.steps)
        summary = speculation.summary([1.0] * s.steps)
        assert summary["modeled_separate_device_ms_per_step"] > 0 and 0 <= summary["hit_rate"] <= 1


def _slow_verify(*_) -> None:
    time.sleep(0.01)


def test_a_worker_process_builds_while_the_target_verifies():
    """The worker's cache hits: it builds while the loop verifies. Whether a branch is ready in time is
    a race between the two processes, so the target here verifies slowly (10 ms a forward) and drafts
    from a copy of itself without the delay (the same weights: its drafts are the target's tokens)."""
    target = lm(0, layers=4)
    twin = copy.deepcopy(target)
    target.register_forward_pre_hook(_slow_verify)
    drafter = lm(2, layers=1)
    prompt = torch.randint(4, 64, (8,), generator=torch.Generator().manual_seed(0))
    reference, _ = plain_generate(target, prompt, 48)
    with open_speculation(LMProposer(twin, 3), branches=4, concurrent=True) as speculation:
        for _ in range(2):  # a second prompt on the same worker
            out, stats, _ = ssd_generate(target, speculation, prompt, 48)
            assert out == reference
        summary = speculation.summary()
        assert summary["steps"] > 0 and summary["hit_rate"] > 0
    with open_speculation(LMProposer(drafter, 3), concurrent=True) as speculation:
        assert ssd_generate(target, speculation, prompt, 48)[0] == reference


@pytest.mark.parametrize("kind,backup", [("lm", "none"), ("pard", "draft")])
def test_ssd_samples_the_target_distribution(toy_target, kind, backup):  # noqa: F811
    torch.manual_seed(3)
    drafter = toy_lm(8, 1, 16)
    proposer = PardProposer(drafter, 2, mask_token_id=VOCAB - 1) if kind == "pard" else LMProposer(drafter, 1)
    args = {"temperature": 1.0}
    sampler = Sampler(**args, generator=torch.Generator().manual_seed(1))
    counts = torch.zeros(VOCAB, VOCAB)
    speculator = Speculator(proposer, branches=3, backup=backup)
    from serve_eval.ssd import InlineSpeculation

    with InlineSpeculation(speculator) as speculation:
        for i in range(SAMPLES):
            out, _, _ = ssd_generate(toy_target, speculation, PROMPT, 3, sampler=sampler, seed=i)
            counts[out[1], out[2]] += 1
    assert speculator.stats.hits > 100 and speculator.stats.steps - speculator.stats.hits > 100  # both paths drew
    assert chi_square_pvalue(counts, exact_joint(toy_target, Sampler(**args))) > ALPHA


def test_an_eval_measures_ssd_beside_plain_speculative_decoding():
    from distill.base.decoding import DecodingSection
    from serve_eval.measure import measure

    target = lm(0)
    prompts = [torch.randint(4, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 9)]
    dec = DecodingSection(
        max_new_tokens=24,
        budget={"adaptive": False},
        drafter={"draft_length": 3},
        ssd={"enabled": True, "branches": 4, "concurrent": False},
    )
    report = measure(target, target, prompts, dec, None, lambda i: Sampler(), None)
    ssd = report["ssd"]
    assert report["lossless"] is True and ssd["speculative_decoding"]["tau"] > 1 and ssd["hit_rate"] > 0.5
    sd = ssd[
        "speculative_decoding"
    ]  # the target drafting for itself: every draft kept, 4 tokens a step, 7 forwards a prompt
    assert sd["tau"] == round(2 * 24 / (2 * 7), 4) and report["acceptance_by_position"] == [1.0, 1.0, 1.0]
    assert sd["speedup"] == pytest.approx(sd["tokens_per_s"] / report["baseline_tokens_per_s"], rel=1e-3)
    assert ssd["over_speculative_decoding"] == pytest.approx(report["tokens_per_s"] / sd["tokens_per_s"], rel=1e-3)
    steps = round(2 * 24 / report["tau"]) - 2  # every forward but each prompt's prefill
    modeled = (2 * 24 - 2) / (
        1e-3 * ssd["modeled_separate_device_ms_per_step"] * steps
    )  # tokens a second, drafting apart
    assert ssd["modeled_separate_device_speedup"] == pytest.approx(modeled / report["baseline_tokens_per_s"], rel=1e-3)
    with pytest.raises(ValueError, match="ssd verifies every draft of a chain"):
        DecodingSection(ssd={"enabled": True})  # per-step budgets are on by default


def test_the_shipped_pard_drafter_speculates_losslessly_for_the_testbed_target():
    from transformers import AutoModelForCausalLM

    from distill.config import TargetConfig
    from distill.models import load_target
    from distill.testbed import ASSETS
    from serve_eval.proposers import make_proposer

    target, tok = load_target(TargetConfig(path="testbed"))
    drafter = AutoModelForCausalLM.from_pretrained(ASSETS / "testbed_pard", dtype=torch.float32).eval()
    prompt = torch.tensor(tok("import os\n\n\ndef read_config(path):\n    ")["input_ids"])
    reference, _ = plain_generate(target, prompt, 32)
    for parallel in (True, False):
        proposer = make_proposer(drafter, parallel=parallel)
        assert isinstance(proposer, PardProposer) == parallel
        with open_speculation(proposer, concurrent=False) as speculation:
            out, stats, _ = ssd_generate(target, speculation, prompt, 32)
            assert out == reference and stats.tau > 1.2
