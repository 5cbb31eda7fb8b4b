"""The speculative loop is lossless: at temperature 0 it emits exactly the target's greedy tokens,
for every drafter, when every draft is rejected and when every draft is accepted."""

from __future__ import annotations

import itertools

import pytest
import torch

from distill.config import DataConfig, TargetConfig
from distill.data import load_text_splits
from distill.models import load_target
from serve_eval.budget import Budget
from serve_eval.cpu import CpuBackend, prepack
from serve_eval.cpu.attention import available as attention_builds
from serve_eval.engine import Proposer, TargetSession, make_proposer, plain_generate, speculative_generate

from .conftest import reset_accelerate
from .test_drafters import KINDS, drafter_recipe

MAX_NEW = 40


@pytest.fixture(scope="module")
def target_and_prompts(tiny_target_dir):
    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    docs = load_text_splits(DataConfig(source="stdlib", max_documents=40, val_fraction=0.1)).val
    prompts = [torch.tensor(tok(doc[i * 300:i * 300 + 200])["input_ids"][:24]) for i, doc in enumerate(docs[:3])]
    return target, tok, prompts


@pytest.fixture(scope="module")
def trained_drafters(tmp_path_factory, tiny_target_dir):
    from transformers import AutoModel

    from recipes import train_drafter

    out = {}
    for kind in KINDS:
        reset_accelerate()
        folder = tmp_path_factory.mktemp(kind)
        train_drafter.main(drafter_recipe(folder, tiny_target_dir, kind, max_steps=250, eval_every=250))
        out[kind] = AutoModel.from_pretrained(folder / "model").eval()
        out[kind].folder = folder / "model"
    return out


