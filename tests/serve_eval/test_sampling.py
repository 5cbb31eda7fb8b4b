"""At temperature > 0 the speculative loop samples from exactly the target's distribution.

A toy target over a 6-token vocabulary makes the exact joint distribution of generated tokens
computable by enumeration; many speculative samples are compared to it with a chi-square test, which
passes for the real verifier and fails for a deliberately broken one (accept every draft)."""

from __future__ import annotations

import contextlib
import itertools
from unittest import mock

import pytest
import torch

from distill.config import DrafterSection, ModelConfig
from distill.drafter_eval import build_drafter
from distill.models import build_causal_lm
from serve_eval import verify as verification
from serve_eval.budget import Budget, DraftSwitch
from serve_eval.kv import KVQuant, inplace_cache
from serve_eval.loop import generate, plain_generate, speculative_generate
from serve_eval.proposers import LMProposer, make_proposer
from serve_eval.sampling import Sampler
from serve_eval.tree import walk_tree
from serve_eval.verify import verify_chain

VOCAB, PROMPT, SAMPLES = 6, torch.tensor([1, 2, 3]), 1000
# a test passes at p > ALPHA: ~30 of them run, their chi-square tails are approximate at these counts, and a
# loop's budget choices follow timing, so the draws differ run to run; every broken variant fails at p < 1e-6
ALPHA = 1e-4
VARIED_COSTS = {1: 1.0, 2: 1.4, 3: 1.7, 6: 2.6}  # seconds per verified tokens: some steps verify 0 drafts, some all


def toy_lm(hidden_size: int, num_layers: int, intermediate_size: int, positions: int = 64):
    """A tiny causal LM over ``VOCAB`` with large weights: peaked, varied distributions."""
    cfg = ModelConfig(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=2,
        intermediate_size=intermediate_size,
        max_position_embeddings=positions,
        initializer_range=0.4,
    )
    return build_causal_lm(cfg, VOCAB).eval()


def toy_parcae():
    """A tiny Parcae model over ``VOCAB`` (one core block, 3 recurrences by default), peaked like :func:`toy_lm`."""
    from parcae import ParcaeConfig, ParcaeForCausalLM

    config = ParcaeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        n_core=1,
        mean_recurrence=3,
        initializer_range=0.4,
    )
    return ParcaeForCausalLM(config).eval()


@pytest.fixture(scope="module")
def toy_target():
    torch.manual_seed(0)
    return toy_lm(16, 3, 32)


