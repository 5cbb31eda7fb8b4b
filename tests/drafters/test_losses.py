"""The drafter loss library: each term against its definition, D-PACE weights, scored anchors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafters.losses import (
    acceptance_probability,
    block_loss,
    block_scores,
    block_weights,
    position_loss,
    position_weights,
    weighted_mean,
)
from drafters.masks import sample_anchors


def _logits(seed, shape=(2, 3, 5, 11)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def test_terms_equal_their_definitions():
    q, p = _logits(0), _logits(1)
    labels = torch.randint(0, 11, q.shape[:-1], generator=torch.Generator().manual_seed(2))
    P, Q = p.softmax(-1), q.softmax(-1)
    assert torch.allclose(
        position_loss("ce", q, p, labels),
        F.cross_entropy(q.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels),
    )
    assert torch.allclose(position_loss("kl", q, p, labels), (P * (P.log() - Q.log())).sum(-1), atol=1e-6)
    assert torch.allclose(position_loss("tv", q, p, labels), 0.5 * (P - Q).abs().sum(-1), atol=1e-6)
    assert torch.allclose(position_loss("lk", q, p, labels), -torch.minimum(P, Q).sum(-1).log(), atol=1e-6)
    for term in ("kl", "tv", "lk"):  # zero exactly where the drafter is the target
        assert position_loss(term, p, p, labels).abs().max() < 1e-5
    with pytest.raises(ValueError, match="unknown loss term"):
        position_loss("mse", q, p, labels)


def test_dpace_weights_are_the_detached_probability_of_reaching_each_position():
    q = _logits(3).requires_grad_()
    p = _logits(4)
    w = block_weights("dpace", 4.0, q, p)
    alpha = acceptance_probability(p, q.detach())
    assert not w.requires_grad and torch.all(w[..., 0] == 1)
    assert torch.allclose(w[..., 1:], alpha[..., :-1].cumprod(-1))
    assert torch.allclose(block_weights("exp", 2.0, q, p), position_weights(5, 2.0))


def test_block_loss_mixes_terms_over_scored_positions_only():
    q, p = _logits(5).requires_grad_(), _logits(6)
    labels = torch.zeros(q.shape[:-1], dtype=torch.long)
    scored = torch.zeros(q.shape[:-1], dtype=torch.bool)
    scored[0, 0] = True
    loss, parts, _ = block_loss({"ce": 0.5, "kl": 2.0}, "exp", 4.0, q, p, labels, scored)
    w = position_weights(5, 4.0)
    ce = position_loss("ce", q, p, labels)[0, 0]
    assert torch.allclose(parts["ce"], (ce * w).sum() / w.sum())
    assert torch.allclose(loss, 0.5 * parts["ce"] + 2.0 * parts["kl"])
    loss.backward()
    assert q.grad[1].abs().sum() == 0 and q.grad[0, 0].abs().sum() > 0  # unscored blocks get no gradient


def test_anchors_land_where_labels_are_scored():
    mask = torch.zeros(3, 40)
    mask[0, 20:30] = 1  # a short response: 9 useful anchors (a + 1 in 20..29, a <= 32)
    mask[1, 5:] = 1
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        anchors = sample_anchors(40, 8, 6, 3, generator=gen, loss_mask=mask)
        first_label = torch.gather(mask, 1, anchors + 1)
        assert torch.all(first_label[:2] == 1), anchors
        assert anchors.max() <= 32 and anchors.min() >= 1
    # more anchors than scored positions: every scored position is used, the rest are filled in
    anchors = sample_anchors(40, 8, 12, 3, generator=torch.Generator().manual_seed(0), loss_mask=mask)
    assert set(range(19, 29)) <= set(anchors[0].tolist())


def _scores(chunk, terms, weighting, seed=0, M=6, S=5, H=8, V=13):
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(V, H, generator=g)
    hidden = torch.randn(2, M // 2, S, H, generator=g, requires_grad=True)
    target_hidden = torch.randn(2, M // 2, S, H, generator=g)
    labels = torch.randint(0, V, (2, M // 2, S), generator=g)
    scored = torch.rand(2, M // 2, S, generator=g) > 0.2
    sc = block_scores(
        terms,
        weighting,
        4.0,
        lambda h: h @ head.T,
        lambda t: t @ head.T,
        (hidden,),
        target_hidden,
        labels,
        scored,
        chunk,
    )
    sc.loss.backward()
    ref, _, w = block_loss(terms, weighting, 4.0, hidden.detach() @ head.T, target_hidden @ head.T, labels, scored)
    return sc, hidden.grad, ref


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_chunked_block_scores_equal_one_pass(weighting):
    terms = {"ce": 0.3, "kl": 1.0, "tv": 0.5, "lk": 0.2}
    whole, grad, ref = _scores(None, terms, weighting)
    torch.testing.assert_close(whole.loss, ref)  # the hidden-state path is block_loss on their logits
    assert whole.draft_logits is not None
    for chunk in (5, 7, 12):  # one block, one block (7 < 2 x 5), two blocks a chunk
        part, part_grad, _ = _scores(chunk, terms, weighting)
        assert part.draft_logits is None and part.target_logits is None
        torch.testing.assert_close(part.loss, whole.loss)
        torch.testing.assert_close(part_grad, grad)
        for key in ("parts",):
            for t in terms:
                torch.testing.assert_close(getattr(part, key)[t], getattr(whole, key)[t])
        for key in ("weights", "accept", "draft_tokens", "target_tokens"):
            torch.testing.assert_close(getattr(part, key), getattr(whole, key))
    assert torch.equal(whole.draft_tokens, whole.draft_logits.argmax(-1))
    torch.testing.assert_close(whole.accept, acceptance_probability(whole.target_logits, whole.draft_logits))


def test_losses_over_a_draft_vocabulary():
    """With a draft vocabulary (q = 0 outside it): tv / lk are serving's, on the whole vocabulary; ce
    scores only labels inside it; kl compares q with p renormalized over it; accept and the argmaxes
    are serving's (p over the whole vocabulary); chunks change nothing."""
    from drafters.vocab import RestrictedHead

    g = torch.Generator().manual_seed(0)
    V, H = 13, 8
    head = torch.nn.Linear(H, V, bias=False)
    vocab = torch.tensor([0, 2, 3, 7, 8, 11])
    restricted = RestrictedHead(head, vocab)
    hidden = torch.randn(2, 3, 5, H, generator=g, requires_grad=True)
    target_hidden = torch.randn(2, 3, 5, H, generator=g)
    labels = torch.randint(0, V, (2, 3, 5), generator=g)
    scored = torch.rand(2, 3, 5, generator=g) > 0.2
    full = lambda t: t @ head.weight.T  # noqa: E731
    for term in ("ce", "kl", "tv", "lk"):
        sc = block_scores(
            {term: 1.0}, "exp", 4.0, restricted, full, (hidden,), target_hidden, labels, scored, None, vocab
        )
        assert torch.isfinite(sc.loss)
        q, p = restricted(hidden).detach(), full(target_hidden)
        w = position_weights(5, 4.0)
        if term in ("tv", "lk"):
            expected = weighted_mean(position_loss(term, q, p, labels), w, scored)
        else:
            small = torch.searchsorted(vocab, labels).clamp_max(len(vocab) - 1)
            inside = vocab[small] == labels
            values = position_loss(term, q[..., vocab], p[..., vocab], small) * (inside if term == "ce" else 1)
            expected = (values * w * scored).sum() / (w * scored).sum()
        torch.testing.assert_close(sc.loss, expected)
        torch.testing.assert_close(sc.accept, acceptance_probability(p, q))
        assert torch.equal(sc.target_tokens, p.argmax(-1)) and bool(torch.isin(sc.draft_tokens, vocab).all())
        chunked = block_scores(
            {term: 1.0}, "exp", 4.0, restricted, full, (hidden,), target_hidden, labels, scored, 5, vocab
        )
        torch.testing.assert_close(chunked.loss, sc.loss)
