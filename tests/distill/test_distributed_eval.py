"""Held-out evaluation under the wrappers and splits of a real launch: a wrapped drafter (compiled, DDP)
is evaluated as what it is, and every rank runs as many forwards whatever its share of the data."""

from __future__ import annotations

import math
import socket

import pytest
import torch

from distill.base.features import FeatureCapture
from distill.base.lm import rank_batches
from distill.config import DataConfig, TargetConfig
from distill.data import Batch
from distill.drafter_eval import evaluate_drafter
from distill.models import load_target

from ..conftest import REPO

KINDS = ["dflash", "dspark", "eagle3"]


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(path="testbed"))


@pytest.fixture(scope="module")
def val_windows(target):
    from distill.data import load_text_splits, make_windows

    data = DataConfig(source="stdlib", seq_len=64, max_documents=40, val_fraction=0.1)
    return make_windows(load_text_splits(data).val, target[1], data, "val")


def drafter_for(target, kind):
    """The drafter of ``kind`` shipped beside the testbed target: trained, so its acceptance tells kinds apart."""
    from recipes.evaluate import load_drafter

    return load_drafter(str(REPO / f"distill/assets/testbed_{kind}"), target[0], "cpu")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 5, 8, 13])
def test_every_rank_gets_as_many_batches_and_each_real_batch_runs_once(n, world):
    shares = [rank_batches(n, 4, rank, world) for rank in range(world)]
    assert len({len(s) for s in shares}) == 1
    real = sorted(b for s in shares for b, is_real in s if is_real)
    assert real == list(range(0, n, 4))


class _OneRankGloo:
    """A one-process gloo world (what DDP needs to wrap a module), torn down afterwards."""

    def __enter__(self):
        import torch.distributed as dist

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrapped_drafter_is_evaluated_like_the_bare_one(target, val_windows, kind):
    """The trainer evaluates the prepared model: under DDP, DeepSpeed, FSDP or ``train.compile`` a wrapper.
    Block drafters read as EAGLE-3 through a wrapper gave a garbage ``val_simulated_tau``, the metric that
    picks ``checkpoints/best``."""
    from torch.nn.parallel import DistributedDataParallel

    drafter = drafter_for(target, kind)
    capture = FeatureCapture(target[0], drafter.config.target_layer_ids)
    bare = evaluate_drafter(drafter, capture, val_windows, 4, max_batches=2)
    compiled = evaluate_drafter(torch.compile(drafter, backend="eager"), capture, val_windows, 4, max_batches=2)
    with _OneRankGloo():
        ddp = evaluate_drafter(DistributedDataParallel(drafter), capture, val_windows, 4, max_batches=2)
    assert bare["val_simulated_tau"] > 1
    for wrapped in (compiled, ddp):
        assert wrapped.keys() == bare.keys()
        for k, v in bare.items():
            assert wrapped[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


class _FakeRank:
    """What :func:`evaluate_drafter` reads of an accelerator, for one rank of a ``world``-rank launch
    simulated in one process (``reduce`` is the identity: each rank's own sums)."""

    def __init__(self, rank, world):
        self.process_index, self.num_processes, self.device = rank, world, torch.device("cpu")

    def unwrap_model(self, model):
        return model

    def reduce(self, tensor, op):
        return tensor


class _AnswersLate:
    """Held-out windows whose scored answer starts late in some windows and early in others: the data a
    replay's forward count must not depend on."""

    def __init__(self, windows):
        self.windows = windows

    def __len__(self):
        return len(self.windows)

    def collate(self, indices):
        ids = self.windows.collate(indices).input_ids
        mask = torch.ones_like(ids, dtype=torch.bool)
        for row, i in enumerate(indices):
            mask[row, : 3 + (i % 5) * 11] = False
        return Batch(ids, mask)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_every_rank_runs_as_many_forwards_whatever_its_data(target, val_windows, kind):
    """Under ZeRO-3 / FSDP each forward gathers parameters collectively: ranks with more forwards than the
    others wait forever. Five batches over two ranks, answers starting anywhere: the same count on both."""
    drafter = drafter_for(target, kind)
    capture = FeatureCapture(target[0], drafter.config.target_layer_ids)
    windows = _AnswersLate(val_windows)
    calls = []
    handle = drafter.register_forward_hook(lambda *_: calls.append(1))
    counts = []
    try:
        for rank in range(2):
            calls.clear()
            metrics = evaluate_drafter(drafter, capture, windows, 4, max_batches=5, accelerator=_FakeRank(rank, 2))
            counts.append(len(calls))
            assert not any(math.isnan(v) for v in metrics.values()), metrics  # no NaN from a padding batch
    finally:
        handle.remove()
    assert len(val_windows) >= 20 and counts[0] == counts[1] > 0, counts


def test_padding_batches_count_nowhere(target, val_windows):
    """A rank whose share is a padding batch alone contributes zero to every sum (its metrics have no
    tokens), while still running its forwards."""
    drafter = drafter_for(target, "dflash")
    capture = FeatureCapture(target[0], drafter.config.target_layer_ids)
    with pytest.MonkeyPatch.context() as mp:
        seen = {}

        def reduce(tensor, op):
            seen.setdefault("first", tensor.clone())
            return tensor

        rank = _FakeRank(1, 2)
        mp.setattr(rank, "reduce", reduce)
        evaluate_drafter(drafter, capture, val_windows, 4, max_batches=1, accelerator=rank)  # one batch: rank 1 pads
    assert seen and float(seen["first"].abs().sum()) == 0.0


def test_every_rank_runs_as_many_lm_forwards_and_the_ranks_add_up_to_one(target, val_windows):
    """A causal LM's held-out evaluation (students, Parcae's recurrence curve, ``train_lm``; the final one
    reads the whole split): 9 windows in batches of 4 over 2 ranks, the same forwards on each, and the
    ranks' token counts add up to the one-process count."""
    from distill.base.lm import evaluate_lm

    class Nine:
        def __len__(self):
            return 9

        def collate(self, indices):
            return val_windows.collate(indices)

    model, windows = target[0], Nine()
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    counts, tokens = [], []
    try:
        for rank in range(2):
            calls.clear()
            tokens.append(evaluate_lm(model, windows, 4, accelerator=_FakeRank(rank, 2))["val_tokens"])
            counts.append(len(calls))
        whole = evaluate_lm(model, windows, 4)["val_tokens"]
    finally:
        handle.remove()
    assert counts == [2, 2] and sum(tokens) == whole == 9 * 64