def exact_joint(target, sampler: Sampler, kv=None) -> torch.Tensor:
    """P(t2, t3) of the 2nd and 3rd generated tokens, by enumerating t1 (and t2); ``kv``: the target
    reads through that quantized KV cache (serve_eval.kv)."""
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)

    def last(ids: list[int]) -> torch.Tensor:
        cache = None if kv is None else inplace_cache(target.config, kv)
        return target(torch.tensor([ids]), cache=cache, use_cache=kv is not None).logits[0, -1]

    with torch.no_grad():
        prompt = PROMPT.tolist()
        p1 = sampler.probs(last(prompt)).double()
        for t1 in range(VOCAB):
            p2 = sampler.probs(last(prompt + [t1])).double()
            for t2 in range(VOCAB):
                joint[t2] += p1[t1] * p2[t2] * sampler.probs(last(prompt + [t1, t2])).double()
    return joint


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten().double()
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    e = torch.cat([expected[~small], expected[small].sum().view(1)])
    o = torch.cat([observed[~small], observed[small].sum().view(1)])
    keep = e > 0
    stat = ((o[keep] - e[keep]) ** 2 / e[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def accept_everything(sampler, drafts, draft_logits, target_logits):
    return len(drafts), sampler.sample(sampler.probs(target_logits[-1]))


def follow_the_best_child(tree, logits, sampler, probs):
    """A broken tree walk: takes the drafter's first child whatever the target chooses."""
    kids = tree.children()
    path = [0]
    while kids[path[-1]]:
        path.append(min(kids[path[-1]].values()))
    return path, sampler.choose(logits[path[-1]])


def sampled_joint(target, drafter, sampler_args, verify=None, walk=None, plain=False, **kwargs) -> torch.Tensor:
    """Counts of the (2nd, 3rd) tokens of SAMPLES runs; ``verify`` / ``walk``: a chain verifier / tree walk
    put in the loop's place for the runs (a broken one, to show the test's power)."""
    counts = torch.zeros(VOCAB, VOCAB)
    sampler = Sampler(**sampler_args, generator=torch.Generator().manual_seed(1))
    with contextlib.ExitStack() as stack:
        for name, broken in (("verify_chain", verify), ("walk_tree", walk)):
            if broken is not None:
                stack.enter_context(mock.patch.object(verification, name, broken))
        for _ in range(SAMPLES):
            if plain:
                out, _ = plain_generate(target, PROMPT, 3, sampler=sampler, kv=kwargs.get("kv"))
            else:
                out, _ = speculative_generate(target, drafter, PROMPT, 3, sampler=sampler, **kwargs)
            counts[out[1], out[2]] += 1
    return counts


@pytest.mark.parametrize(
    "kind,sampler_args",
    [
        ("dflash", {"temperature": 1.0}),
        ("dspark", {"temperature": 0.8, "top_k": 4}),
        ("eagle3", {"temperature": 1.0, "top_p": 0.9}),
    ],
)
def test_speculative_sampling_matches_the_target_distribution(toy_target, kind, sampler_args, monkeypatch):
    torch.manual_seed(1)
    section = DrafterSection(kind=kind, block_size=3, num_target_layers=3, target_layer_ids=[0, 1, 2])
    drafter = build_drafter(section, toy_target, "toy", mask_token_id=VOCAB - 1).eval()
    exact = exact_joint(toy_target, Sampler(**sampler_args))
    counts = sampled_joint(toy_target, drafter, sampler_args)
    assert chi_square_pvalue(counts, exact) > ALPHA, "speculative samples do not follow the target"
    adaptive = sampled_joint(toy_target, drafter, sampler_args, budget=Budget(VARIED_COSTS))  # chain lengths vary
    assert chi_square_pvalue(adaptive, exact) > ALPHA, "a per-step budget changed the distribution"
    calls = itertools.count()  # a draft switch that skips every third step (plain steps between drafted ones)
    monkeypatch.setattr(DraftSwitch, "should_draft", lambda self: next(calls) % 3 != 0)
    skipping = sampled_joint(toy_target, drafter, sampler_args, budget=Budget(VARIED_COSTS))
    assert chi_square_pvalue(skipping, exact) > ALPHA, "skipped drafts changed the distribution"
    monkeypatch.undo()
    if kind == "dflash":  # the test's power, once (the verifier is shared)
        broken = sampled_joint(toy_target, drafter, sampler_args, verify=accept_everything)
        assert chi_square_pvalue(broken, exact) < 1e-6, "the test cannot tell a broken verifier apart"


def test_an_int8_drafter_samples_the_target_distribution(toy_target):
    """A DFlash drafter served from int8 codes (serve_eval.cpu.int8, every Linear) proposes its own q, which
    drafting and the acceptance test both read: chains and trees sample the target's distribution."""
    from serve_eval.cpu.int8 import int8_drafter

    torch.manual_seed(4)
    section = DrafterSection(kind="dflash", block_size=3, target_layer_ids=[0, 1, 2])
    drafter = build_drafter(section, toy_target, "toy", mask_token_id=VOCAB - 1).eval()
    int8_drafter(drafter, "all")
    args = {"temperature": 1.0}
    exact = exact_joint(toy_target, Sampler(**args))
    assert chi_square_pvalue(sampled_joint(toy_target, drafter, args, budget=Budget(VARIED_COSTS)), exact) > ALPHA
    assert chi_square_pvalue(sampled_joint(toy_target, drafter, args, mode="tree", tree_budget=5), exact) > ALPHA


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_compiled_drafter_samples_the_target_distribution(toy_target, kind, monkeypatch):
    """A block drafter whose drafts come from its compiled graph (serve_eval.cpu.compiled, over fused int8
    products) draws them from the logits the graph returns, which the acceptance test reads: batches of
    two rows, chains (a per-step budget, drafts skipped now and then) and trees sample the target's
    distribution."""
    from serve_eval.cpu import CpuBackend
    from serve_eval.cpu.int8 import int8_drafter

    torch.manual_seed(5)
    section = DrafterSection(kind=kind, block_size=3, target_layer_ids=[0, 1, 2])
    drafter = build_drafter(section, toy_target, "toy", mask_token_id=VOCAB - 1).eval()
    with torch.no_grad():  # flat drafts (small logits), so that drafting the argmax instead of a draw would show
        drafter.norm.weight.mul_(0.1)
    int8_drafter(drafter.fuse_projections(), "all")
    backend = CpuBackend(prepack="off", int8="off", compile="off")
    backend.compile_draft(drafter, len(PROMPT) + 3, sampled=True, rows=(2,))
    graph = backend.draft_graph(drafter)
    args = {"temperature": 1.0, "top_k": 4} if kind == "dspark" else {"temperature": 1.0}
    exact = exact_joint(toy_target, Sampler(**args))
    counts, gens = torch.zeros(VOCAB, VOCAB), [torch.Generator().manual_seed(s) for s in (1, 2)]
    for _ in range(SAMPLES // 2):  # batches of two rows, drafted by the two-row graph
        outs, _ = generate(
            toy_target,
            [PROMPT, PROMPT],
            3,
            samplers=[Sampler(**args, generator=g) for g in gens],
            proposer=make_proposer(drafter, backend=backend),
            backend=backend,
        )
        for out in outs:
            counts[out[1], out[2]] += 1
    assert chi_square_pvalue(counts, exact) > ALPHA
    batched = graph.calls
    calls = itertools.count()
    monkeypatch.setattr(DraftSwitch, "should_draft", lambda self: next(calls) % 4 != 0)
    assert (
        chi_square_pvalue(sampled_joint(toy_target, drafter, args, budget=Budget(VARIED_COSTS), backend=backend), exact)
        > ALPHA
    )
    monkeypatch.undo()
    assert (
        chi_square_pvalue(sampled_joint(toy_target, drafter, args, mode="tree", tree_budget=5, backend=backend), exact)
        > ALPHA
    )
    assert batched > SAMPLES // 4  # the graphs drafted (a sequence's first draft is eager; 3 tokens)
    assert graph.calls - batched > SAMPLES // 10


@pytest.mark.parametrize("args", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 2}])
def test_tree_sampling_matches_the_target_distribution(toy_target, args):
    """Sampled trees walked by recursive rejection sampling; with top-k 2 a node has at most two children
    of positive probability however many the budget would give it."""
    torch.manual_seed(2)
    section = DrafterSection(kind="dflash", block_size=3, target_layer_ids=[0, 1, 2])
    drafter = build_drafter(section, toy_target, "toy", mask_token_id=VOCAB - 1).eval()
    exact = exact_joint(toy_target, Sampler(**args))
    assert chi_square_pvalue(sampled_joint(toy_target, drafter, args, mode="tree", tree_budget=5), exact) > ALPHA
    budget = Budget(VARIED_COSTS)
    assert (
        chi_square_pvalue(sampled_joint(toy_target, drafter, args, mode="tree", tree_budget=5, budget=budget), exact)
        > ALPHA
    )
    assert len(set(budget.chosen)) > 1  # trees of several sizes were verified
    if "top_k" not in args:  # the test's power, once (the walk is shared)
        broken = sampled_joint(toy_target, drafter, args, mode="tree", tree_budget=5, walk=follow_the_best_child)
        assert chi_square_pvalue(broken, exact) < 1e-6


def accept_every_copy(tree, logits, sampler, probs):
    """A broken walk: follows copied (prompt-lookup) nodes from the root whatever the target chooses."""
    drafted, path = tree.drawn, [0]
    while True:
        copied = [i + 1 for i, parent in enumerate(tree.parents.tolist()) if parent + 1 == path[-1] and i >= drafted]
        if not copied:
            break
        path.append(copied[0])
    return (path, sampler.choose(logits[path[-1]])) if len(path) > 1 else walk_tree(tree, logits, sampler, probs)


def seeded_dflash(target):
    """A DFlash drafter of 3-token blocks on the toy target, the same weights each time."""
    torch.manual_seed(5)
    section = DrafterSection(kind="dflash", block_size=3, target_layer_ids=[0, 1, 2])
    return build_drafter(section, target, "toy", mask_token_id=VOCAB - 1).eval()


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lookup_copies_sample_the_target_distribution(toy_target, mode):
    """Prompt-lookup copies grafted onto sampled chains and trees are point-mass proposals in the
    recursive rejection sampling (kept with probability p(x), else p without x): trees with every copy
    and chains with a budget follow the target; a walk that keeps every copy does not. A 6-token
    vocabulary makes copies frequent."""
    drafter, args = seeded_dflash(toy_target), {"temperature": 1.0}
    exact = exact_joint(toy_target, Sampler(**args))
    kwargs = {"mode": mode, "tree_budget": 4, "lookup": 3}
    if mode == "tree":  # every copy grafted, no budget
        assert chi_square_pvalue(sampled_joint(toy_target, drafter, args, **kwargs), exact) > ALPHA
        return
    budget = Budget(VARIED_COSTS)  # chains of varied lengths, as many copied tokens as pay
    assert chi_square_pvalue(sampled_joint(toy_target, drafter, args, budget=budget, **kwargs), exact) > ALPHA
    assert sum(budget.lookup.trials) > budget.lookup.prior * len(budget.lookup.trials)  # copies were verified
    broken = sampled_joint(toy_target, drafter, args, walk=accept_every_copy, **kwargs)
    assert chi_square_pvalue(broken, exact) < 1e-6


def accept_every_copy_chain(sampler, drafts, draft_logits, target_logits):
    """A broken chain verifier: keeps every copied (prompt-lookup) token whatever the target chooses."""
    if draft_logits is None:
        return len(drafts), sampler.choose(target_logits[len(drafts)])
    return verify_chain(sampler, drafts, draft_logits, target_logits)


def test_batched_lookup_copies_sample_the_target_distribution(toy_target, monkeypatch):
    """Rows of a batch whose prompt-lookup copies are grafted onto their drafts (point masses: kept with
    probability p(x), else p without x) follow the target: without a budget (every copy) and with one;
    a verifier and a walk that keep every copy do not."""
    drafter, args = seeded_dflash(toy_target), {"temperature": 1.0}
    exact = exact_joint(toy_target, Sampler(**args))

    def joint(budget=None) -> torch.Tensor:
        counts, gens = torch.zeros(VOCAB, VOCAB), [torch.Generator().manual_seed(s) for s in (1, 2)]
        for _ in range(SAMPLES // 2):
            outs, _ = generate(
                toy_target,
                [PROMPT, PROMPT],
                3,
                samplers=[Sampler(**args, generator=g) for g in gens],
                proposer=make_proposer(drafter),
                budget=budget,
                lookup=4,
            )
            for out in outs:
                counts[out[1], out[2]] += 1
        return counts

    assert chi_square_pvalue(joint(), exact) > ALPHA
    budget = Budget({1: 1.0, 3: 1.3, 6: 2.0}, min_drafts=1)
    assert chi_square_pvalue(joint(budget), exact) > ALPHA
    assert budget.copied_rows and sum(budget.lookup.trials) > budget.lookup.prior * len(budget.lookup.trials)
    monkeypatch.setattr(verification, "verify_chain", accept_every_copy_chain)
    monkeypatch.setattr(verification, "walk_tree", accept_every_copy)
    assert chi_square_pvalue(joint(), exact) < 1e-6, "the test cannot tell a broken verifier apart"


@pytest.mark.parametrize("drafter_kind", ["student", "parcae_self"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_causal_lm_drafters_sample_the_target_distribution(toy_target, drafter_kind, mode):
    """A student drafting for the target, and a Parcae model drafting for itself at T = 1."""
    torch.manual_seed(3)
    if drafter_kind == "student":
        target = toy_target
        drafter = toy_lm(8, 1, 16)
        proposer = LMProposer(drafter, 2)
    else:
        target = drafter = toy_parcae()
        proposer = LMProposer(drafter, 2, num_steps=1)
    args = {"temperature": 1.0}
    exact = exact_joint(target, Sampler(**args))
    tree = {"mode": mode, "tree_budget": 4}
    assert chi_square_pvalue(sampled_joint(target, drafter, args, proposer=proposer, **tree), exact) > ALPHA
    if drafter_kind == "student" and mode == "chain":  # the test's power, once (the verifiers are shared)
        broken = sampled_joint(target, drafter, args, proposer=proposer, verify=accept_everything, **tree)
        assert chi_square_pvalue(broken, exact) < 1e-6


def test_budgets_choose_causally_for_drafts_drawn_one_after_another(monkeypatch):
    """A causal-LM drafter (its next distribution depends on its last draft) with a budget at T = 1
    whose costs make it verify either no draft or both. Choosing that from both drafted positions
    looks, through ``q_2``, at ``d_1`` and biases the output (the test catches it); the causal rule of
    :mod:`serve_eval.budget`, with which the drafter also stops drafting early, does not."""
    from serve_eval import loop, proposers

    torch.manual_seed(3)  # a pair whose bias the test sees at this sample size
    # the loop's clock ticks once a reading: the budget's timed costs and its draft switch (which compares
    # drafted and plain steps' measured rates) then choose the same way however busy the machine is
    ticks = itertools.count()
    monkeypatch.setattr(loop, "device_clock", lambda device: lambda: next(ticks) * 1e-3)
    target = build_causal_lm(
        ModelConfig(
            hidden_size=16,
            num_layers=3,
            num_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
            initializer_range=0.4,
        ),
        VOCAB,
    ).eval()
    drafter = build_causal_lm(
        ModelConfig(
            hidden_size=8,
            num_layers=1,
            num_heads=2,
            intermediate_size=16,
            max_position_embeddings=64,
            initializer_range=0.8,
        ),
        VOCAB,
    ).eval()
    args = {"temperature": 1.0}
    exact = exact_joint(target, Sampler(**args))

    def joint() -> tuple[torch.Tensor, Budget]:
        counts, budget = torch.zeros(VOCAB, VOCAB), Budget({1: 1.0, 2: 1.5, 3: 1.55})
        sampler = Sampler(**args, generator=torch.Generator().manual_seed(1))
        for _ in range(4000):
            out, _ = speculative_generate(
                target, drafter, PROMPT, 3, sampler=sampler, proposer=LMProposer(drafter, 2), budget=budget
            )
            counts[out[1], out[2]] += 1
        return counts, budget

    counts, budget = joint()
    assert chi_square_pvalue(counts, exact) > 1e-3, "a causal budget changed the distribution"  # 4,000 samples
    assert {0, 2} <= set(budget.chosen)
    monkeypatch.setattr(proposers.LMProposer, "incremental", False)  # the best prefix over every drafted position
    monkeypatch.setattr(proposers.LMProposer, "conditional", False)
    assert chi_square_pvalue(joint()[0], exact) < 1e-4, "the test cannot tell a non-causal choice apart"


def test_plain_sampling_matches_too(toy_target):
    """The baseline uses the same sampler; the same test validates the test's own arithmetic."""
    args = {"temperature": 1.0}
    assert (
        chi_square_pvalue(sampled_joint(toy_target, None, args, plain=True), exact_joint(toy_target, Sampler(**args)))
        > ALPHA
    )


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = Sampler(temperature=1.0, top_p=0.7).probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert Sampler(temperature=1.0, top_k=1).probs(torch.tensor([0.1, 2.0, 0.3])).tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "kind,sampler_args", [("dflash", {"temperature": 1.0}), ("dspark", {"temperature": 0.8, "top_k": 4})]
)
def test_batched_speculative_sampling_matches_the_target_per_row(toy_target, kind, sampler_args, monkeypatch):
    """Two rows of the test prompt with a longer one between them (ragged), each row with its own
    generator: both counted rows follow the target's distribution, with every draft verified and with
    a scheduler whose (made-up) costs make it verify varied lengths, over two slots (the third row
    joins when one finishes)."""
    torch.manual_seed(4)
    section = DrafterSection(kind=kind, block_size=3, num_target_layers=3, target_layer_ids=[0, 1, 2])
    drafter = build_drafter(section, toy_target, "toy", mask_token_id=VOCAB - 1).eval()
    exact = exact_joint(toy_target, Sampler(**sampler_args))
    rows = [PROMPT, torch.tensor([4, 1, 0, 2, 3]), PROMPT]

    def joint(budget=None, slots=None) -> torch.Tensor:
        counts = torch.zeros(VOCAB, VOCAB)
        gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
        for _ in range(SAMPLES // 2):
            outs, _ = generate(
                toy_target,
                rows,
                3,
                samplers=[Sampler(**sampler_args, generator=g) for g in gens],
                proposer=make_proposer(drafter),
                budget=budget,
                slots=slots,
            )
            for out in outs[::2]:  # the third row waits for a slot when there are two
                counts[out[1], out[2]] += 1
        return counts

    assert chi_square_pvalue(joint(), exact) > ALPHA, "batched speculative samples do not follow the target"
    budget = Budget({1: 1.0, 3: 1.3, 6: 2.0, 9: 2.4})
    assert chi_square_pvalue(joint(budget, slots=2), exact) > ALPHA, "the budget or slots changed the distribution"
    assert len({n for step in budget.by_rows for n in step}) > 1
    monkeypatch.setattr(verification, "verify_chain", accept_everything)
    assert chi_square_pvalue(joint(), exact) < 1e-6, "the test cannot tell a broken verifier apart"


@pytest.mark.parametrize("kind", ["dflash", "dspark", "eagle3", "dflash per step", "dspark per step"])
def test_draft_vocabularies_keep_the_target_distribution(toy_target, kind):
    """A drafter restricted to half the vocabulary proposes nothing else (q = 0 outside it); the
    samples still follow the target, with and without a per-step budget. Per step (without a budget):
    a vocabulary of one static token plus each row's best under a rank-1 head, subsets that change
    call by call (DSpark's also draw by draw: its Markov term shifts each position's candidates)."""
    from drafters.vocab import restrict_vocab, speculate_vocab

    torch.manual_seed(1)
    section = DrafterSection(kind=kind.split()[0], block_size=3, num_target_layers=3, target_layer_ids=[0, 1, 2])
    drafter = build_drafter(section, toy_target, "toy", mask_token_id=VOCAB - 1).eval()
    if kind.endswith("per step"):
        speculate_vocab(drafter, torch.tensor([0]), candidates=1, rank=1)
    else:
        restrict_vocab(drafter, torch.tensor([0, 2, 3]))
    args = {"temperature": 1.0}
    exact = exact_joint(toy_target, Sampler(**args))
    assert chi_square_pvalue(sampled_joint(toy_target, drafter, args), exact) > ALPHA
    if not kind.endswith("per step"):
        assert chi_square_pvalue(sampled_joint(toy_target, drafter, args, budget=Budget(VARIED_COSTS)), exact) > ALPHA


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_quantized_kv_cache_samples_the_quantized_target(toy_target, mode):
    """With an int4 KV cache the target is another model (serve_eval.kv: here its joint is 0.011 in
    total variation from full precision's, too close for 1,000 samples to tell apart, so that part
    is checked exactly); speculative samples follow that model's distribution, chains and trees."""
    torch.manual_seed(1)
    section = DrafterSection(kind="dflash", block_size=3, num_target_layers=3, target_layer_ids=[0, 1, 2])
    drafter = build_drafter(section, toy_target, "toy", mask_token_id=VOCAB - 1).eval()
    args, kv = {"temperature": 1.0}, KVQuant("int4")
    exact = exact_joint(toy_target, Sampler(**args), kv)
    counts = sampled_joint(toy_target, drafter, args, mode=mode, tree_budget=5, kv=kv, budget=Budget(VARIED_COSTS))
    assert chi_square_pvalue(counts, exact) > ALPHA
    assert (exact - exact_joint(toy_target, Sampler(**args))).abs().sum() / 2 > 5e-3, "int4 left the target unchanged"


@pytest.mark.parametrize("mode", ["chain", "tree", "chain, per-step vocabulary"])
def test_pard_drafts_sample_the_target_distribution(toy_target, mode):
    """A PARD drafter (K drafts from one forward over mask tokens, serve_eval.proposers.PardProposer) at T = 1,
    also with a per-step vocabulary (one static token and the 2 likeliest under a rank-2 head)."""
    from drafters.vocab import speculate_vocab
    from serve_eval.proposers import PardProposer

    torch.manual_seed(3)
    drafter = toy_lm(8, 1, 16)
    if mode.endswith("per-step vocabulary"):
        speculate_vocab(drafter, torch.tensor([0]), candidates=2, rank=2)
        mode = "chain"
    args = {"temperature": 1.0}
    exact = exact_joint(toy_target, Sampler(**args))
    counts = torch.zeros(VOCAB, VOCAB)
    sampler = Sampler(**args, generator=torch.Generator().manual_seed(1))
    for _ in range(SAMPLES):
        out, _ = speculative_generate(
            toy_target,
            drafter,
            PROMPT,
            3,
            sampler=sampler,
            mode=mode,
            tree_budget=4,
            proposer=PardProposer(drafter, 3, VOCAB - 1),
            budget=Budget(VARIED_COSTS),
        )
        counts[out[1], out[2]] += 1
    assert chi_square_pvalue(counts, exact) > ALPHA
