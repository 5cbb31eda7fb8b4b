"""Parcae: stability by construction, truncated backprop, seeded depths, every injection trains,
save/load and cached generation, the train_lm integration (test-time compute curve), and self-speculation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from distill.config import RecipeError
from distill.data import Batch
from parcae import ParcaeConfig, ParcaeForCausalLM, expected_depths, sample_depths
from parcae.model import DiagonalInjection, LinearInjection
from parcae.training import depth_seed, parcae_lm_loss
from recipes.registry import parse_recipe
from serve_eval.loop import plain_generate, speculative_generate
from serve_eval.proposers import LMProposer

from ..conftest import tiny_lm_recipe

VOCAB = 97


def tiny(injection: str = "diagonal", **kw) -> ParcaeForCausalLM:
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        n_prelude=1,
        n_core=2,
        n_coda=1,
        mean_recurrence=3,
        mean_backprop_depth=2,
        injection_type=injection,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    )
    return ParcaeForCausalLM(ParcaeConfig(**{**cfg, **kw}))


def test_a_bar_is_a_contraction_for_random_parameters():
    torch.manual_seed(0)
    inj = DiagonalInjection(512).double()
    for _ in range(50):
        with torch.no_grad():
            inj.A_log.normal_(0, 2)
            inj.dt_bias.normal_(0, 3)
        a_bar = inj.a_bar()
        assert (a_bar >= 0).all() and (a_bar < 1).all()  # 0 only by underflow of exp(-large)
        assert inj.spectral_radius() < 1
    # the linear (Huginn) injection has no such guarantee: scaled up, its state matrix expands
    lin = LinearInjection(16)
    with torch.no_grad():
        lin.adapter.weight.mul_(40)
    assert lin.spectral_radius() > 1


def test_initialisation_follows_the_paper():
    model = tiny()
    assert torch.allclose(model.injection.a_bar(), torch.full((32,), math.sqrt(1 / 5)), atol=1e-6)
    assert torch.equal(model.injection.B.detach(), torch.eye(32))
    # post_init must not overwrite it (transformers re-initialises parameters it does not know)
    reloaded = ParcaeForCausalLM(model.config)
    assert torch.allclose(reloaded.injection.a_bar(), model.injection.a_bar())


def test_no_gradient_reaches_the_no_grad_iterations():
    torch.manual_seed(0)
    model = tiny().train()
    calls = []
    model.core[0].register_forward_hook(lambda m, i, o: calls.append(o.requires_grad))
    x = torch.randint(0, VOCAB, (2, 10))
    out = model(input_ids=x, depths=(torch.tensor([3, 3]), torch.tensor([2, 2])))
    assert calls == [False, False, False, True, True]  # 3 iterations without, then 2 with gradients
    out.logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters()), "every parameter is used by the grad phase"


def test_sequences_stop_at_their_own_depth():
    torch.manual_seed(0)
    model = tiny().eval()
    x = torch.randint(0, VOCAB, (2, 12))
    batched = model(input_ids=x, depths=(torch.tensor([0, 2]), torch.tensor([1, 2]))).logits
    with torch.no_grad():
        alone0 = model(input_ids=x[:1], num_steps=1, use_cache=False).logits
        alone1 = model(input_ids=x[1:], num_steps=4, use_cache=False).logits
    assert torch.allclose(batched[0], alone0[0], atol=1e-5)
    assert torch.allclose(batched[1], alone1[0], atol=1e-5)


def test_depth_sampler_is_seeded_and_has_the_right_mean():
    n, k = sample_depths(20_000, 4, 2, seed=7)
    n2, k2 = sample_depths(20_000, 4, 2, seed=7)
    assert torch.equal(n, n2) and torch.equal(k, k2)
    assert not torch.equal(n, sample_depths(20_000, 4, 2, seed=8)[0])
    total = n + k
    assert (total >= 1).all() and torch.equal(k, total.clamp(max=2)) and (n >= 0).all()
    e_t, e_k = expected_depths(4, 2)
    assert abs(e_t - (4 + math.exp(-4))) < 1e-9  # E[max(1, Poisson(4))]
    assert abs(total.float().mean().item() - e_t) < 0.05 and abs(k.float().mean().item() - e_k) < 0.02
    # the training loss draws the same depths for the same data position (step, micro-batch, rank)
    assert depth_seed(0, 64) == depth_seed(0, 64) != depth_seed(0, 72) != depth_seed(1, 64)


@pytest.mark.parametrize("injection", ["diagonal", "linear", "add"])
def test_every_injection_trains(injection):
    torch.manual_seed(0)
    model = tiny(injection).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = parcae_lm_loss(seed=0)
    batch = Batch(torch.randint(0, VOCAB, (4, 17)))
    losses = []
    for step in range(25):
        batch.first_sample = 4 * step
        loss, logs = loss_fn(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert {"parcae/max_a_bar", "parcae/state_norm", "parcae/rel_change", "parcae/mean_depth"} <= set(logs)
    if injection == "diagonal":
        assert logs["parcae/max_a_bar"] < 1


def test_save_load_round_trip_and_cached_generation(tmp_path):
    torch.manual_seed(0)
    model = tiny().eval()
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(reloaded, ParcaeForCausalLM) and reloaded.config.recurrence == 3
    x = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, reloaded(input_ids=x).logits)
        assert not torch.allclose(model(input_ids=x, num_steps=1).logits, model(input_ids=x).logits)
        for steps in (1, 3, 7):  # 7 is deeper than the config the cache was sized for
            cached = model.generate(x, max_new_tokens=8, do_sample=False, num_steps=steps)
            seq = x
            for _ in range(8):
                nxt = model(input_ids=seq, num_steps=steps, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
            assert torch.equal(cached, seq), steps
    model.config.set_recurrence(5)
    assert model.config.num_hidden_layers == 1 + 2 * 5 + 1


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_self_speculation_is_lossless(mode):
    """A Parcae model drafts at T = 1 and verifies itself at full depth: greedy output unchanged."""
    torch.manual_seed(0)
    model = tiny(initializer_range=0.2).eval()
    prompt = torch.randint(0, VOCAB, (10,))
    reference, _ = plain_generate(model, prompt, 30)
    for draft_steps in (1, 2):
        out, stats = speculative_generate(
            model, model, prompt, 30, proposer=LMProposer(model, 4, num_steps=draft_steps), mode=mode, tree_budget=6
        )
        assert out == reference
    # at full depth the drafter is the target: every draft is accepted
    out, stats = speculative_generate(model, model, prompt, 30, proposer=LMProposer(model, 4), mode="chain")
    assert out == reference and sum(stats.accepted_by_position) == sum(stats.drafted_by_position)


def test_train_lm_trains_parcae_and_writes_the_test_time_curve(tmp_path):
    from recipes import train_lm

    parcae = {
        "prelude_layers": 1,
        "core_layers": 1,
        "coda_layers": 1,
        "mean_recurrence": 2,
        "backprop_depth": 1,
        "eval_recurrences": [1],
    }
    recipe = tiny_lm_recipe(
        tmp_path,
        model={"arch": "parcae", "num_layers": 3, "parcae": parcae},
        train={"max_steps": 8, "eval_every": 8, "eval_batches": 2},
        data={"max_documents": 16},
    )
    summary = train_lm.main(parse_recipe(recipe))
    assert [r["recurrence"] for r in summary["recurrence_curve"]] == [1, 2, 4]
    assert summary["val_loss"] == summary["val_loss_T2"]  # the default depth is the training mean
    assert (tmp_path / "recurrence_curve.png").stat().st_size > 0
    logs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in logs if "train/parcae/max_a_bar" in r]
    assert trained and all(r["train/parcae/max_a_bar"] < 1 for r in trained)
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), ParcaeForCausalLM)


def test_parcae_recipe_errors_name_the_keys(tmp_path):
    bad = tiny_lm_recipe(
        tmp_path,
        model={"arch": "parcae", "num_layers": 3, "parcae": {"prelude_layers": 1, "core_layers": 2, "coda_layers": 1}},
    )
    with pytest.raises(RecipeError, match=r"model.num_layers \(3\) must equal parcae.prelude_layers"):
        parse_recipe(bad)
    with pytest.raises(RecipeError, match="only read when model.arch = parcae"):
        parse_recipe(tiny_lm_recipe(tmp_path, model={"parcae": {"core_layers": 2}}))
    with pytest.raises(RecipeError, match="model.parcae.injection"):
        parse_recipe(
            tiny_lm_recipe(tmp_path, model={"arch": "parcae", "num_layers": 4, "parcae": {"injection": "diag"}})
        )


@pytest.mark.slow
def test_a_killed_parcae_run_resumes_to_identical_weights(tmp_path):
    """The depths a step draws come from its data position, so a SIGKILLed and resumed run draws the
    same ones and ends bit-identical to an uninterrupted run."""
    from safetensors.torch import load_file

    from recipes import train_lm

    from ..conftest import run_cli, write_recipe

    model = {
        "arch": "parcae",
        "num_layers": 3,
        "parcae": {
            "prelude_layers": 1,
            "core_layers": 1,
            "coda_layers": 1,
            "mean_recurrence": 3,
            "backprop_depth": 1,
            "eval_recurrences": [1],
        },
    }
    sections = dict(
        model=model,
        train={"max_steps": 8, "save_every": 4, "eval_every": 8, "eval_batches": 2},
        data={"max_documents": 16},
    )
    train_lm.main(parse_recipe(tiny_lm_recipe(tmp_path / "reference", **sections)))
    path = write_recipe(tmp_path / "r.yaml", tiny_lm_recipe(tmp_path / "killed", **sections))
    assert run_cli("run", str(path), env={"DRAFTSMITH_FAULT": "kill_after_step:6"}).returncode == -9
    resumed = run_cli("run", str(path))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = load_file(str(tmp_path / "reference" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
