"""serve_eval.cpu.attention: the C++ attention for few queries computes torch's attention (bool, float and
causal masks, grouped heads, batches, strided cache views), gives a query the same bits whatever
queries share the call, zeros where a query may attend nowhere, falls back to sdpa where it does not
serve; a model switched to it decodes what it decoded before, and the loop on it is lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serve_eval.cpu import attention as attn

pytestmark = pytest.mark.skipif(not attn.available(), reason="no AVX2 or no compiler")


def _qkv(B, H, Hk, n, L, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, H, D, generator=g).transpose(1, 2)  # as the model hands them: strided views
    k = torch.randn(B, Hk, L + 9, D, generator=g)[:, :, :L]  # a view of a longer cache buffer
    v = torch.randn(B, Hk, L + 9, D, generator=g)[:, :, :L]
    return q, k, v


def _reference(q, k, v, mask):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize(
    "B,H,Hk,n,L,D",
    [(1, 5, 5, 1, 205, 64), (1, 5, 5, 6, 37, 64), (2, 4, 2, 3, 19, 16), (3, 2, 1, 33, 70, 40), (1, 2, 2, 64, 64, 8)],
)
@pytest.mark.parametrize("kind", ["causal-bool", "causal-float", "random-bool", "none"])
def test_the_kernel_computes_attention(B, H, Hk, n, L, D, kind):
    q, k, v = _qkv(B, H, Hk, n, L, D)
    causal = torch.ones(n, L, dtype=torch.bool).tril(L - n)
    if kind == "random-bool":  # a row per batch row and head (a tree's ancestors; a batch's padding)
        mask = (torch.rand(B, H, n, L, generator=torch.Generator().manual_seed(1)) < 0.6) | causal.triu(L - n)
    elif kind == "causal-float":
        mask = torch.zeros(n, L).masked_fill(~causal, float("-inf"))[None, None]
    else:
        mask = None if kind == "none" else causal[None, None]
    out = torch.ops.draftsmith_attn.attention(q, k, v, mask, D**-0.5)
    assert out.shape == (B, n, H, D) and out.is_contiguous()
    torch.testing.assert_close(out, _reference(q, k, v, mask), rtol=1e-5, atol=2e-6)


def test_a_query_gets_the_same_bits_whatever_queries_share_the_call():
    """Query i of a causal verify (positions L - n + i) against the same query decoded alone, its
    cache ending at its own position: equal bits."""
    n, L = 8, 120
    q, k, v = _qkv(1, 4, 4, n, L, 64)
    mask = torch.ones(n, L, dtype=torch.bool).tril(L - n)[None, None]
    together = torch.ops.draftsmith_attn.attention(q, k, v, mask, 0.125)
    for i in range(n):
        end = L - n + i + 1
        alone = torch.ops.draftsmith_attn.attention(q[:, :, i : i + 1], k[:, :, :end], v[:, :, :end], None, 0.125)
        assert torch.equal(alone[:, 0], together[:, i])
    # causal order without a mask (a verify's chain: no mask built per layer) reads the same positions
    assert torch.equal(torch.ops.draftsmith_attn.attention(q, k, v, None, 0.125, True), together)
    with pytest.raises(RuntimeError, match="a mask or causal"):
        torch.ops.draftsmith_attn.attention(q, k, v, mask, 0.125, True)


def test_positions_after_the_last_one_the_mask_shows_are_not_read():
    """A compiled draft's cache buffer is longer than its context: with a bool mask hiding the buffer's
    tail (per batch row), the kernel gives the bits it gives on the buffer cut after the last position
    any query may see, and never reads the tail (NaN there changes nothing)."""
    B, n, L = 2, 8, 90
    q, k, v = _qkv(B, 5, 5, n, L, 64)
    ends = [40, 67]  # row b's queries see the positions below ends[b] + i (a causal block)
    mask = torch.zeros(B, 1, n, L, dtype=torch.bool)
    for b, end in enumerate(ends):
        mask[b, 0] = torch.ones(n, L, dtype=torch.bool).tril(end - 1)
        k[b, :, end + n :], v[b, :, end + n :] = float("nan"), float("nan")
    out = torch.ops.draftsmith_attn.attention(q, k, v, mask, 0.125)
    for b, end in enumerate(ends):
        cut = slice(0, end + n - 1)
        alone = torch.ops.draftsmith_attn.attention(
            q[b : b + 1], k[b : b + 1, :, cut], v[b : b + 1, :, cut], mask[b : b + 1, ..., cut], 0.125
        )
        assert torch.equal(out[b : b + 1], alone), b


def test_each_query_reads_only_the_positions_its_own_mask_shows():
    """A batch's padding: queries that may see the first position only, next to a query that sees them
    all. Positions past what a query may see are not read for it (NaN there changes nothing for it),
    and each query gets the bits it gets alone."""
    n, L = 6, 70
    q, k, v = _qkv(1, 5, 5, n, L, 64)
    mask = torch.zeros(1, 1, n, L, dtype=torch.bool)
    mask[0, 0, 0], mask[0, 0, 1:, 0] = True, True  # query 0 sees all; the padding, position 0
    together = torch.ops.draftsmith_attn.attention(q, k, v, mask, 0.125)
    assert torch.equal(together[:, :1], torch.ops.draftsmith_attn.attention(q[:, :, :1], k, v, None, 0.125))
    for i in range(1, n):
        alone = torch.ops.draftsmith_attn.attention(q[:, :, i : i + 1], k[:, :, :1], v[:, :, :1], None, 0.125)
        assert torch.equal(together[:, i : i + 1], alone)
    k[:, :, 9:], v[:, :, 9:] = float("nan"), float("nan")  # past the first group of eight, and a bit
    assert torch.equal(torch.ops.draftsmith_attn.attention(q[:, :, 1:], k, v, mask[:, :, 1:], 0.125), together[:, 1:])


def test_a_query_that_may_attend_nowhere_gets_zeros():
    q, k, v = _qkv(1, 2, 2, 3, 10, 16)
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool)
    mask[..., 1, :] = False
    out = torch.ops.draftsmith_attn.attention(q, k, v, mask, 0.25)
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    torch.testing.assert_close(out[:, [0, 2]], _reference(q, k, v, None)[:, [0, 2]], rtol=1e-5, atol=2e-6)


def test_calls_it_does_not_serve_go_to_sdpa(monkeypatch):
    """A prefill longer than MAX_QUERIES, fp64, a head size that is not a multiple of 8, gradients:
    transformers' sdpa function answers."""
    called = []
    monkeypatch.setattr(attn, "sdpa_attention_forward", lambda *a, **k: called.append(1) or ("sdpa", None))
    module = torch.nn.Module()
    for q, k in [
        (_qkv(1, 2, 2, attn.MAX_QUERIES + 1, 80, 16)[0], torch.zeros(1, 2, 80, 16)),
        (torch.zeros(1, 2, 1, 16, dtype=torch.float64), torch.zeros(1, 2, 5, 16, dtype=torch.float64)),
        (torch.zeros(1, 2, 1, 12), torch.zeros(1, 2, 5, 12)),
        (torch.zeros(1, 2, 1, 16, requires_grad=True), torch.zeros(1, 2, 5, 16)),
    ]:
        assert attn.attention(module, q, k, k, None)[0] == "sdpa"
    assert len(called) == 4
    q, k, v = _qkv(1, 2, 2, 4, 9, 16)  # a short causal prefill (no mask: causal order) is served here
    out, _ = attn.attention(module, q, k, v, None)
    torch.testing.assert_close(
        out, _reference(q, k, v, torch.ones(4, 9, dtype=torch.bool).tril(5)), rtol=1e-5, atol=2e-6
    )


