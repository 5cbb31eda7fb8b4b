"""The family matrix: tiny random-weight Llama 3, Qwen3, Gemma 3, Mistral, Qwen3-MoE and gpt-oss targets
(tests/families.py) through the decoding loop. Plain decoding equals transformers' own greedy
``generate`` (what "lossless" rests on); the speculative loop equals plain decoding token for token in
chain, tree and batch mode with every drafter kind, with drafts always rejected and always accepted, and
samples the target's distribution at T = 1; every prompt runs well past the windowed families' window."""

from __future__ import annotations

import pytest
import torch

from distill.config import DrafterSection, TargetConfig
from distill.drafter_eval import build_drafter
from distill.models import load_target
from distill.testbed import SHIPPED_TARGET
from serve_eval.batch import batched_speculative_generate
from serve_eval.budget import Budget
from serve_eval.engine import make_proposer, plain_generate, speculative_generate
from serve_eval.sampling import Sampler

from .families import FAMILIES, WINDOW, WINDOWED, family_model, save_family, save_gemma3_multimodal
from .test_engine import ScriptedProposer
from .test_sampling import ALPHA, chi_square_pvalue

MAX_NEW = 3 * WINDOW
BLOCK_KINDS = ["dflash", "dspark"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED_TARGET)


@pytest.fixture(scope="module")
def targets(tmp_path_factory, tokenizer):
    """Each family saved as a checkpoint folder and loaded the way a recipe loads a target."""
    root = tmp_path_factory.mktemp("families")
    return {name: load_target(TargetConfig(path=str(save_family(name, root / name, tokenizer))))[0] for name in FAMILIES}


def prompts(count: int = 3) -> list[torch.Tensor]:
    """Prompts of different lengths, each longer than the window."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 4000, (WINDOW + 7 + 9 * i,), generator=gen) for i in range(count)]


def drafter(target, kind: str, tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    section = DrafterSection(kind=kind, num_layers=1, block_size=4, num_anchors=8, markov_rank=16)
    return build_drafter(section, target, "tiny", tokenizer.mask_token_id).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_decoding_equals_transformers_generate(targets, family):
    target = targets[family]
    for prompt in prompts(2):
        ours, _ = plain_generate(target, prompt, MAX_NEW)
        theirs = target.generate(prompt[None], max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)[0, len(prompt):]
        assert ours == theirs.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loop_is_lossless_for_every_drafter(targets, tokenizer, family):
    """Chain and tree, with per-step budgets, with every drafter kind, and with scripted drafts that are
    always accepted (the caches keep verified drafts) and always rejected (they roll back past the window)."""
    target = targets[family]
    for prompt in prompts(2):
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        for kind in ("dflash", "dspark", "eagle3"):
            d = drafter(target, kind, tokenizer)
            for mode in ("chain", "tree"):
                assert speculative_generate(target, d, prompt, MAX_NEW, mode=mode)[0] == reference, (kind, mode)
            budget = Budget({1: 1.0, 2: 1.02, 4: 1.3})
            assert speculative_generate(target, d, prompt, MAX_NEW, budget=budget)[0] == reference, (kind, "budget")
        d = drafter(target, "dflash", tokenizer)
        for wrong in (False, True):
            for mode in ("chain", "tree"):
                scripted = ScriptedProposer(reference, len(prompt), 4, target.config.vocab_size, wrong)
                out, stats = speculative_generate(target, d, prompt, MAX_NEW, proposer=scripted, mode=mode, tree_budget=3)
                assert out == reference, (wrong, mode)
                assert stats.tau == 1.0 if wrong else stats.tau > 3.0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pard_lm_of_the_family_drafts_losslessly(targets, tokenizer, family):
    """A one-layer LM of the target's own family (PARD adapts one) drafting K tokens a forward, and one token a forward."""
    target = targets[family]
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    lm = family_model(family, target.config.vocab_size, special, seed=1, num_hidden_layers=2)
    lm.config.pard = {"draft_tokens": 4, "mask_token_id": tokenizer.mask_token_id}
    prompt = prompts(1)[0]
    reference, _ = plain_generate(target, prompt, MAX_NEW)
    for parallel in (True, False):
        proposer = make_proposer(lm, draft_length=3, parallel=parallel)
        assert speculative_generate(target, lm, prompt, MAX_NEW, proposer=proposer)[0] == reference, parallel


