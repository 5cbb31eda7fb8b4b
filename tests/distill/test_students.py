"""Compact students: the divergences mean what they say, distillation lowers the KL to the target, and a
student (transformer or Parcae) drafts for the target in the speculative loop without changing its output."""

from __future__ import annotations

import pytest
import torch

from distill.config import TargetConfig
from distill.kd import evaluate_student, generalized_jsd
from distill.models import load_target
from recipes.registry import parse_recipe
from serve_eval.loop import plain_generate, speculative_generate
from serve_eval.proposers import LMProposer

from ..conftest import reset_accelerate, student_recipe


def test_divergences_match_their_definitions():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11) * 2
    labels = torch.zeros(2, 5, dtype=torch.long)
    labels[1, 3:] = -100  # unscored positions do not count
    p, q = t.log_softmax(-1), s.log_softmax(-1)
    scored = labels != -100
    forward = (p.exp() * (p - q)).sum(-1)[scored].mean()
    reverse = (q.exp() * (q - p)).sum(-1)[scored].mean()
    assert torch.allclose(generalized_jsd(s, t, labels, 0.0, 1.0), forward, atol=1e-5)
    assert torch.allclose(generalized_jsd(s, t, labels, 1.0, 1.0), reverse, atol=1e-5)
    jsd = generalized_jsd(s, t, labels, 0.5, 1.0)
    assert 0 < jsd < min(forward, reverse)
    assert generalized_jsd(t, t, labels, 0.0, 1.0).abs() < 1e-6


@pytest.fixture(scope="module")
def students(tmp_path_factory, tiny_target_dir):
    from transformers import AutoModelForCausalLM

    from recipes import distill_student

    out = {}
    for arch in ("llama", "parcae"):
        folder = tmp_path_factory.mktemp(f"student-{arch}")
        reset_accelerate()
        summary = distill_student.main(student_recipe(folder, tiny_target_dir, arch))
        out[arch] = (AutoModelForCausalLM.from_pretrained(folder / "model").eval(), summary, folder)
    return out


@pytest.mark.parametrize("arch", ["llama", "parcae"])
def test_distillation_lowers_the_kl_to_the_target(students, tiny_target_dir, arch):
    from distill.data import load_text_splits, make_windows
    from distill.models import build_causal_lm

    student, summary, folder = students[arch]
    recipe = student_recipe(folder, tiny_target_dir, arch)
    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    val = make_windows(load_text_splits(recipe.data, 0).val, tok, recipe.data, "val", 0)
    torch.manual_seed(0)
    untrained = build_causal_lm(recipe.student, target.config.vocab_size).eval()
    before = evaluate_student(untrained, target, val, 8, max_batches=6)
    after = evaluate_student(student, target, val, 8, max_batches=6)
    assert after["val_kl"] < 0.6 * before["val_kl"], (before, after)
    assert after["val_agreement"] > before["val_agreement"]
    if arch == "parcae":
        assert [r["recurrence"] for r in summary["recurrence_curve"]] == [1, 2, 4]


@pytest.mark.parametrize("arch", ["llama", "parcae"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_student_drafts_losslessly(students, tiny_target_dir, arch, mode):
    from distill.config import DataConfig
    from distill.data import load_text_splits

    student = students[arch][0]
    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    docs = load_text_splits(DataConfig(source="stdlib", max_documents=40, val_fraction=0.1)).val
    accepted = 0
    for doc in docs[:3]:
        prompt = torch.tensor(tok(doc[:300])["input_ids"][:24])
        reference, _ = plain_generate(target, prompt, 40)
        for steps in (None, 1) if arch == "parcae" else (None,):
            kwargs = {"num_steps": steps} if steps else {}
            out, stats = speculative_generate(
                target, student, prompt, 40, proposer=LMProposer(student, 4, **kwargs), mode=mode, tree_budget=6
            )
            assert out == reference
            accepted += sum(stats.accepted_by_position)
    assert accepted > 0, "a distilled student should get some drafts accepted"


def test_eval_recipe_runs_a_student_and_parcae_self_speculation(students, tmp_path, tiny_target_dir):
    from recipes import evaluate

    student_folder = students["llama"][2] / "model"
    parcae_folder = students["parcae"][2] / "model"
    common = {
        "recipe": "eval",
        "prompts": {"from_corpus": 2, "split": "val", "prompt_tokens": 16},
        "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
    }
    report = evaluate.main(
        parse_recipe(
            {
                **common,
                "output_dir": str(tmp_path / "student"),
                "target": {"path": str(tiny_target_dir)},
                "drafter": str(student_folder),
                "decoding": {"max_new_tokens": 16, "drafter": {"draft_length": 3}},
            }
        )
    )
    assert report["lossless"] is True and len(report["acceptance_by_position"]) == 3
    report = evaluate.main(
        parse_recipe(
            {
                **common,
                "output_dir": str(tmp_path / "self"),
                "target": {"path": str(parcae_folder)},
                "drafter": str(parcae_folder),
                "decoding": {"max_new_tokens": 16, "drafter": {"draft_length": 3, "draft_recurrence": 1}},
            }
        )
    )
    assert report["lossless"] is True and report["drafter_kind"] == "parcae"


def test_a_student_starts_from_the_targets_layers():
    """Layer dropping: with every layer the student is the target; with some, it holds exactly those."""
    from distill.config import ModelConfig, RecipeError
    from distill.models import build_causal_lm, init_from_target_layers

    torch.manual_seed(0)
    cfg = dict(hidden_size=32, num_heads=4, intermediate_size=64, max_position_embeddings=64)
    target = build_causal_lm(ModelConfig(num_layers=3, **cfg), 50).eval()
    whole = build_causal_lm(ModelConfig(num_layers=3, **cfg), 50).eval()
    init_from_target_layers(whole, target, [0, 1, 2])
    ids = torch.randint(0, 50, (1, 12))
    torch.testing.assert_close(whole(ids).logits, target(ids).logits, atol=0, rtol=0)
    two = build_causal_lm(ModelConfig(num_layers=2, **cfg), 50)
    init_from_target_layers(two, target, [0, 2])
    assert torch.equal(two.model.layers[1].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)
    assert torch.equal(two.lm_head.weight, target.lm_head.weight) and torch.equal(
        two.model.norm.weight, target.model.norm.weight
    )
    narrow = build_causal_lm(ModelConfig(num_layers=2, **{**cfg, "hidden_size": 16}), 50)
    with pytest.raises(RecipeError, match="init_from_target_layers: the student's model.embed_tokens.weight"):
        init_from_target_layers(narrow, target, [0, 2])