class ScriptedProposer(Proposer):
    """Proposes the baseline's own continuation (always accepted) or a wrong token (always rejected)."""

    def __init__(self, reference: list[int], prompt_len: int, block_size: int, vocab: int, wrong: bool):
        self.reference, self.prompt_len, self.block_size, self.vocab, self.wrong = reference, prompt_len, block_size, vocab, wrong

    def observe(self, aux, start, next_tokens):
        pass

    def propose(self, anchor, anchor_pos, sampler):
        i = anchor_pos - self.prompt_len + 1  # reference index of the token after the anchor
        nxt = (self.reference + [0] * self.block_size)[i:i + self.block_size - 1]
        tokens = (torch.tensor(nxt) + int(self.wrong)) % self.vocab
        return tokens, torch.nn.functional.one_hot(tokens, self.vocab).float() * 100  # trees: the same chain first


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
            out, s = speculative_generate(target, drafter, prompt, MAX_NEW, proposer=scripted, mode=mode, tree_budget=K - 1)
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
    target, _, prompts = target_and_prompts
    ids = prompts[0].view(1, -1)
    rolled = TargetSession(target)
    rolled.forward(ids)
    rolled.forward(torch.tensor([[5, 6, 7, 8]]))
    rolled.rollback(ids.shape[1] + 1)
    fresh = TargetSession(target)
    fresh.forward(torch.cat([ids, torch.tensor([[5]])], dim=1))
    for layer_a, layer_b in zip(rolled.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(layer_a.keys, layer_b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer_a.values, layer_b.values, rtol=1e-5, atol=1e-5)
    # and the next step agrees
    a, _ = rolled.forward(torch.tensor([[9]]))
    b, _ = fresh.forward(torch.tensor([[9]]))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_tree_compaction_equals_recomputing_the_accepted_path(target_and_prompts):
    from distill.base.features import FeatureCapture
    from serve_eval.tree import DraftTree

    target, _, prompts = target_and_prompts
    ids = prompts[0].view(1, -1)
    capture = FeatureCapture(target, [0])
    tree_session = TargetSession(target, capture)
    tree_session.forward(ids)
    # root 5 -> (6 -> 8), (7); accept root, 6, 8
    tree = DraftTree(torch.tensor([6, 7, 8]), torch.tensor([-1, -1, 0]), torch.tensor([1, 1, 2]))
    nodes = torch.tensor([[5, 6, 7, 8]])
    logits, _ = tree_session.forward_tree(nodes, torch.tensor([0, 1, 1, 2]), tree.ancestor_mask())
    tree_session.keep(ids.shape[1], [0, 1, 3])
    fresh = TargetSession(target)
    fresh_logits, _ = fresh.forward(torch.cat([ids, torch.tensor([[5, 6, 8]])], dim=1))
    torch.testing.assert_close(logits[[0, 1, 3]], fresh_logits[-3:], rtol=1e-4, atol=1e-4)
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
    proposer.observe(feats.aux[:, :a - 3], 0, seq[0, 1:a - 2])
    proposer.observe(feats.aux[:, a - 3:a], a - 3, seq[0, a - 2:a + 1])
    from serve_eval.sampling import Sampler

    decoded, logits = proposer.propose(seq[0, a], a, Sampler())
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
        trained = drafter.propose(drafter.block_hidden(feats.aux, seq[:, a:a + 1], torch.tensor([[a]])), seq[:, a:a + 1])[0][0, 0]
    assert torch.equal(decoded, trained)


def test_the_scale_benchmark_pads_the_target_into_the_same_function(tmp_path, tiny_target_dir, trained_drafters):
    """``python -m recipes.bench_scale``, briefly, on the tiny target: the padded copy (MLPs twice as wide,
    the new channels zero, made once and reused) gives the original's logits bit for bit, the eval on it
    stays lossless, its weights are larger; a row per factor, the table and plot written; a recipe that is
    not an eval exits 2."""
    import json

    import yaml
    from transformers import AutoModelForCausalLM

    from recipes.bench_scale import main, pad_mlp

    recipe = tmp_path / "eval.yaml"
    recipe.write_text(yaml.safe_dump({
        "recipe": "eval", "output_dir": str(tmp_path / "unused"), "target": {"path": str(tiny_target_dir)},
        "drafter": str(trained_drafters["dflash"].folder), "prompts": {"from_corpus": 2, "split": "val", "prompt_tokens": 16},
        "decoding": {"max_new_tokens": 16, "cpu": {"compile": "off"}, "batches": {"sizes": [2]}},
        "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1}}))
    out = tmp_path / "out"
    rows = main(["--recipe", str(recipe), "--factors", "2", "1", "--output", str(out)])
    assert [r["factor"] for r in rows] == [1, 2] and all(r["same_logits"] and r["lossless"] for r in rows)
    assert rows[1]["checkpoint_mb"] > rows[0]["checkpoint_mb"] > 0 and rows[1]["verify_over_plain"][1] == 1.0
    for r in rows:
        assert r["speedup_over_tau"] == pytest.approx(r["speedup"] / r["tau"], abs=1e-3) and r["draft_over_plain"] > 0
        assert set(r["batches"]) == {2} and r["batches"][2] > 0
    assert json.loads((out / "scale.json").read_text()) == json.loads(json.dumps(rows))
    assert (out / "scale.png").stat().st_size > 1000
    copy = AutoModelForCausalLM.from_pretrained(out / "targets" / "x2")
    mlp = copy.model.layers[0].mlp
    width = mlp.up_proj.out_features // 2
    assert width == copy.config.intermediate_size // 2 and not mlp.up_proj.weight[width:].any() and not mlp.down_proj.weight[:, width:].any()
    made = (out / "targets" / "x2" / "model.safetensors").stat().st_mtime_ns
    assert pad_mlp(tiny_target_dir, out / "targets" / "x2", 2) == out / "targets" / "x2"  # made once
    assert (out / "targets" / "x2" / "model.safetensors").stat().st_mtime_ns == made
    for bad in (["--recipe", "recipes/configs/dflash_testbed.yaml"], ["--recipe", str(recipe), "decoding.budget.adaptive=false"]):
        with pytest.raises(SystemExit) as exit_:
            main([*bad, "--output", str(out)])
        assert exit_.value.code == 2


@pytest.mark.parametrize("decoding", [{"budget": {"adaptive": False}}, {"mode": "tree", "tree_budgets": [2, 8]},
                                      {"vocab": {"size": 128, "prompts": 4}, "cpu": {"int8": "head"}},
                                      {"vocab": {"size": 96, "prompts": 4, "candidates": 8, "rank": 16}}])
def test_eval_recipe_reports_tau_speedup_and_losslessness(tmp_path, tiny_target_dir, trained_drafters, decoding):
    from recipes import evaluate
    from recipes.registry import parse_recipe

    recipe = parse_recipe({"recipe": "eval", "output_dir": str(tmp_path), "target": {"path": str(tiny_target_dir)},
                           "drafter": str(trained_drafters["dflash"].folder),
                           "prompts": {"from_corpus": 3, "split": "val", "prompt_tokens": 16},
                           "decoding": {"max_new_tokens": 24, **decoding},
                           "peer_assistant": str(tiny_target_dir),  # the target assisting itself: all accepted
                           "peer_prompt_lookup": 3,
                           "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1}})
    report = evaluate.main(recipe)
    for key in ("peer_transformers_assisted", "peer_prompt_lookup"):
        peer = report[key]
        assert peer["same_as_greedy"] is True and peer["tokens_per_s"] > 0 and peer["speedup"] > 0
        assert peer["ours_over_peer"] == pytest.approx(report["tokens_per_s"] / peer["tokens_per_s"], rel=1e-3)
    if decoding.get("budget", {}).get("adaptive", True):  # the budget's cost table and its choices are reported
        adaptive = report["adaptive"]
        assert set(adaptive["verify_ms"]) >= {"1", "3"} and 1 <= adaptive["mean_verified"] <= 9
        histogram = {int(n): c for n, c in adaptive["verified_histogram"].items()}
        assert sum(n * c for n, c in histogram.items()) / sum(histogram.values()) == pytest.approx(adaptive["mean_verified"], abs=1e-3)
        for key in ("predicted", "measured"):  # the cost model's tokens/s beside the steps' own
            row = adaptive[key]
            assert 1.0 <= row["tau"] <= 9 and row["step_ms"] > 0
            assert row["tokens_per_s"] == pytest.approx(1e3 * row["tau"] / row["step_ms"], rel=0.01)
    else:
        assert report["adaptive"] is None
    if "mode" in decoding:
        assert [row["tree_budget"] for row in report["by_budget"]] == [2, 8]
        assert (tmp_path / "tau_speedup_by_budget.png").stat().st_size > 1000
    saved = __import__("json").loads((tmp_path / "report.json").read_text())
    assert saved == report and report["lossless"] is True and report["prompts"] == 3
    assert 1.0 <= report["tau"] <= 4.0 and len(report["acceptance_by_position"]) == 3
    assert report["tokens_per_s"] > 0 and report["baseline_tokens_per_s"] > 0
    assert report["speedup"] == pytest.approx(report["tokens_per_s"] / report["baseline_tokens_per_s"], rel=1e-3)
    split = report["time_split"]
    assert 0 < split["draft_fraction"] < 1 and 0 < split["verify_fraction"] < 1 and report["torch_threads"] == 1
    assert (tmp_path / "acceptance_by_position.png").stat().st_size > 1000
    # auto on the CPU: the target's Linears prepacked (AVX2 panels where they build), every Linear of the drafter in int8 on our kernel
    assert report["target_prepack"]["linears"] == 7 * 4 + 1  # the tiny target: 4 layers
    assert report["target_prepack"]["kernel"] == ("panels" if prepack.panels_available() else "onednn")
    assert report["target_attention"]["kernel"] == ("draftsmith_fp32" if attention_builds() else "sdpa")  # and its attention,
    assert report["draft_attention"] == report["target_attention"]  # and the block drafter's
    assert report["target_forward"] == "lean"  # a Llama target: serve_eval.cpu.lean's walk
    assert report["drafter_int8"]["which"] == decoding.get("cpu", {}).get("int8", "all") and report["drafter_int8"]["kernel"] in ("avx512-vnni", "avx2")
    graph = report["draft_compiled"]  # and the draft compiled as one graph, over caches for 16 + 24 positions and a block
    vocab = decoding.get("vocab", {})
    assert graph["graph"] == "decode_static" + ("" if "candidates" in vocab else " + propose")
    assert graph["cache_positions"] == 16 + 24 + 4 + 1 and graph["graph_drafts"] > 10
    if "size" in vocab:  # the heads restricted to the 128 tokens the target's answers use most
        record = report["draft_vocab"]
        assert record["size"] == vocab["size"] and record["counted_tokens"] == 4 * 24 and 0.5 < record["coverage"] <= 1
    if "candidates" in vocab:  # 96 static tokens and each row's 8 best by a rank-16 head
        per_step = report["draft_vocab"]["per_step"]
        assert per_step == {"static": 96, "candidates": 8, "rank": 16, "size": 104}
        assert report["drafter_int8"]["which"] == "all"  # every Linear but the per-step head, which keeps its rows
        assert type(trained_drafters["dflash"].lm_head).__name__ != "CandidateHead"  # the eval's own copy changed
    elif "cpu" in decoding:  # the restricted head, served from int8 codes of its 128 rows
        int8 = report["drafter_int8"]
        assert int8["which"] == "head" and int8["linears"] == 1 and int8["int8_bytes"] < int8["weight_bytes"] / 3


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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("budget", [1, 6, 24])
def test_greedy_tree_decoding_equals_greedy(target_and_prompts, trained_drafters, kind, budget):
    target, _, prompts = target_and_prompts
    forwards = 0
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        ours, stats = speculative_generate(target, trained_drafters[kind], prompt, MAX_NEW, mode="tree", tree_budget=budget)
        assert ours == reference
        forwards += stats.target_forwards
    # trees of a trained drafter keep drafts (over all prompts: the tiny target's answers can be runs of
    # whitespace on which a 250-step drafter never ranks the right token near the top)
    assert forwards < MAX_NEW * len(prompts) or budget == 1


def test_tree_beats_chain_on_acceptance(target_and_prompts, trained_drafters):
    target, _, prompts = target_and_prompts
    chain = sum(speculative_generate(target, trained_drafters["dflash"], p, MAX_NEW)[1].target_forwards for p in prompts)
    tree = sum(speculative_generate(target, trained_drafters["dflash"], p, MAX_NEW, mode="tree", tree_budget=32)[1].target_forwards
               for p in prompts)
    assert tree <= chain


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


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_batched_decoding_equals_greedy_per_row(target_and_prompts, trained_drafters, kind):
    """Rows of different lengths, a row that stops at EOS early, drafts kept and rejected per row: every
    row emits exactly its own greedy tokens, with every draft verified, with a scheduler that always
    drafts and with one that finds speculation too dear and mostly reads the bonus only, and with
    fewer slots than prompts (waiting prompts join as rows finish)."""
    from serve_eval.batch import BatchScheduler, batched_plain_generate, batched_speculative_generate

    target, _, prompts = target_and_prompts
    drafter = trained_drafters[kind]
    prompts = [prompts[0], prompts[1][:17], prompts[2][:9], prompts[0][:20]]
    first = plain_generate(target, prompts[1], MAX_NEW)[0]
    stop = max(i for i in range(MAX_NEW - 8) if first[i] not in first[:i])
    eos = first[stop]  # row 1 stops early, at its first occurrence of this token
    reference = [plain_generate(target, p, MAX_NEW, eos)[0] for p in prompts]
    assert len(reference[1]) == stop + 1 and len(set(map(len, reference))) > 1
    assert batched_plain_generate(target, prompts, MAX_NEW, eos)[0] == reference
    ours, stats = batched_speculative_generate(target, drafter, prompts, MAX_NEW, eos)
    assert ours == reference
    # two slots: the third and fourth prompts wait, and join a batch whose rows are mid-answer (longer
    # caches, holes) as rows finish; the early EOS frees a slot first
    assert batched_plain_generate(target, prompts, MAX_NEW, eos, slots=2)[0] == reference
    assert batched_speculative_generate(target, drafter, prompts, MAX_NEW, eos, slots=2)[0] == reference
    # a row drafts what it would alone (same context, same positions), so it takes as many steps
    alone = sum(speculative_generate(target, drafter, p, MAX_NEW, eos)[1].target_forwards - 1 for p in prompts)
    assert abs(stats.row_steps - alone) <= len(prompts)
    K = drafter.config.block_size
    cheap = BatchScheduler(Budget({1: 100.0, 4 * K: 100.0}), K)  # reading more costs nothing (drafting ~0): all drafts
    dear = BatchScheduler(Budget({1: 1.0, 2: 100.0, 4 * K: 3000.0}), K)
    for scheduler, slots in ((cheap, None), (dear, None), (cheap, 3)):
        assert batched_speculative_generate(target, drafter, prompts, MAX_NEW, eos, scheduler=scheduler, slots=slots)[0] == reference
    assert {n for step in cheap.chosen for n in step} == {K} and cheap.summary()["drafted_fraction"] == 1.0
    assert {n for step in dear.chosen for n in step} == {1} and dear.summary()["drafted_fraction"] < 0.5  # the off switch, with probes


def test_batched_lookup_copies_equal_greedy(target_and_prompts, trained_drafters):
    """Rows that verify their prompt-lookup copy instead of their drafts (repetitive prompts: copies
    are frequent) emit exactly their own greedy tokens, without a scheduler and with one, over fewer
    slots than prompts; copies longer than the drafts are cut to them (a row reads a block at most);
    the copies' outcomes calibrate the copies' acceptance."""
    from serve_eval.batch import BatchScheduler, batched_speculative_generate

    target, _, prompts = target_and_prompts
    drafter = trained_drafters["dflash"]
    K = drafter.config.block_size
    prompts = [torch.cat([p[:12], p[:12], p[:5]]) for p in prompts[:3]]
    reference = [plain_generate(target, p, MAX_NEW)[0] for p in prompts]
    for lookup in (K - 1, 2 * K):
        assert batched_speculative_generate(target, drafter, prompts, MAX_NEW, lookup=lookup)[0] == reference
        scheduler = BatchScheduler(Budget({1: 1.0, 4 * K: 1.2}), K, min_drafts=1)
        assert batched_speculative_generate(target, drafter, prompts, MAX_NEW, scheduler=scheduler, slots=2, lookup=lookup)[0] == reference
        assert scheduler.copied_rows and scheduler.summary()["copied_fraction"] > 0
        assert sum(scheduler.budget.lookup.trials) > scheduler.budget.lookup.prior * len(scheduler.budget.lookup.trials)
        assert max(n for step in scheduler.chosen for n in step) <= K


def test_a_batch_size_is_judged_before_it_drafts(target_and_prompts, trained_drafters):
    """The up-front prediction for a batch size: a typical row at the measured per-depth acceptance,
    the drafting cost measured at that many rows, against a plain step (batched steps timed at that
    size stand in for the one-row cost table, and scale it for fewer rows). Where a forward costs what its
    tokens cost (compute-bound) drafting cannot pay; where extra tokens are nearly free it does."""
    from serve_eval.batch import BatchScheduler, measure_draft_seconds, measure_step_seconds

    drafter = trained_drafters["dflash"]
    K = drafter.config.block_size
    seconds = measure_draft_seconds(drafter, 4, context=16, repeats=2)
    assert 0 < seconds < 1
    steps = measure_step_seconds(target_and_prompts[0], None, 4, K, context=16, repeats=2)
    assert sorted(steps) == list(range(K + 1)) and all(0 < t < 1 for t in steps.values())  # 0: a plain step
    proxy = Budget({1: 1.0, 4 * K: 2.0})
    dearer = {n: 1.5 * proxy.verify_seconds(4 * n) for n in range(1, K + 1)}
    dearer[2] = 9.0  # one noisy timing: the median ratio ignores it
    measured = BatchScheduler(proxy, K, step_seconds=dearer, rows=4)
    assert measured.verify_seconds(4, 3) == pytest.approx(dearer[3])  # drafted steps: the table x the measured ratio
    assert measured.verify_seconds(2, 3) == pytest.approx(1.5 * proxy.verify_seconds(6))
    assert measured.verify_seconds(2, 1) == proxy.verify_seconds(2)  # no plain step timed: the table's cost
    # the machine ran 3x slower while the batched steps were timed than while the one-row table was:
    # drafted and plain steps, timed in the same rounds, scale alike, and so does the prediction
    slow = BatchScheduler(proxy, K, step_seconds={n: 3 * t for n, t in {**dearer, 0: 1.2 * proxy.verify_seconds(4)}.items()}, rows=4)
    assert slow.verify_seconds(4, 1) == pytest.approx(3 * 1.2 * proxy.verify_seconds(4))
    assert slow.verify_seconds(2, 1) == pytest.approx(3 * 1.2 * proxy.verify_seconds(2))
    assert slow.verify_seconds(4, 3) / slow.verify_seconds(4, 1) == pytest.approx(dearer[3] / (1.2 * proxy.verify_seconds(4)))
    for costs, pays in (({1: 1.0, 4 * K: 4.0 * K}, False), ({1: 1.0, 4 * K: 1.2}, True)):
        budget = Budget(costs)
        for _ in range(50):  # drafts at every depth kept 90% of the time
            budget.record_chain([0.5] * (K - 1), K - 1, K - 1)
            budget.record_chain([0.5] * (K - 1), 1, 0)
        scheduler = BatchScheduler(budget, K)
        scheduler.draft_seconds[4] = 0.05
        assert (scheduler.predicted_speedup(4) > 1) == pays


def test_a_batch_stops_drafting_where_its_own_steps_measure_that_it_does_not_pay():
    """The prediction is optimistic; the loop's measured steps overrule it: after 8 drafted steps whose
    row tokens per second fall below a bare plain step's, 3 plain steps are run, and drafting goes on
    only where it measured faster by the margin; a number of rows with nothing measured goes by the
    prediction."""
    from serve_eval.batch import MEASURED_DRAFTS, MEASURED_PLAIN, BatchScheduler

    K = 4

    def scheduler():  # extra tokens cost nothing and drafting is free: the prediction says draft
        made = BatchScheduler(Budget({1: 1.0, 4 * K: 1.0}), K, min_drafts=1)
        made.draft_seconds[4] = 0.0
        made.choose(torch.full((4, K - 1), 0.9))
        return made

    slow, fast, close = scheduler(), scheduler(), scheduler()
    for made in (slow, fast, close):
        for _ in range(MEASURED_DRAFTS):
            assert made.should_draft(4)
            made.record(4, True, 6, 2.0)  # 3 row tokens a second; a bare plain step (the table's): 4
    for _ in range(MEASURED_PLAIN):  # below the bare step: plain steps, to measure them
        assert not slow.should_draft(4)
        slow.record(4, False, 4, 0.5)
    assert not slow.should_draft(4)  # plain steps measured 8 row tokens a second
    for _ in range(MEASURED_PLAIN):
        fast.record(4, False, 4, 4.0)  # plain steps slower than the bare one: 1 a second
        close.record(4, False, 4, 1.4)  # 2.9 a second: drafted steps are faster, but not by the margin
    assert fast.should_draft(4) and slow.should_draft(3) and not close.should_draft(4)


def test_a_batch_whose_measured_rates_flip_stays_greedy(target_and_prompts, trained_drafters, monkeypatch):
    """Whatever the measured rates say, step after step (here: drafting pays, then not, in turn), every
    row emits exactly its own greedy tokens: the choice picks between two lossless steps."""
    from serve_eval.batch import BatchScheduler, batched_speculative_generate

    target, _, prompts = target_and_prompts
    drafter = trained_drafters["dflash"]
    K = drafter.config.block_size
    turns = itertools.count()
    monkeypatch.setattr(BatchScheduler, "_measured_pays", lambda self, rows: next(turns) % 2 == 0)
    scheduler = BatchScheduler(Budget({1: 1.0, 4 * K: 1.2}), K, min_drafts=1)  # the prediction says draft
    reference = [plain_generate(target, p, MAX_NEW)[0] for p in prompts[:3]]
    assert batched_speculative_generate(target, drafter, prompts[:3], MAX_NEW, scheduler=scheduler, slots=2)[0] == reference
    assert 0 < scheduler.summary()["drafted_fraction"] < 1 and scheduler.measured  # both kinds of step ran, recorded


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
                ours, stats = speculative_generate(target, trained_drafters[kind], prompt, MAX_NEW, mode=mode,
                                                   tree_budget=4, lookup=8, budget=b)
                assert ours == reference, mode
        assert budget.lookup is not None and sum(budget.lookup.trials) > budget.lookup.prior * len(budget.lookup.trials)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_batched_block_drafts_what_each_row_drafts_alone(target_and_prompts, trained_drafters, kind):
    """Rows of different lengths, features appended at once and queued in two parts, and a row that
    starts over as another prompt (its prefill's features, padded) while features of its former
    occupant are still queued: each row's block logits equal the one-row decoding path's (its own
    context, positions and mask)."""
    from distill.base.features import FeatureCapture
    from serve_eval.batch import BatchContext
    from serve_eval.engine import BlockProposer
    from serve_eval.sampling import Sampler

    target, _, prompts = target_and_prompts
    drafter = trained_drafters[kind]
    rows = [prompts[0][:20], prompts[1][:13]]
    capture = FeatureCapture(target, drafter.config.target_layer_ids)
    feats = [capture(p[None]).aux for p in rows]
    context = BatchContext(drafter)
    head, tail = torch.zeros(2, 15, feats[0].shape[-1]), torch.zeros(2, 5, feats[0].shape[-1])
    head[0], head[1, :8] = feats[0][0, :15], feats[1][0, :8]  # row 1 keeps 8 of its 15 slots
    tail[0], tail[1] = feats[0][0, 15:], feats[1][0, 8:]
    context.start(head, torch.tensor([15, 8]))
    context.defer(tail, torch.tensor([5, 5]))  # queued, appended by view()
    lengths, kv = context.view()
    assert lengths.tolist() == [20, 13]
    context.defer(torch.randn(2, 3, feats[0].shape[-1]), torch.tensor([0, 2]))  # row 1's, queued when it finishes
    rows[1] = prompts[2][:17]
    feats[1] = capture(rows[1][None]).aux
    context.put(torch.tensor([1]), torch.cat([feats[1], torch.zeros(1, 3, feats[1].shape[-1])], dim=1), torch.tensor([17]))
    lengths, kv = context.view()
    assert lengths.tolist() == [20, 17]
    anchors = torch.stack([p[-1] for p in rows])[:, None]
    batched = drafter.propose(drafter.block_hidden(None, anchors, lengths[:, None], kv), anchors)[1]
    for i, (p, f) in enumerate(zip(rows, feats)):
        alone = BlockProposer(drafter)
        alone.observe(f, 0, p[1:])
        _, logits = alone.propose(p[-1], len(p), Sampler())
        assert torch.allclose(batched[i, 0], logits, atol=1e-4)


def steps_match_alone(target, batch, alone, steps: int, n: int) -> None:
    """``steps`` steps of ``n`` random tokens a row, each row keeping a random count of them: the
    batch's logits equal those of each row's own session (``alone``) every step."""
    for _ in range(steps):
        ids, counts = torch.randint(0, target.config.vocab_size, (len(alone), n)), torch.randint(1, n + 1, (len(alone),))
        together = batch.step(ids)[0]
        torch.testing.assert_close(together, torch.cat([a.step(ids[i:i + 1])[0] for i, a in enumerate(alone)]), atol=1e-5, rtol=1e-5)
        batch.keep(counts)
        for a, c in zip(alone, counts):
            a.keep(c[None])


def test_batch_rows_read_what_they_read_alone(target_and_prompts):
    """Ragged rows (the prefill pads), each keeping a different number of every step's tokens (the
    rest written over by the next step): every row's logits equal those of its own session."""
    from serve_eval.batch import BatchTarget

    target, _, prompts = target_and_prompts
    rows = [prompts[0][:20], prompts[1][:11], prompts[2][:15]]
    batch, alone = BatchTarget(target), [BatchTarget(target) for _ in rows]
    first = batch.prefill(rows)[0]
    torch.testing.assert_close(first, torch.cat([a.prefill([p])[0] for a, p in zip(alone, rows)]), atol=1e-5, rtol=1e-5)
    torch.manual_seed(0)
    steps_match_alone(target, batch, alone, steps=6, n=5)
    assert batch.lengths.tolist() == [a.lengths.item() for a in alone]


def test_a_prompt_taking_a_finished_rows_place_reads_what_it_reads_alone(target_and_prompts):
    """A prompt prefilled in a group apart takes the place of a row whose cache holds more slots than
    the prompt has tokens (its entries written over, the rest left): from then on every row's logits
    equal those of its own session."""
    from serve_eval.batch import BatchTarget

    target, _, prompts = target_and_prompts
    rows = [prompts[0][:20], prompts[1][:11]]
    batch, alone = BatchTarget(target), [BatchTarget(target), BatchTarget(target)]
    batch.prefill(rows)
    for a, p in zip(alone, rows):
        a.prefill([p])
    torch.manual_seed(0)
    for _ in range(3):  # the first rows decode, keeping some of each step's tokens
        ids, counts = torch.randint(0, target.config.vocab_size, (2, 4)), torch.randint(1, 5, (2,))
        batch.step(ids)
        batch.keep(counts)
        alone[1].step(ids[1:])
        alone[1].keep(counts[1:])
    group = BatchTarget(target)
    first = group.prefill([prompts[1][:5], prompts[2][:9]])[0]
    batch.put(torch.tensor([0]), group, torch.tensor([1]))  # row 0 (20 + ~7 tokens) becomes the 9-token prompt
    alone[0] = BatchTarget(target)
    torch.testing.assert_close(first[1:], alone[0].prefill([prompts[2][:9]])[0], atol=1e-5, rtol=1e-5)
    assert batch.lengths.tolist() == [9, alone[1].lengths.item()]
    steps_match_alone(target, batch, alone, steps=3, n=4)


def test_batches_and_compiled_drafts_refuse_drafters_they_do_not_run(tmp_path, tiny_target_dir, trained_drafters):
    from distill.config import RecipeError
    from recipes import evaluate
    from recipes.registry import parse_recipe

    def recipe(kind, **decoding):
        return parse_recipe({"recipe": "eval", "output_dir": str(tmp_path / kind), "target": {"path": str(tiny_target_dir)},
                             "drafter": str(trained_drafters[kind].folder),
                             "prompts": {"from_corpus": 2, "split": "val", "prompt_tokens": 16},
                             "decoding": {"max_new_tokens": 8, **decoding},
                             "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1}})

    with pytest.raises(RecipeError, match="decoding.batches.sizes: batched decoding runs block drafters"):
        recipe("eagle3", batches={"sizes": [2]})  # refused with the recipe
    with pytest.raises(RecipeError, match="decoding.batches.sizes: 4 rows need at least as many prompts"):
        evaluate.main(recipe("dflash", batches={"sizes": [4]}))
    with pytest.raises(RecipeError, match="decoding.cpu.compile = 'on' compiles a block drafter's draft.*Eagle3Drafter"):
        evaluate.main(recipe("eagle3", cpu={"compile": "on"}))  # a compiled draft is a block drafter's; off / auto: eager
    assert not (tmp_path / "eagle3" / "report.json").exists()  # refused before any compute
    assert evaluate.main(recipe("eagle3", cpu={"compile": False}))["draft_compiled"] == "off"  # a bare YAML off


def test_the_up_front_margin_is_strict_for_short_runs_and_sampled_rows():
    from serve_eval.batch import TAIL_MARGIN, UP_FRONT_MARGIN, up_front_margin

    assert up_front_margin(16, 4, sampled=False) == UP_FRONT_MARGIN < TAIL_MARGIN  # four waves through the slots
    assert up_front_margin(16, 8, sampled=False) == TAIL_MARGIN  # two: the tail is much of the run
    assert up_front_margin(16, 4, sampled=True) == TAIL_MARGIN


def test_an_eval_with_batches_reports_each_size_measured_plain_first_and_last(tmp_path, tiny_target_dir, trained_drafters):
    """``decoding.batches.sizes``: each size decodes every prompt plainly, speculatively, speculatively
    again and plainly again (drift cancels), ``batches.rounds`` times; the row's speedup pools every
    pair, each half is reported, and all eight outputs are the same greedy tokens."""
    from recipes import evaluate
    from recipes.registry import parse_recipe

    recipe = parse_recipe({"recipe": "eval", "output_dir": str(tmp_path), "target": {"path": str(tiny_target_dir)},
                           "drafter": str(trained_drafters["dflash"].folder),
                           "prompts": {"from_corpus": 3, "split": "val", "prompt_tokens": 16},
                           "decoding": {"max_new_tokens": 12, "batches": {"sizes": [2], "rounds": 2}},
                           "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1}})
    [row] = evaluate.main(recipe)["by_batch"]
    assert row["batch"] == 2 and row["prompts"] == 3 and row["rounds"] == 2 and row["lossless"] is True
    assert len(row["speedup_halves"]) == 4 and min(row["speedup_halves"]) <= row["speedup"] <= max(row["speedup_halves"])
    assert 1.0 <= row["tau"] <= 4.0 and row["scheduler"]["predicted_speedup"] > 0
    assert row["scheduler"]["up_front_margin"] == 1.6  # 3 prompts through 2 slots: a run that is mostly its tail


def test_draft_vocabularies_refuse_what_they_cannot_restrict(tmp_path, tiny_target_dir, trained_drafters):
    """A draft vocabulary (static or per step) on a target drafting for itself would change the target;
    a per-step one with an explicit int8 head, or larger than the head, is refused too: each before any
    compute, naming the key."""
    from distill.config import RecipeError
    from recipes import evaluate
    from recipes.registry import parse_recipe

    def recipe(drafter, **decoding):
        return parse_recipe({"recipe": "eval", "output_dir": str(tmp_path), "target": {"path": str(tiny_target_dir)},
                             "drafter": str(drafter), "prompts": {"from_corpus": 2, "split": "val", "prompt_tokens": 16},
                             "decoding": {"max_new_tokens": 8, **decoding},
                             "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1}})

    with pytest.raises(RecipeError, match="decoding.vocab.size = 64: .*the drafter .* is the target"):
        recipe(tiny_target_dir, vocab={"size": 64}, cpu={"int8": "off"})  # refused with the recipe
    with pytest.raises(RecipeError, match="decoding.vocab.candidates = 64: .*the drafter .* is the target"):
        recipe(tiny_target_dir, vocab={"candidates": 64}, cpu={"int8": "off"})
    dflash = trained_drafters["dflash"].folder
    with pytest.raises(RecipeError, match="decoding.cpu.int8 = 'head' with decoding.vocab.candidates"):
        recipe(dflash, vocab={"candidates": 64}, cpu={"int8": "head"})
    with pytest.raises(RecipeError, match="decoding.vocab.candidates = 600 .* do not fit the drafter's 512 x"):
        evaluate.main(recipe(dflash, vocab={"candidates": 600}))
    assert not (tmp_path / "report.json").exists()


def test_the_in_place_cache_holds_what_a_dynamic_cache_holds(target_and_prompts):
    """The loop's target cache (serve_eval.kv) against transformers' own under the calls the loop
    makes: appends across buffer growth, crops, row selection; the same keys, values and logits."""
    from transformers import DynamicCache

    from serve_eval.kv import inplace_cache

    target = target_and_prompts[0]
    gen = torch.Generator().manual_seed(0)
    ours, theirs = inplace_cache(target.config), DynamicCache(config=target.config)
    length = 0
    for n, crop, rows in [(3, 0, None), (40, 5, None), (1, 0, [0, 2]), (70, 30, None), (8, 7, [1])]:
        batch = theirs.layers[0].keys.shape[0] if length else 3
        ids = torch.randint(0, target.config.vocab_size, (batch, n), generator=gen)
        pos = torch.arange(length, length + n)[None].expand(batch, -1)
        a = target(input_ids=ids, position_ids=pos, cache=ours, use_cache=True).logits
        b = target(input_ids=ids, position_ids=pos, cache=theirs, use_cache=True).logits
        assert torch.allclose(a, b, atol=1e-5)
        for cache in (ours, theirs):
            cache.crop(-crop)
            if rows is not None:
                for layer in cache.layers:
                    layer.batch_select_indices(torch.tensor(rows))
        length += n - crop
        assert ours.get_seq_length() == theirs.get_seq_length() == length
        for mine, ref in zip(ours.layers, theirs.layers):
            assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)


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
    proposer.propose = lambda *a, **k: (lambda out: drafted.append(out[0]) or out)(inner(*a, **k))
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        proposer.begin(prompt)
        assert speculative_generate(target, drafter, prompt, MAX_NEW, proposer=proposer)[0] == reference
        assert speculative_generate(target, drafter, prompt, MAX_NEW, mode="tree", budget=Budget({1: 1.0, 16: 1.3}))[0] == reference
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
    head.select = lambda x, shift=None: (lambda ids: subsets.append(ids) or ids)(select(x, shift))
    proposer = make_proposer(drafter)
    inner = proposer.propose

    def propose(*args, **kwargs):  # a draft's tokens against the subsets its head calls chose (one a position or a block)
        start = len(subsets)
        out = inner(*args, **kwargs)
        drafted.append((out[0], torch.cat(subsets[start:])))
        return out

    proposer.propose = propose
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        proposer.begin(prompt)
        assert speculative_generate(target, drafter, prompt, MAX_NEW, proposer=proposer)[0] == reference
        assert speculative_generate(target, drafter, prompt, MAX_NEW, mode="tree", budget=Budget({1: 1.0, 16: 1.3}))[0] == reference
    assert all(bool(torch.isin(tokens, ids).all()) for tokens, ids in drafted), "a token outside its subsets was drafted"
    assert len({tuple(ids.tolist()) for ids in subsets}) > 1 and all(len(ids) == head.summary()["size"] for ids in subsets)


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_kv_caches_stay_lossless(target_and_prompts, trained_drafters, kind):
    """With the target's KV cache quantized (serve_eval.kv), greedy chains and trees (with a budget)
    emit exactly what plain decoding with the same quantized cache emits, for every format, and so
    do batches of rows of different lengths (block drafters), with a prompt taking a finished row's
    place too; the quantized cache does change the
    target's logits (it is in use)."""
    from serve_eval.batch import batched_speculative_generate
    from serve_eval.kv import KVQuant

    target, tok, prompts = target_and_prompts
    drafter = trained_drafters[kind]
    for kv in (KVQuant("int8"), KVQuant("fp8"), KVQuant("int4"), KVQuant("int4", rotate=True)):
        full, quantized = TargetSession(target).forward(prompts[0][None]), TargetSession(target, kv=kv).forward(prompts[0][None])
        assert not torch.allclose(full[0], quantized[0], atol=1e-4)
        for prompt in prompts:
            reference, _ = plain_generate(target, prompt, MAX_NEW, kv=kv)
            assert speculative_generate(target, drafter, prompt, MAX_NEW, kv=kv)[0] == reference
            assert speculative_generate(target, drafter, prompt, MAX_NEW, mode="tree", kv=kv,
                                        budget=Budget({1: 1.0, 16: 1.3}))[0] == reference
        if kind != "eagle3":
            rows = [prompts[0], prompts[1][:17], prompts[2][:9]]
            expected = [plain_generate(target, p, MAX_NEW, kv=kv)[0] for p in rows]
            for slots in (None, 2):  # 2: the third prompt takes a finished row's place, codes copied in place
                assert batched_speculative_generate(target, drafter, rows, MAX_NEW, kv=kv, slots=slots)[0] == expected


def test_served_records_feed_the_drafter_recipe_and_kv_quality_is_reported(tmp_path, tiny_target_dir, trained_drafters):
    """Online adaptation: an eval with record_served writes each prompt and the answer served (the
    target's own: equal to plain decoding) in regenerate's record form, and a drafter recipe keeps
    training the drafter on those records. The same eval with an int8 KV cache reports kv_quality."""
    import json

    from recipes import evaluate, train_drafter
    from recipes.registry import parse_recipe

    from .test_drafters import drafter_recipe

    folder = trained_drafters["dflash"].folder
    recipe = parse_recipe({"recipe": "eval", "output_dir": str(tmp_path / "serve"), "target": {"path": str(tiny_target_dir)},
                           "drafter": str(folder), "record_served": True,
                           "prompts": {"from_corpus": 4, "split": "train", "prompt_tokens": 16},
                           "decoding": {"max_new_tokens": 24, "kv": {"format": "int8"}},
                           "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1}})
    report = evaluate.main(recipe)
    quality = report["kv_quality"]
    assert quality["format"] == "int8" and quality["bytes_per_token"]["quantized"] < 0.3 * quality["bytes_per_token"]["full"]
    assert abs(quality["nll"]["quantized"] - quality["nll"]["full"]) < 0.05 and 0 < quality["same_tokens_share"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "serve" / "served.jsonl").read_text().splitlines()]
    target, _ = load_target(TargetConfig(path=str(tiny_target_dir)))
    from serve_eval.kv import KVQuant

    for row in rows:
        plain, _ = plain_generate(target, torch.tensor(row["prompt_ids"]), 24, target.config.eos_token_id, kv=KVQuant("int8"))
        assert row["response_ids"] + ([target.config.eos_token_id] if row["eos"] else []) == plain
        assert row["tau"] >= 1.0 and len(row["accepted_by_position"]) == 3
    assert len(rows) == 4
    reset_accelerate()
    adapt = drafter_recipe(tmp_path / "adapt", tiny_target_dir, "dflash", {"init_from": str(folder)}, max_steps=6, eval_every=6)
    data = adapt.data.model_copy(update={"source": "files", "format": "prompt_response",
                                         "train_files": [str(tmp_path / "serve" / "served.jsonl")], "max_documents": None})
    summary = train_drafter.main(adapt.model_copy(update={"data": data}))
    assert summary["steps"] == 6


@pytest.mark.parametrize("kind", KINDS)
def test_a_prepacked_target_stays_lossless(target_and_prompts, trained_drafters, kind):
    """A target served from weights prepacked once (serve_eval.cpu.prepack: the AVX2 panel kernel where it
    builds, else oneDNN's) is the target both loops decode with: its logits are the float Linears' up to summation order, and greedy chains, trees and
    batches still equal its own plain decoding."""
    import copy

    from drafters import is_block_drafter
    from serve_eval.batch import BatchScheduler, batched_speculative_generate
    from serve_eval.cpu.prepack import prepack_linears

    target, tok, prompts = target_and_prompts
    packed = copy.deepcopy(target)
    record = prepack_linears(packed)
    assert record["linears"] == 7 * target.config.num_hidden_layers + 1  # q, k, v, o, gate, up, down; the head
    ids = torch.cat(prompts)[None]
    with torch.no_grad():
        assert torch.allclose(packed(ids).logits, target(ids).logits, rtol=1e-4, atol=1e-4)
    drafter = trained_drafters[kind]
    references = [plain_generate(packed, prompt, MAX_NEW)[0] for prompt in prompts]
    for prompt, reference in zip(prompts, references):
        assert speculative_generate(packed, drafter, prompt, MAX_NEW)[0] == reference
        assert speculative_generate(packed, drafter, prompt, MAX_NEW, mode="tree", budget=Budget({1: 1.0, 16: 1.3}))[0] == reference
    if is_block_drafter(drafter):  # batches run block drafters
        assert batched_speculative_generate(packed, drafter, prompts, MAX_NEW)[0] == references
        # rows that verify different numbers of tokens: the panel kernel skips the padding (prepack.only_rows)
        K = drafter.config.block_size

        class Ragged(BatchScheduler):  # every step's rows read 1..K tokens, whatever the drafts' confidences
            def choose(self, top_q, causal=False, copies=None):
                _, copied = super().choose(top_q, causal, copies)
                return torch.tensor([1 + (self.drafted_steps + r) % K for r in range(len(top_q))]), copied

        scheduler = Ragged(Budget({1: 1.0, 2: 1.05, 4 * K: 2.5}), K, min_drafts=10**6)
        assert batched_speculative_generate(packed, drafter, prompts, MAX_NEW, scheduler=scheduler)[0] == references
        assert any(len(set(step)) > 1 for step in scheduler.chosen)


@pytest.mark.parametrize("kind", [*KINDS, "causal_lm"])
def test_int8_drafters_stay_lossless(target_and_prompts, trained_drafters, kind):
    """A drafter served with int8 weights (serve_eval.cpu.int8; a causal LM: the target itself, its head in
    int8; block drafters with fused products) is another drafter: greedy chains and trees still equal plain decoding."""
    import copy

    from serve_eval.cpu.int8 import Int8Linear, int8_drafter

    target, tok, prompts = target_and_prompts
    drafter = copy.deepcopy(target if kind == "causal_lm" else trained_drafters[kind])
    if kind in ("dflash", "dspark"):  # served as the eval serves them: fused products, then int8 codes
        drafter.fuse_projections()
    record = int8_drafter(drafter, "head" if kind == "causal_lm" else "all")
    assert record["int8_bytes"] < record["weight_bytes"] / 3 and isinstance(drafter.lm_head, Int8Linear)
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        assert speculative_generate(target, drafter, prompt, MAX_NEW)[0] == reference
        assert speculative_generate(target, drafter, prompt, MAX_NEW, mode="tree", budget=Budget({1: 1.0, 16: 1.3}))[0] == reference


def close_to_rounding_or_an_int8_step(actual, expected, tight: list) -> None:
    """A compiled draft against the eager one: equal to rounding, except where a rounding moved an
    activation across an int8 code boundary, which moves that product by about one quantization step
    (~1e-3 here; a wrong slot or position would move values by ~1). Every element within 1% of the
    largest magnitude; ``tight`` records whether all were within 1e-4 (on this machine one draft in
    ~150 was not, at 1.5e-3 to 6e-3)."""
    if expected is None:
        assert actual is None
        return
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-2 * max(1.0, float(expected.abs().max())))
    tight.append(torch.allclose(actual, expected, rtol=1e-4, atol=1e-4))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_compiled_drafts_equal_eager_ones_and_stay_lossless(target_and_prompts, trained_drafters, kind, monkeypatch):
    """A block drafter's draft compiled as one graph (serve_eval.cpu.compiled, over the fused int8 drafter
    the eval serves) gives each step the eager draft's block and greedy proposal (DSpark's chain after
    the graph's own drafts), to rounding; greedy chains and trees still equal plain decoding, and a
    sequence longer than the graph's caches drafts eagerly past them."""
    import copy

    from serve_eval.cpu import compiled
    from serve_eval.cpu.int8 import int8_drafter

    target, tok, prompts = target_and_prompts
    drafter = copy.deepcopy(trained_drafters[kind]).fuse_projections()
    int8_drafter(drafter, "all")
    backend = CpuBackend(prepack="off", int8="off", compile="off")
    record = backend.compile_draft(drafter, max(len(p) for p in prompts) + MAX_NEW)
    assert record["graph"] == "decode_static + propose" and record["sampled_proposal"] == (kind == "dflash")
    graph_call, counts, tight = compiled.CompiledDraft.__call__, [], []

    def checked(self, anchor, cache, arrived, propose):  # the eager block from a copy of the same cache, beside the graph's
        eager_cache = copy.deepcopy(cache)
        reference = drafter.decode_hidden(anchor, cache.length + arrived.shape[1], eager_cache, arrived)
        hidden, proposal = graph_call(self, anchor, cache, arrived, propose)
        close_to_rounding_or_an_int8_step(hidden, reference, tight)
        assert cache.length == eager_cache.length and propose
        tokens, logits, confidence = proposal  # greedy: each position's logits after the graph's own drafts
        drafts = iter(tokens.unbind(-1))  # the eager proposal over the graph's block, fed the graph's drafts
        _, expected, expected_confidence = drafter.propose(hidden, anchor.view(1, 1), lambda _: next(drafts))
        close_to_rounding_or_an_int8_step(logits, expected, tight)
        close_to_rounding_or_an_int8_step(confidence, expected_confidence, tight)  # DFlash: None, None
        assert torch.equal(tokens, logits.argmax(-1))
        counts.append(arrived.shape[1])
        return hidden, proposal

    monkeypatch.setattr(compiled.CompiledDraft, "__call__", checked)
    for prompt in prompts:
        reference, _ = plain_generate(target, prompt, MAX_NEW)
        assert speculative_generate(target, drafter, prompt, MAX_NEW, backend=backend)[0] == reference
        assert speculative_generate(target, drafter, prompt, MAX_NEW, budget=Budget({1: 1.0, 8: 1.2}), backend=backend)[0] == reference
        assert speculative_generate(target, drafter, prompt, MAX_NEW, mode="tree", budget=Budget({1: 1.0, 16: 1.3}),
                                    backend=backend)[0] == reference
    assert len(counts) > 20 and len(set(counts)) > 2  # the graph drafted, after steps that kept various counts
    assert sum(tight) >= 0.95 * len(tight)
    longer, before = torch.cat([prompts[0]] * 3), len(counts)  # past the graph's caches: eager, still lossless
    assert speculative_generate(target, drafter, longer, MAX_NEW, backend=backend)[0] == plain_generate(target, longer, MAX_NEW)[0]
    assert len(counts) == before


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_batches_draft_from_the_compiled_graph_and_stay_lossless(target_and_prompts, trained_drafters, kind, monkeypatch):
    """A drafter compiled for batches of two and three rows: batched greedy decoding (every draft
    verified or a scheduler's choice, rows of different lengths, fewer slots than prompts, rows leaving
    and joining) drafts from the graph whenever the batch has a compiled size, each graph draft equal
    to the eager decode_static on the same buffers, and every row equals plain decoding."""
    import copy

    from serve_eval.batch import BatchScheduler, batched_speculative_generate
    from serve_eval.cpu import compiled
    from serve_eval.cpu.int8 import int8_drafter

    target, _, prompts = target_and_prompts
    prompts = [prompts[0], prompts[1][:17], prompts[2][:9], prompts[0][:20]]
    drafter = copy.deepcopy(trained_drafters[kind]).fuse_projections()
    int8_drafter(drafter, "all")
    # 3 rows, and 2 as the tail of 3 (rows finish apart): every count below the smallest batch gets a graph
    backend = CpuBackend(prepack="off", int8="off", compile="off")
    assert backend.compile_draft(drafter, max(map(len, prompts)) + MAX_NEW, rows=(3,))["rows"] == [1, 2, 3]
    assert backend.draft_graph(drafter).warmed == {(1, True), (2, True), (3, True)}  # each graph compiled up front
    graph_run, rows_seen, tight = compiled.CompiledDraft.run, [], []

    def checked(self, anchors, counts, arriving, keys, values, propose):
        copies, guarded_copies = [b.clone() for b in keys + values], [b.clone() for b in keys + values]
        features = arriving.new_zeros(len(anchors), self.block_size, arriving.shape[2])
        features[:, :arriving.shape[1]] = arriving
        reference = drafter.decode_static(anchors, counts, features, copies[:len(keys)], copies[len(keys):])
        guarded = self.graph(drafter, anchors, counts, features, guarded_copies[:len(keys)], guarded_copies[len(keys):], propose)
        hidden, proposal = graph_run(self, anchors, counts, arriving, keys, values, propose)  # its graph's guards only: the same bits
        assert torch.equal(hidden, guarded[0]) and all(torch.equal(a, b) for a, b in zip(keys + values, guarded_copies))
        close_to_rounding_or_an_int8_step(hidden, reference, tight)
        rows_seen.append(len(anchors))
        return hidden, proposal

    monkeypatch.setattr(compiled.CompiledDraft, "run", checked)
    reference = [plain_generate(target, p, MAX_NEW)[0] for p in prompts]
    K = drafter.config.block_size
    for slots, scheduler in ((3, None), (2, None), (3, BatchScheduler(Budget({1: 1.0, 2: 1.1, 4 * K: 3.0}), K))):
        assert batched_speculative_generate(target, drafter, prompts, MAX_NEW, slots=slots, scheduler=scheduler,
                                            backend=backend)[0] == reference
    assert rows_seen.count(3) > 5 and rows_seen.count(2) > 5 and set(rows_seen) == {1, 2, 3}  # a last row: the one-row graph
    assert sum(tight) >= 0.95 * len(tight)


def test_a_batch_drafts_through_its_graph_after_steps_that_did_not_draft(trained_drafters, monkeypatch):
    """Steps that do not draft (a batch decoding plainly between the off switch's probes) queue a feature
    a row each; the next draft appends them in one product and drafts through the compiled graph, giving
    the drafts the eager path gives from the same context (rows of different lengths)."""
    import copy

    from serve_eval.batch import BatchContext
    from serve_eval.cpu import compiled

    drafter = copy.deepcopy(trained_drafters["dflash"]).fuse_projections()  # as the loops serve it
    eager = copy.deepcopy(drafter)  # never compiled: its context drafts eagerly
    backend = CpuBackend(prepack="off", int8="off", compile="off")
    backend.compile_draft(drafter, 48, rows=(2,))
    calls, run = [], compiled.CompiledDraft.run
    monkeypatch.setattr(compiled.CompiledDraft, "run", lambda self, *args: calls.append(len(args[0])) or run(self, *args))
    torch.manual_seed(0)
    width = drafter.fc.in_features
    start, steps, anchors = torch.randn(2, 12, width), [torch.randn(2, 1, width) for _ in range(5)], torch.tensor([[3], [7]])
    drafts = []
    for d in (drafter, eager):
        context = BatchContext(d, backend)
        context.start(start, torch.tensor([12, 9]))
        for features in steps:
            context.defer(features, torch.ones(2, dtype=torch.long))
        drafts.append(context.draft(anchors, lambda x: x.argmax(-1), greedy=True))
        assert context.lengths.tolist() == [17, 14] and not context.pending
    assert calls == [2]  # the compiled drafter's one draft, through the graph
    torch.testing.assert_close(drafts[0][1], drafts[1][1], atol=1e-4, rtol=1e-4)
    assert torch.equal(drafts[0][0], drafts[1][0])


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_one_row_drafts_through_its_graph_after_more_than_a_block_of_features(trained_drafters, kind, monkeypatch):
    """One row's draft after more than K verified features (a prompt's, or steps that did not draft)
    reads all but the last K into the context first and drafts through the compiled graph: the drafts
    of the eager path from the same features (its one forward over them all), the same context length."""
    import copy

    from serve_eval.cpu import compiled
    from serve_eval.engine import BlockProposer
    from serve_eval.sampling import Sampler

    drafter = copy.deepcopy(trained_drafters[kind]).fuse_projections()  # as the loops serve it
    eager = copy.deepcopy(drafter)
    backend = CpuBackend(prepack="off", int8="off", compile="off")
    backend.compile_draft(drafter, 48)
    calls, run = [], compiled.CompiledDraft.run
    monkeypatch.setattr(compiled.CompiledDraft, "run", lambda self, *args: calls.append(args[2].shape[1]) or run(self, *args))
    torch.manual_seed(0)
    K = drafter.config.block_size
    features = [torch.randn(1, 3 * K + 2, drafter.fc.in_features), torch.randn(1, K + 1, drafter.fc.in_features)]
    drafts = []
    for d in (drafter, eager):
        proposer, out, position = BlockProposer(d, backend=backend), [], 0
        for chunk, anchor in zip(features, (5, 9)):  # a prompt's features, then a step's too many
            proposer.observe(chunk, position, None)
            position += chunk.shape[1]
            out.append(proposer.propose(torch.tensor(anchor), position, Sampler()))
            assert proposer.context.length == position
        drafts.append(out)
    assert calls == [K, K]  # both drafts through the graph, each reading the last K features
    for (tokens, logits), (eager_tokens, eager_logits) in zip(*drafts):
        torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(tokens, eager_tokens)


def test_each_compiled_drafter_has_a_graph_of_its_own():
    """Two drafters alike in every shape, one with causal blocks and one with bidirectional ones, each
    compiled (serve_eval.cpu.compiled drops Dynamo's guards on a drafter's modules, so a graph shared between
    them would give one the other's mask): each draft equals its own drafter's eager one."""
    import copy

    from drafters.cache import ContextCache

    from .conftest import tiny_dflash

    torch.manual_seed(0)
    aux = torch.randn(1, 40, 32)
    for attention in ("causal", "bidirectional"):
        drafter = tiny_dflash(attention)
        backend = CpuBackend(prepack="off", int8="off", compile="off")
        backend.compile_draft(drafter, 32)
        graph = backend.draft_graph(drafter)
        cache = ContextCache(spare=4, capacity=graph.positions)
        with torch.inference_mode():
            drafter.decode_hidden(torch.tensor(3), 10, cache, aux[:, :10])
            eager = copy.deepcopy(cache)
            assert graph.fits(cache.keys, cache.length + 3, 3)
            hidden, _ = graph(torch.tensor(7), cache, aux[:, 10:13], propose=False)
            torch.testing.assert_close(hidden, drafter.decode_hidden(torch.tensor(7), 13, eager, aux[:, 10:13]), rtol=1e-4, atol=1e-4)