@pytest.mark.parametrize("family", FAMILIES)
def test_batches_are_lossless(targets, tokenizer, family):
    """Rows of different lengths, two slots for three prompts (a finished row's slot is reused)."""
    target = targets[family]
    batch = prompts(3)
    references = [plain_generate(target, p, MAX_NEW)[0] for p in batch]
    for kind in BLOCK_KINDS:
        outs, _ = batched_speculative_generate(target, drafter(target, kind, tokenizer), batch, MAX_NEW, slots=2)
        assert outs == references, kind


def toy(family: str):
    """A 6-token family model with a window of 4, peaked enough that its distributions vary."""
    return family_model(family, 6, window=4, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                        max_position_embeddings=64, initializer_range=0.4)


@pytest.mark.parametrize("family", WINDOWED + ["qwen3_moe"])
def test_sampling_follows_the_target_distribution(family):
    """At T = 1 the loop's (2nd, 3rd) tokens after a prompt past the window follow the target's exact joint
    distribution (enumerated), chain and tree (chi-square)."""
    target = toy(family)
    prompt = torch.tensor([1, 2, 3, 4, 5, 0, 1, 2])
    sampler = Sampler(temperature=1.0)
    with torch.no_grad():
        def probs(ids):
            return sampler.probs(target(torch.tensor([ids])).logits[0, -1]).double()

        exact = torch.zeros(6, 6, dtype=torch.float64)
        p1 = probs(prompt.tolist())
        for t1 in range(6):
            p2 = probs(prompt.tolist() + [t1])
            for t2 in range(6):
                exact[t2] += p1[t1] * p2[t2] * probs(prompt.tolist() + [t1, t2])
    torch.manual_seed(0)
    d = build_drafter(DrafterSection(kind="dflash", block_size=3, num_target_layers=2, target_layer_ids=[0, 1]), target, "toy",
                      mask_token_id=5).eval()
    for mode in ("chain", "tree"):
        counts = torch.zeros(6, 6)
        sampler = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(1))
        for _ in range(400):
            out, _ = speculative_generate(target, d, prompt, 3, sampler=sampler, mode=mode, tree_budget=4)
            counts[out[1], out[2]] += 1
        assert chi_square_pvalue(counts, exact) > ALPHA, mode


def test_a_multimodal_gemma3_checkpoint_serves_as_its_text_model(tmp_path, tokenizer):
    """The hub's Gemma 3 checkpoints hold a vision tower beside the language model: the target is the
    language model alone (its decoder and head, the same logits), which drafters build on and the loop decodes."""
    from transformers import AutoModelForCausalLM

    folder = save_gemma3_multimodal(tmp_path / "gemma3_mm", tokenizer)
    full = AutoModelForCausalLM.from_pretrained(folder).eval()
    target, _ = load_target(TargetConfig(path=str(folder)))
    assert type(full).__name__ == "Gemma3ForConditionalGeneration" and type(target).__name__ == "Gemma3ForCausalLM"
    prompt = prompts(1)[0]
    with torch.no_grad():
        assert torch.equal(target(prompt[None]).logits, full(prompt[None]).logits)
    reference, _ = plain_generate(target, prompt, MAX_NEW)
    assert reference == full.generate(prompt[None], max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)[0, len(prompt):].tolist()
    assert speculative_generate(target, drafter(target, "dflash", tokenizer), prompt, MAX_NEW, mode="tree")[0] == reference
