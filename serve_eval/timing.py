"""Timing for the cost model (:mod:`serve_eval.budget`): a device clock, interleaved rounds, and the step
and draft costs measured before decoding.

Cost tables take each size's fastest round (``least``): another process's burst only ever adds time, and
one that covers most rounds of some sizes but not others would bend a table of medians out of shape;
the loop corrects the level online (:meth:`~serve_eval.budget.CostModel.observe_verify`).
"""

from __future__ import annotations

import functools
import time

import torch

from distill.base.features import FeatureCapture

from .backend import TORCH, Backend
from .kv import KVQuant
from .proposers import BlockProposer
from .sampling import Sampler
from .session import TargetSession


def device_clock(device):
    """``now()`` in seconds that first waits for the device's queued work (on CUDA, kernels run after the
    host launched them; the loop syncs every step anyway, reading the accepted tokens); on a CPU it is
    ``time.perf_counter``."""
    if torch.device(device).type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def interleaved_seconds(runs: dict, repeats: int, device, least: bool = False) -> dict:
    """The median seconds of each ``runs[key] = (run, after)`` (with ``least``, the fastest): ``repeats``
    rounds after a warm-up round, every ``run()`` once a round (``after()``, when not None, untimed after
    it, e.g. to undo it), each round starting one key further on, so that a machine that drifts, or a
    periodic disturbance, moves every key alike."""
    now = device_clock(device)
    keys = list(runs)
    times: dict = {key: [] for key in keys}
    for round_ in range(repeats + 1):
        shift = round_ % len(keys) if keys else 0
        for key in keys[shift:] + keys[:shift]:
            run, after = runs[key]
            start = now()
            run()
            times[key].append(now() - start)
            if after is not None:
                after()
    pick = min if least else (lambda t: sorted(t)[len(t) // 2])
    return {key: pick(t[1:]) for key, t in times.items()}


def verify_sizes(largest: int) -> list[int]:
    """The forward sizes a one-row cost table measures: every size up to 33 tokens (small-matrix kernels
    make neighbouring sizes differ), sparser beyond, and ``largest``."""
    grid = [*range(1, 34), *range(40, 129, 8), *range(160, 1025, 32)]
    return [n for n in grid if n < largest] + [largest]


@torch.inference_mode()
def measure_verify_costs(
    target,
    sizes,
    capture: FeatureCapture | None = None,
    context: int = 128,
    repeats: int = 5,
    kv: KVQuant | None = None,
    rows: int = 1,
    plain: bool = False,
    backend: Backend = TORCH,
) -> dict[int, float]:
    """Seconds of a target step over ``rows`` rows of ``context`` cached tokens reading ``n`` tokens each,
    for each ``n`` in ``sizes``, with ``capture``'s features and the loop's KV cache (``kv``); with
    ``plain``, at key 0 also a plain step (one token a row, no features). The fastest of ``repeats``
    interleaved rounds, each step undone. On random tokens from a private generator (the caller's RNG
    is untouched): the cost does not depend on them."""
    device = next(target.parameters()).device
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (context,), generator=gen).to(device) for _ in range(rows)]
    runs = {}
    for features, steps in ([(None, [0])] if plain else []) + [(capture, sorted(set(sizes)))]:
        session = TargetSession(target, features, kv, backend)
        session.prefill(prompts)
        undo = functools.partial(session.keep, torch.zeros(rows, dtype=torch.long))
        for n in steps:
            ids = torch.randint(0, vocab, (rows, max(n, 1)), generator=gen).to(device)
            runs[n] = (functools.partial(session.step, ids), undo)
    return interleaved_seconds(runs, repeats, device, least=True)


@torch.inference_mode()
def measure_draft_seconds(drafter, rows: int, context: int = 128, repeats: int = 5, backend: Backend = TORCH) -> float:
    """Seconds of one greedy block draft over ``rows`` rows of ``context`` cached positions, one more
    feature arriving per row, as the loop drafts (:class:`~serve_eval.proposers.BlockProposer`: compiled
    where it fits), the fastest of ``repeats`` after a warm-up, on random features from a private generator."""
    device = next(drafter.parameters()).device
    gen = torch.Generator().manual_seed(0)
    aux = torch.randn(rows, context + 1, drafter.fc.in_features, generator=gen).to(device)
    proposer = BlockProposer(drafter, backend=backend)
    proposer.context.start(rows)
    proposer._append(aux[:, :context], torch.full((rows,), context))
    lengths = proposer.context.lengths
    anchors = torch.randint(0, drafter.config.vocab_size, (rows,), generator=gen).to(device)
    samplers = [Sampler()] * rows

    def draft():
        proposer.context.lengths = lengths  # the same context each time: what a draft writes after it is overwritten
        proposer.pending = [(aux[:, context:], None)]
        proposer.propose(anchors, [context + 1] * rows, samplers)

    return interleaved_seconds({0: (draft, None)}, repeats, device, least=True)[0]