def test_a_target_on_the_kernel_decodes_as_before_and_the_loop_stays_lossless(tiny_target_dir):
    """The tiny target greedy-decodes the same tokens on sdpa and on the kernel (logits within 1e-5),
    and speculative decoding on the kernel, with the target itself drafting, equals plain decoding."""
    from distill.config import TargetConfig
    from distill.models import load_target
    from serve_eval.loop import plain_generate, speculative_generate
    from serve_eval.proposers import LMProposer

    target, _ = load_target(TargetConfig(path=str(tiny_target_dir)))
    prompt = torch.arange(3, 40)
    reference, _ = plain_generate(target, prompt, 24)
    with torch.inference_mode():
        before = target(input_ids=prompt[None]).logits
    assert attn.use_attention(target) == {"kernel": attn.NAME, "max_queries": attn.MAX_QUERIES}
    with torch.inference_mode():
        torch.testing.assert_close(target(input_ids=prompt[None]).logits, before, rtol=1e-5, atol=1e-5)
    out, _ = plain_generate(target, prompt, 24)
    assert out == reference
    spec, stats = speculative_generate(target, target, prompt, 24, proposer=LMProposer(target, 4))
    assert spec == out and stats.tokens / stats.target_forwards > 2  # the target drafting for itself


def test_a_block_drafter_on_the_kernel_drafts_as_on_sdpa_eager_and_compiled():
    """A DFlash drafter switched to the kernel (its layers read ``config._attn_implementation``): its
    eager block and its compiled graph's (the operator's shape function lets Dynamo hold it) equal
    the drafter's own on sdpa, for causal and bidirectional blocks."""
    import copy

    from drafters.cache import ContextCache
    from serve_eval.cpu import CpuBackend

    from ..conftest import decode_one, graph_one, tiny_dflash

    torch.manual_seed(0)
    aux = torch.randn(1, 40, 32)
    for blocks in ("causal", "bidirectional"):
        reference = tiny_dflash(blocks, num_key_value_heads=2)  # grouped heads
        drafter = copy.deepcopy(reference)
        assert attn.use_attention(drafter)["kernel"] == attn.NAME and reference.config._attn_implementation != attn.NAME
        backend = CpuBackend(prepack="off", int8="off", compile="off")
        backend.compile_draft(drafter, 32)
        graph = backend.draft_graph(drafter)
        cache = ContextCache(spare=4, capacity=graph.positions)
        with torch.inference_mode():
            decode_one(drafter, 3, 10, cache, aux[:, :10])
            on_sdpa, eager = copy.deepcopy(cache), copy.deepcopy(cache)
            hidden = graph_one(graph, 7, cache, aux[:, 10:13])
            expected = decode_one(reference, 7, 13, on_sdpa, aux[:, 10:13])
            torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(decode_one(drafter, 7, 13, eager, aux[:, 10:13]), expected, rtol=1e-5, atol=1e-5)
        assert graph.calls == 1


