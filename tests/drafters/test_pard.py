"""PARD (drafters.pard): mask blocks train what decoding runs, a PARD student trains and drafts K
tokens a forward, losslessly, greedy and sampled."""

from __future__ import annotations

import pytest
import torch

from distill.config import ModelConfig, PardSection, TargetConfig
from distill.models import build_causal_lm, load_target
from drafters.pard import block_lengths, mask_blocks
from serve_eval.loop import plain_generate, speculative_generate
from serve_eval.proposers import PardProposer, make_proposer

from ..conftest import reset_accelerate, student_recipe

MASK = 5


def test_mask_blocks_attend_to_their_prefix_and_their_own_earlier_masks():
    inputs = torch.arange(10, 20)[None]
    scored = torch.ones(1, 10, dtype=torch.bool)
    scored[0, :3] = False  # a prompt: anchors need a + 1 scored
    blocks = mask_blocks(
        inputs, scored, MASK, draft_tokens=4, anchors=2, keep=1.0, generator=torch.Generator().manual_seed(0)
    )
    L, M = 10, blocks.source.shape[1]
    assert blocks.input_ids[0, L:][blocks.valid[0]].eq(MASK).all() and torch.equal(blocks.input_ids[0, :L], inputs[0])
    attend = blocks.attention_mask[0, 0]
    assert torch.equal(attend[:L, :L], torch.ones(L, L, dtype=torch.bool).tril()) and not attend[:L, L:].any()
    for j in range(M):
        if not blocks.valid[0, j]:
            continue
        source = int(blocks.source[0, j])
        same = [k for k in range(M) if blocks.valid[0, k] and int(blocks.source[0, k]) - k == source - j]  # its block
        depth = same.index(j) + 1
        anchor = source - depth
        assert anchor >= 2 and int(blocks.position_ids[0, L + j]) == source  # a + 1 scored; position a + i
        assert attend[L + j, :L].tolist() == [p <= anchor for p in range(L)]
        assert attend[L + j, L:].nonzero().view(-1).tolist() == [L + k - L for k in same[:depth]]


def test_conditional_drop_keeps_later_masks_geometrically():
    lengths = block_lengths(20000, 7, 0.5, torch.Generator().manual_seed(0))
    share = torch.bincount(lengths, minlength=8)[1:].double() / len(lengths)
    expected = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.015625], dtype=torch.float64)
    assert torch.allclose(share, expected, atol=0.01) and lengths.min() == 1 and lengths.max() == 7


@torch.no_grad()
def test_a_mask_slot_in_training_computes_what_decoding_computes():
    """The training layout (window + appended blocks, one 4D mask) and the decoding forward (the prefix,
    then K - 1 masks after the cached tokens) give the same logits for every draft of a block."""
    torch.manual_seed(0)
    model = build_causal_lm(
        ModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_position_embeddings=64), 40
    ).eval()
    inputs = torch.randint(6, 40, (1, 24))
    scored = torch.zeros(1, 24, dtype=torch.bool)
    scored[0, 12] = True  # one anchor: a = 11
    blocks = mask_blocks(inputs, scored, MASK, 5, 1, 1.0)
    train = model(
        input_ids=blocks.input_ids, position_ids=blocks.position_ids, attention_mask=blocks.attention_mask
    ).logits[0]
    decode = model(input_ids=torch.cat([inputs[0, :12], torch.full((4,), MASK)])[None]).logits[0]
    torch.testing.assert_close(train[[11, 24, 25, 26, 27]], decode[11:16], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def pard_student(tmp_path_factory, tiny_target_dir):
    from transformers import AutoModelForCausalLM

    from recipes import distill_student

    folder = tmp_path_factory.mktemp("pard")
    reset_accelerate()
    recipe = student_recipe(folder, tiny_target_dir, max_steps=80, eval_every=40)
    recipe = recipe.model_copy(update={"pard": PardSection(draft_tokens=4, anchors=8)})
    summary = distill_student.main(recipe)
    return AutoModelForCausalLM.from_pretrained(folder / "model").eval(), summary


def test_a_pard_student_learns_its_mask_drafts(pard_student):
    model, summary = pard_student
    assert model.config.pard["draft_tokens"] == 4
    assert summary["val_pard_simulated_tau"] > 1.0
    assert summary["val_pard_agreement_2"] > 0.0  # mask 1 drafts the token after next, sometimes rightly


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_pard_student_drafts_a_block_a_forward_losslessly(pard_student, tiny_target_dir, mode):
    from distill.config import DataConfig
    from distill.data import load_text_splits
    from serve_eval.budget import Budget

    model = pard_student[0]
    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    docs = load_text_splits(DataConfig(source="stdlib", max_documents=40, val_fraction=0.1)).val
    drafter_forwards, target_forwards, accepted = [], 0, 0
    hook = model.register_forward_hook(lambda *_: drafter_forwards.append(1))
    for doc in docs[:3]:
        prompt = torch.tensor(tok(doc[:300])["input_ids"][:24])
        reference, _ = plain_generate(target, prompt, 40)
        proposer = make_proposer(model)
        assert isinstance(proposer, PardProposer) and proposer.block_size == 5
        out, stats = speculative_generate(
            target, model, prompt, 40, proposer=proposer, mode=mode, tree_budget=6, budget=Budget({1: 1.0, 8: 1.4})
        )
        assert out == reference
        target_forwards += stats.target_forwards - 1  # the prefill drafts nothing
        accepted += sum(stats.accepted_by_position)
    hook.remove()
    assert 0 < len(drafter_forwards) <= target_forwards  # one drafter forward a step at most, whatever K
    assert accepted > 0
