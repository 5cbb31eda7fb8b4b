"""The family matrix: tiny random-weight Llama 3, Qwen3, Gemma 3, Mistral, Qwen3-MoE and gpt-oss targets
(tests/families.py) through the decoding loop. Plain decoding equals transformers' own greedy
``generate`` (what "lossless" rests on); the speculative loop equals plain decoding token for token in
chain, tree and batch mode with every drafter kind, with drafts always rejected and always accepted, and
samples the target's distribution at T = 1; every prompt runs well past the windowed families' window."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from distill.config import DrafterSection, TargetConfig
from distill.drafter_eval import build_drafter
from distill.models import load_target
from distill.testbed import SHIPPED_TARGET
from serve_eval.budget import Budget
from serve_eval.loop import generate, plain_generate, speculative_generate
from serve_eval.proposers import make_proposer
from serve_eval.sampling import Sampler

from ..conftest import reset_accelerate
from ..families import FAMILIES, WINDOW, WINDOWED, family_model, save_family, save_gemma3_multimodal
from .test_loop import ScriptedProposer
from .test_sampling import ALPHA, chi_square_pvalue

MAX_NEW = 3 * WINDOW


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED_TARGET)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    """Each family saved as a checkpoint folder, as a hub checkpoint is laid out."""
    root = tmp_path_factory.mktemp("families")
    return {name: save_family(name, root / name, tokenizer) for name in FAMILIES}


@pytest.fixture(scope="module")
def targets(folders):
    """Each family loaded the way a recipe loads its target."""
    return {name: load_target(TargetConfig(path=str(folder)))[0] for name, folder in folders.items()}


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
        theirs = target.generate(prompt[None], max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)[
            0, len(prompt) :
        ]
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
                out, stats = speculative_generate(
                    target, d, prompt, MAX_NEW, proposer=scripted, mode=mode, tree_budget=3
                )
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
    """Rows of different lengths, two slots for three prompts (a finished row's slot is reused), every
    drafter kind, chains and trees (each row's tree masked to its own ancestors, windows cut by position)."""
    target = targets[family]
    batch = prompts(3)
    references = [plain_generate(target, p, MAX_NEW)[0] for p in batch]
    for kind in ("dflash", "dspark", "eagle3"):
        for mode in ("chain", "tree"):
            outs, _ = generate(
                target,
                batch,
                MAX_NEW,
                proposer=make_proposer(drafter(target, kind, tokenizer)),
                slots=2,
                mode=mode,
                tree_budget=3,
            )
            assert outs == references, (kind, mode)


def toy(family: str):
    """A 6-token family model with a window of 4, peaked enough that its distributions vary."""
    return family_model(
        family,
        6,
        window=4,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        max_position_embeddings=64,
        initializer_range=0.4,
    )


@pytest.mark.parametrize("family", WINDOWED + ["qwen3_moe"])
def test_sampling_follows_the_target_distribution(family):
    """At T = 1 the loop's (2nd, 3rd) tokens after a prompt past the window follow the target's exact joint
    distribution (enumerated), chain, tree and batches of trees (chi-square)."""
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
    d = build_drafter(
        DrafterSection(kind="dflash", block_size=3, num_target_layers=2, target_layer_ids=[0, 1]),
        target,
        "toy",
        mask_token_id=5,
    ).eval()
    for mode in ("chain", "tree"):
        counts = torch.zeros(6, 6)
        sampler = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(1))
        for _ in range(400):
            out, _ = speculative_generate(target, d, prompt, 3, sampler=sampler, mode=mode, tree_budget=4)
            counts[out[1], out[2]] += 1
        assert chi_square_pvalue(counts, exact) > ALPHA, mode
    counts = torch.zeros(6, 6)  # batches: eight rows of the prompt, each with its own draws
    for b in range(50):
        samplers = [Sampler(temperature=1.0, generator=torch.Generator().manual_seed(1000 * b + r)) for r in range(8)]
        outs, _ = generate(
            target, [prompt] * 8, 3, samplers=samplers, proposer=make_proposer(d), mode="tree", tree_budget=4
        )
        for out in outs:
            counts[out[1], out[2]] += 1
    assert chi_square_pvalue(counts, exact) > ALPHA, "batch"


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
    assert (
        reference
        == full.generate(prompt[None], max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)[
            0, len(prompt) :
        ].tolist()
    )
    assert (
        speculative_generate(target, drafter(target, "dflash", tokenizer), prompt, MAX_NEW, mode="tree")[0] == reference
    )


def train(recipe: dict):
    from recipes.registry import parse_recipe, run_recipe

    reset_accelerate()
    return run_recipe(parse_recipe(recipe))


def short_run(out, target_dir, recipe: str, **sections) -> dict:
    """Two steps of a training recipe on 12 stdlib files, evaluated and saved once."""
    return {
        "recipe": recipe,
        "output_dir": str(out),
        "seed": 0,
        "target": {"path": str(target_dir)},
        "data": {"source": "stdlib", "seq_len": 64, "max_documents": 12, "val_fraction": 0.1},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {
            "max_steps": 2,
            "micro_batch_size": 4,
            "eval_every": 2,
            "eval_batches": 1,
            "save_every": 2,
            "log_every": 1,
            "torch_threads": 1,
        },
        **sections,
    }


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_drafter_trains_and_exports_behind_the_parity_gate(tmp_path, folders, family):
    """DFlash and DSpark online, EAGLE-3 from an offline feature cache, two steps each against the family's
    target; each exports to every format that can hold it, and the parity gate reloads each from disk and
    passes (equal logits, measured tau as simulated)."""
    from transformers import AutoModel

    for kind, features in (
        ("dflash", {"mode": "online"}),
        ("dspark", {"mode": "online"}),
        ("eagle3", {"mode": "offline", "cache_dir": str(tmp_path / "cache"), "dtype": "float32"}),
    ):
        block = {"qk_norm": True} if kind != "eagle3" else {}
        run = tmp_path / kind
        summary = train(
            short_run(
                run,
                folders[family],
                "train_drafter",
                features={**features, "max_windows": 16},
                drafter={"kind": kind, "num_layers": 1, "block_size": 4, "num_anchors": 8, "markov_rank": 16, **block},
            )
        )
        assert summary["steps"] == 2 and summary["val_simulated_tau"] >= 1.0, (kind, summary)
        manifest = train(
            {
                "recipe": "export",
                "output_dir": str(tmp_path / f"{kind}_export"),
                "seed": 0,
                "drafter": str(run / "checkpoints" / "best"),
                "target": {"path": str(folders[family])},
                "prompts": {"from_corpus": 2, "split": "val", "prompt_tokens": 40},
                "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
                "gate": {"max_new_tokens": 24},
                "torch_threads": 1,
            }
        )
        exported = {fmt for fmt, rec in manifest["formats"].items() if rec["folder"]}
        assert manifest["gate"]["passed"] and exported == (
            {"transformers", "speculators", "sglang_eagle3"} if kind == "eagle3" else {"transformers", "speculators"}
        ), (kind, manifest["formats"])
        assert (
            AutoModel.from_pretrained(tmp_path / f"{kind}_export" / "transformers").config.model_type
            == f"draftsmith_{kind}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_pard_student_of_the_targets_family_trains_and_drafts_losslessly(
    tmp_path, folders, targets, tokenizer, family
):
    """``student.arch: target``: a one-layer student of the target's own family, started from its first layer
    (PARD's layer dropping), distilled with PARD's mask blocks (each windowed layer gets its window), then
    drafting K tokens a forward in the loop."""
    from transformers import AutoModelForCausalLM

    summary = train(
        short_run(
            tmp_path,
            folders[family],
            "distill_student",
            student={"arch": "target", "num_layers": 1},
            init_from_target_layers=[0],
            distill={"divergence": "forward_kl", "ce_weight": 0.0},
            pard={"draft_tokens": 4, "anchors": 4, "keep": 0.6},
        )
    )
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    assert type(student) is type(targets[family]) and student.config.num_hidden_layers == 1 and summary["steps"] == 2
    prompt = prompts(1)[0]
    reference, _ = plain_generate(targets[family], prompt, MAX_NEW)
    assert speculative_generate(targets[family], student, prompt, MAX_NEW)[0] == reference


def test_a_family_the_loop_cannot_run_is_refused_at_validation(tmp_path, folders):
    """Llama 4's chunked-attention layers would be verified with the wrong masks: the eval recipe refuses
    the target before anything loads, naming the layer kind."""
    from transformers import Llama4TextConfig

    from distill.config import RecipeError
    from recipes.registry import parse_recipe

    from ..conftest import REPO

    folder = tmp_path / "llama4"
    folder.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((folders["llama3"] / name).read_bytes())
    Llama4TextConfig(num_hidden_layers=4).save_pretrained(folder)
    with pytest.raises(RecipeError, match="chunked_attention layers; the decoding loop supports"):
        parse_recipe(
            {
                "recipe": "eval",
                "output_dir": str(tmp_path / "out"),
                "target": {"path": str(folder)},
                "drafter": str(REPO / "distill/assets/testbed_dflash"),
                "prompts": {"from_corpus": 2},
                "data": {"source": "stdlib"},
            }
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_static_step_is_lossless(targets, tokenizer, family):
    """The static-shape step (serve_eval.static, eager) over every family: fixed-capacity caches that attend
    every slot through masks (windows cut per layer, by each slot's position in a tree), ragged rows in two
    slots, DFlash, DSpark and EAGLE-3 chains and trees, and scripted drafts always kept (the cache keeps verified drafts) and always refused (rolled back)."""
    from serve_eval import static
    from serve_eval.static import StaticBackend

    backend = StaticBackend(compile="off")
    target = targets[family]
    batch = prompts(3)
    references = [plain_generate(target, p, MAX_NEW)[0] for p in batch]
    assert generate(target, batch, MAX_NEW, backend=backend)[0] == references
    for kind in ("dflash", "dspark", "eagle3"):
        for mode in ("chain", "tree"):
            proposer = make_proposer(drafter(target, kind, tokenizer))
            outs, _ = generate(
                target, batch, MAX_NEW, proposer=proposer, slots=2, mode=mode, tree_budget=5, backend=backend
            )
            assert outs == references, (kind, mode)
    prompt, reference = batch[0], references[0]

    def scripted(wrong: bool):
        def propose(self, bonus, block, samplers, threshold, n):
            i = int(self.lengths[0]) - len(prompt) + 1  # the reference's index of the token after the bonus
            drafts = (torch.tensor((reference + [0] * n)[i : i + n - 1]) + int(wrong)) % target.config.vocab_size
            return torch.cat([bonus[:, None], drafts[None]], dim=1), None, None

        return propose

    d = drafter(target, "dflash", tokenizer)
    for wrong in (False, True):
        with mock.patch.object(static._Group, "_chain_ids", scripted(wrong)):
            out, stats = generate(target, [prompt], MAX_NEW, proposer=make_proposer(d), backend=backend)
        assert out[0] == reference, wrong
        assert stats.prompts[0].tau == 1.0 if wrong else stats.prompts[0].tau > 3.0