def test_a_model_that_takes_no_attention_function_keeps_its_own():
    module = torch.nn.Linear(2, 2)
    module.config = type("Config", (), {"_attn_implementation": "eager"})()
    record = attn.use_attention(module)
    assert record["kernel"] == "eager" and "Linear" in record["why"]


def test_top_is_torch_argmax_and_the_softmax_top():
    """``draftsmith_attn::top`` (the CPU backend's greedy tokens and their probability,
    :func:`serve_eval.cpu.attention.top_tokens`): exactly torch's argmax, ties to the first maximum and a NaN
    counting as the maximum, as there (plain and speculative decoding emit the same tokens on either
    backend); the probability within rounding of torch's softmax, NaN where that is NaN; a length not a
    multiple of 8; without the probability, none."""
    gen = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 4, (7, 4096), generator=gen).float()  # many ties: the first maximum wins
    ties[1, 100] = float("nan")
    ties[2, 5] = ties[2, 9] = float("nan")
    ties[3] = float("-inf")
    ties[4, 17] = float("inf")
    for logits in (torch.randn(4, 8, 4096, generator=gen) * 3, torch.randn(3, 13, generator=gen) * 10, ties):
        tokens, probs = torch.ops.draftsmith_attn.top(logits, True)
        assert torch.equal(tokens, logits.argmax(-1))
        torch.testing.assert_close(probs, logits.softmax(-1).amax(-1), rtol=2e-6, atol=1e-7, equal_nan=True)
        assert torch.equal(attn.top_tokens(logits)[0], tokens) and attn.top_tokens(logits)[1] is None
        torch.testing.assert_close(attn.top_tokens(logits, with_prob=True)[1], probs, rtol=0, atol=0, equal_nan=True)
