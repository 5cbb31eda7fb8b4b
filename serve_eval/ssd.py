"""Speculative speculative decoding (SSD; Kumar, Dao & May 2026, the Saguaro algorithm): the drafter
prepares the next step's drafts while the target verifies the current ones.

Plain speculative decoding alternates: draft (the target idles), verify (the drafter idles). A
verification of the drafts ``d_1 .. d_m`` after the bonus ``b`` (at position ``a``) ends in an
*outcome* ``(n, t)``: ``n`` drafts accepted and the target's token ``t`` after them, the next bonus.
While the target verifies, SSD's drafter guesses likely outcomes and drafts after each as if it were
the bonus: a *speculation cache* ``{(n, t): drafts}``. When the outcome is in the cache (a *hit*) the
next verification starts at once with its drafts, and drafting leaves the critical path; on a *miss*
the drafter drafts after ``t`` just in time, as plain speculative decoding does (the backup).

**Candidates.** ``t`` is the target's token at position ``a + n + 1`` given ``.. b, d_1 .. d_n``. The
drafter's own next-token logits there, ``r_n`` (``r_0`` is what its first draft came from; ``r_1 ..
r_m`` come from reading the drafts), rank the candidates. At temperature 0 a rejected ``d_{n+1}`` is
never the target's argmax, so it is skipped.

**Fan-out** (the paper's geometric fan-out). ``B`` branches are shared among the outcomes
``n = 0 .. m``. With ``P_n`` the probability that exactly ``n`` drafts are accepted and a miss rate
that falls as a power law in the candidates kept, ``1 - hit(F) ~ F^-r``, the expected hits
``sum_n P_n hit(F_n)`` under ``sum_n F_n = B`` are largest at ``F_n ~ P_n^(1/(1+r))`` (:func:`fan_out`),
a geometric series when acceptance is geometric (``P_n ~ alpha^n``). ``P_n`` is counted from the
outcomes seen so far (add-one smoothed); ``r`` is a setting, and the summary's hit rate by fan-out
(the rank of each real bonus among its outcome's candidates) measures it.

**Building the cache** (a causal LM with its own KV cache of the tokens it has read; no target
features, so this serves :class:`~serve_eval.proposers.LMProposer` and
:class:`~serve_eval.proposers.PardProposer`; DFlash, DSpark and EAGLE-3 draft from the target's features
of the very positions being verified, which exist only after the verification):

1. one forward reads ``d_1 .. d_m`` after the bonus: ``r_1 .. r_m``;
2. every branch ``(n, t)`` reads ``t`` at position ``a + n + 1``, attending to the cached ``.. b, d_1
   .. d_n`` and to its own entries only (one flat cache, a branch-diagonal attention mask): an
   autoregressive LM drafts one token a forward for all branches at once; a PARD LM reads ``t`` and its
   ``K - 1`` mask tokens, every branch in one forward.

The build stops between forwards when the outcome arrives; an autoregressive branch then holds fewer
drafts, still a valid draft (the cache is *anytime*). On a hit the branch's entries move down behind
``.. d_n`` (:func:`~serve_eval.kv.keep_entries`) and are the drafter's state, exactly as if it had
drafted after ``t``; the rest is dropped.

**Lossless.** A branch's drafts are drawn from the drafter's distribution given the verified prefix and
``t``, from the drafter's own random stream, before the outcome is known; the outcome only picks the
branch. The drafts verified next are therefore distributed as a just-in-time draft after the same
prefix, independently of the target's draws, and chain verification against the distributions they
were drawn from is exact at any temperature; at temperature 0 the output is the target's greedy
decoding token for token. Tested for both drafter kinds, hits and misses, inline and in a worker.

**In the loop.** SSD is a :class:`~serve_eval.proposers.Proposer` of one row (:class:`SpeculationProposer`):
the loop (:func:`~serve_eval.loop.generate`) asks it for drafts, which starts the next build and hands out
the drafts the last outcome resolved to, and tells it each step's verified tokens, which resolve the
outcome; chains are verified whole.

**Concurrency** (``concurrent``): the drafter lives in a worker process pinned to a core of its own;
the loop verifies while the worker builds, and they exchange token ids over a pipe. ``inline`` builds
in the loop's own thread (no overlap, the same hits, each part timed alone): :meth:`SSDStats.summary`
models from those costs the paper's setting, a drafter on a device of its own.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from .backend import TORCH, Backend
from .kv import KVQuant, keep_entries
from .loop import generate
from .proposers import PardProposer, Proposal, Proposer
from .sampling import Sampler


def fan_out(probabilities: list[float], branches: int, exponent: float) -> list[int]:
    """Branches per outcome: ``F_n ~ P_n^(1/(1+r))`` rounded to integers that sum to ``branches``
    (largest remainders first)."""
    weights = [p ** (1 / (1 + exponent)) for p in probabilities]
    shares = [branches * w / sum(weights) for w in weights]
    counts = [int(s) for s in shares]
    for n in sorted(range(len(shares)), key=lambda n: counts[n] - shares[n])[: branches - sum(counts)]:
        counts[n] += 1
    return counts


def _power_law_exponent(in_top: dict[int, float]) -> float | None:
    """``r`` of ``miss(F) = c F^-r``, least squares in log-log over the fan-outs with a miss rate > 0."""
    points = [(math.log(f), math.log(1 - h)) for f, h in in_top.items() if h < 1]
    if len(points) < 2:
        return None
    mx, my = (sum(c) / len(points) for c in zip(*points))
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return round(-slope, 3)


@dataclass
class _Cache:
    """The speculation cache being built: ``keys[o] = (n, t)``; ``drafts[o]`` / ``logits[o]`` what branch
    ``o`` drafted so far; the flat KV cache's branch entries start at ``base``."""

    keys: list[tuple[int, int]]
    base: int
    drafts: list[list[torch.Tensor]]
    logits: list[list[torch.Tensor]]
    seconds: float = 0.0
    interrupted: bool = False


@dataclass
class SSDStats:
    """What the speculator measured, step by step (it lives where the drafter does)."""

    hits: int = 0
    steps: int = 0
    drafts_on_hit: int = 0
    interrupted: int = 0
    speculate_s: float = 0.0
    backup_s: float = 0.0
    ranks: Counter = field(default_factory=Counter)  # rank of each real bonus among its outcome's candidates
    outcomes: Counter = field(default_factory=Counter)  # drafts accepted, steps that drafted
    steps_ms: list = field(default_factory=list)  # (hit, speculate ms, backup ms) per step

    def summary(self, verify_ms: list[float] | None = None) -> dict:
        """Hit rate, hit rate by fan-out, costs; with the loop's ``verify_ms`` per step (an inline run:
        each part timed alone), the step time a drafter on a device of its own would give:
        ``max(verify, speculate)`` on a hit (the two overlap), ``verify + backup`` on a miss."""
        steps = max(1, self.steps)
        ranked = sum(self.ranks.values())
        in_top = {f: sum(c for r, c in self.ranks.items() if r < f) / max(1, ranked) for f in (1, 2, 4, 8, 16, 32)}
        out = {
            "steps": self.steps,
            "hit_rate": round(self.hits / steps, 4),
            "mean_drafts_on_hit": round(self.drafts_on_hit / max(1, self.hits), 3),
            "interrupted_builds": self.interrupted,
            "speculate_ms": round(1e3 * self.speculate_s / steps, 3),
            "backup_ms": round(1e3 * self.backup_s / max(1, self.steps - self.hits), 3),
            "bonus_in_top_f": {f: round(h, 4) for f, h in in_top.items()},
            "fitted_exponent": _power_law_exponent(in_top),
            "outcomes": dict(sorted(self.outcomes.items())),
        }
        if verify_ms is not None and len(verify_ms) == len(self.steps_ms):
            separate = sum(max(v, s) if hit else v + b for v, (hit, s, b) in zip(verify_ms, self.steps_ms))
            out["modeled_separate_device_ms_per_step"] = round(separate / steps, 3)
            out["verify_ms"] = round(sum(verify_ms) / steps, 3)
        return out


class Speculator:
    """The drafter's side of SSD (module docstring): drafts just in time, builds the speculation cache
    (:meth:`speculate`), and answers an outcome with the next drafts (:meth:`resolve`). Holds a
    feature-free proposer and works on its KV cache (``cache``, ``read``, ``sequence``)."""

    def __init__(self, proposer, branches: int = 8, exponent: float = 1.0, backup: str = "draft"):
        if proposer.needs_features:
            raise ValueError(
                "speculative speculation drafts ahead of the target's features: it needs a drafter that "
                "reads tokens only (a causal LM or a PARD drafter)"
            )
        self.branches, self.exponent, self.backup = branches, exponent, backup
        self.pard = isinstance(proposer, PardProposer)
        self.proposer = proposer.row()  # one row's drafter state, whose KV cache the speculation builds on
        self.device = next(proposer.model.parameters()).device
        self.outcome_counts = [1] * (proposer.block_size + 1)  # add-one smoothed counts of n = 0 .. K
        self.stats = SSDStats()
        self.cache: _Cache | None = None

    def begin(self, prompt: list[int], bonus: int, settings: dict):
        """A new prompt (its first bonus read by the target): the first drafts, just in time. ``settings``:
        the sampler's temperature, top_k, top_p and a ``seed`` for the drafter's own random stream."""
        seed = settings.get("seed")
        gen = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = Sampler(settings["temperature"], settings["top_k"], settings["top_p"], gen)
        self.proposer.begin(torch.tensor(prompt, device=self.device))
        self.proposer.observe(None, 0, torch.tensor(prompt[1:] + [bonus], device=self.device))
        self.anchor = len(prompt)
        return self._draft(bonus)

    def _draft(self, bonus: int):
        """Drafts after ``bonus`` just in time (``backup="draft"``), or none (``"none"``: the next step
        verifies the bonus alone while the cache is built for its outcome)."""
        if self.backup == "none":
            vocab = self.proposer.model.config.vocab_size
            drafts, logits = (
                torch.empty(0, dtype=torch.long, device=self.device),
                torch.empty(0, vocab, device=self.device),
            )
        else:
            drafts, logits = self.proposer.propose(torch.tensor(bonus, device=self.device), self.anchor, self.sampler)
        self.drafts, self.logits, self.cache = drafts, logits, None
        return self._answer(drafts, logits)

    def _answer(self, drafts: torch.Tensor, logits: torch.Tensor):
        """Token ids as a list and the logits as a numpy array (None at temperature 0: greedy verification
        needs no q): plain pickles over the pipe (a tensor would travel through shared memory, ~ms each)."""
        return drafts.tolist(), None if self.sampler.greedy else logits.float().cpu().numpy()

    def _forward(self, ids: list[int], positions: list[int], visible: torch.Tensor | None = None) -> torch.Tensor:
        p = self.proposer
        kwargs = {} if visible is None else {"attention_mask": visible[None, None].to(self.device)}
        out = p.model(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            cache=p.cache,
            use_cache=True,
            **kwargs,
            **p.forward_kwargs,
        )
        return out.logits[0]

    @torch.inference_mode()
    def speculate(self, interrupted=lambda: False) -> None:
        """Build the speculation cache for the drafts just handed out, until ``interrupted()`` says the
        outcome has arrived (asked between forwards)."""
        start = time.perf_counter()
        p, a, drafts = self.proposer, self.anchor, self.drafts.tolist()
        m = len(drafts)
        read = min(len(p.read), a + 1)  # the bonus is read unless no draft was made after it
        p.cache.crop(read - len(p.read))
        p.read = p.read[:read]
        pending = (p.sequence + drafts)[read : a + m + 1]
        logits = self._forward(pending, list(range(read, a + m + 1)))  # r_n after position a + n, n = 0 .. m
        ranked = torch.cat([self.logits[:1], logits]) if read == a + 1 else logits
        p.read += pending
        counts = self.outcome_counts[: m + 1]
        keys = []
        for n, f in enumerate(fan_out([c / sum(counts) for c in counts], self.branches, self.exponent)):
            order = ranked[n].topk(min(f + 1, ranked.shape[-1])).indices.tolist() if f else []
            if self.sampler.greedy and n < m:
                order = [t for t in order if t != drafts[n]]
            keys += [(n, t) for t in order[:f]]
        self.ranked = ranked
        cache = self.cache = _Cache(keys, a + 1 + m, [[] for _ in keys], [[] for _ in keys])
        prefix = torch.tensor([a + 1 + n for n, _ in keys])  # cache entries each branch sees: .. b, d_1 .. d_n
        sees_prefix = torch.arange(cache.base)[None] < prefix[:, None]
        tokens = [t for _, t in keys]
        B = len(keys)
        for step in range(1 if self.pard else p.block_size - 1):
            if interrupted():
                cache.interrupted = True
                break
            if self.pard:  # t and K - 1 masks per branch, causal within the branch
                K = len(p.masks) + 1
                ids = [x for t in tokens for x in [t, *p.masks]]
                positions = [int(q) + j for q in prefix for j in range(K)]
                own = torch.kron(torch.eye(B), torch.ones(K, K).tril()).bool()
                logits = self._forward(ids, positions, torch.cat([sees_prefix.repeat_interleave(K, 0), own], 1))
                logits = logits.view(B, K, -1)
                chosen = self.sampler.choose(logits)
                for o in range(B):
                    cache.drafts[o] += list(chosen[o])
                    cache.logits[o] += list(logits[o])
            else:  # one token per branch: t, then each branch's last draft
                own = torch.eye(B, dtype=torch.bool).repeat(1, step + 1)
                logits = self._forward(tokens, (prefix + step).tolist(), torch.cat([sees_prefix, own], 1))
                chosen = self.sampler.choose(logits)
                for o in range(B):
                    cache.drafts[o].append(chosen[o])
                    cache.logits[o].append(logits[o])
                tokens = chosen.tolist()
        cache.seconds = time.perf_counter() - start

    @torch.inference_mode()
    def resolve(self, n: int, token: int):
        """The verification's outcome: ``n`` drafts accepted, ``token`` the next bonus. Returns the next
        drafts and their logits (None at temperature 0) from the cache on a hit, just in time on a miss."""
        p, a, cache = self.proposer, self.anchor, self.cache
        emitted = self.drafts[:n].tolist() + [token]
        stats = self.stats
        stats.steps += 1
        if len(self.drafts):  # P_n: among steps that drafted (a bonus verified alone always accepts 0)
            self.outcome_counts[n] += 1
            stats.outcomes[n] += 1
        o = cache.keys.index((n, token)) if cache is not None and (n, token) in cache.keys else None
        if cache is not None:
            stats.speculate_s += cache.seconds
            stats.interrupted += cache.interrupted
            skip = (
                self.sampler.greedy and n < len(self.drafts) and self.ranked[n, self.drafts[n]] > self.ranked[n, token]
            )
            stats.ranks[min(64, int((self.ranked[n] > self.ranked[n, token]).sum()) - int(skip))] += 1
        self.anchor = a + n + 1
        if o is not None and cache.drafts[o]:
            drafts, logits = torch.stack(cache.drafts[o]), torch.stack(cache.logits[o])
            read = [token] if self.pard else [token, *drafts[:-1].tolist()]  # what the branch's entries hold
            B = len(cache.keys)
            source = (
                [cache.base + o * (len(p.masks) + 1)]
                if self.pard
                else [cache.base + s * B + o for s in range(len(read))]
            )
            keep_entries(p.cache, a + n + 1, source)
            p.read = p.read[: a + n + 1] + read
            p.sequence = p.sequence[: a + 1] + emitted
            self.drafts, self.logits, self.cache = drafts, logits, None
            stats.hits += 1
            stats.drafts_on_hit += len(drafts)
            stats.steps_ms.append((True, 1e3 * cache.seconds, 0.0))
            return self._answer(drafts, logits)
        start = time.perf_counter()
        if cache is not None:
            p.cache.crop(len(p.read) - p.cache.get_seq_length())  # drop the branches
        p.observe(None, a, torch.tensor(emitted, device=self.device))
        answer = self._draft(token)
        backup = time.perf_counter() - start
        stats.backup_s += backup
        stats.steps_ms.append((False, 1e3 * (cache.seconds if cache is not None else 0.0), 1e3 * backup))
        return answer

    def summary(self, verify_ms: list[float] | None = None) -> dict:
        return self.stats.summary(verify_ms)


class InlineSpeculation:
    """The speculator in the loop's own thread: :meth:`speculate` builds the whole cache before the
    verification (no overlap; every part timed alone)."""

    concurrent = False

    def __init__(self, speculator: Speculator):
        self.speculator = speculator
        self.block_size = speculator.proposer.block_size

    def begin(self, prompt: list[int], bonus: int, settings: dict):
        return self.speculator.begin(prompt, bonus, settings)

    def speculate(self) -> None:
        self.speculator.speculate()

    def resolve(self, n: int, token: int):
        return self.speculator.resolve(n, token)

    def summary(self, verify_ms: list[float] | None = None) -> dict:
        return self.speculator.summary(verify_ms)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(conn, speculator: Speculator, cpus: set[int] | None) -> None:
    """The worker process: one core, one torch thread; answers the loop's calls in order, and builds
    the speculation cache after ``speculate`` until the next call arrives."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(1)
    while True:
        call, *args = conn.recv()
        if call == "close":
            return
        try:
            if call == "speculate":
                speculator.speculate(interrupted=conn.poll)
            else:
                conn.send(("ok", None if call == "ready" else getattr(speculator, call)(*args)))
        except Exception:  # the loop re-raises it
            conn.send(("error", traceback.format_exc()))
            return


class WorkerSpeculation(InlineSpeculation):
    """The speculator in a worker process on a core of its own (the loop keeps the others): it builds
    the speculation cache while the loop verifies. The drafter's weights are shared, not copied."""

    concurrent = True

    def __init__(self, speculator: Speculator):
        super().__init__(speculator)
        cpus = sorted(os.sched_getaffinity(0))
        self.restore = set(cpus)
        worker_cpus = {cpus[-1]} if len(cpus) > 1 else None
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, speculator, worker_cpus), daemon=True)
        if worker_cpus:  # the child starts (imports, unpickles the drafter) on its own core already
            os.sched_setaffinity(0, worker_cpus)
        self.process.start()
        child.close()
        if worker_cpus:
            os.sched_setaffinity(0, set(cpus[:-1]))
        self._call("ready")  # started: its start-up is not timed as drafting

    def _call(self, *message):
        self.conn.send(message)
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"the speculation worker failed:\n{value}")
        return value

    def begin(self, prompt: list[int], bonus: int, settings: dict):
        return self._call("begin", prompt, bonus, settings)

    def speculate(self) -> None:
        self.conn.send(("speculate",))

    def resolve(self, n: int, token: int):
        return self._call("resolve", n, token)

    def summary(self, verify_ms: list[float] | None = None) -> dict:
        return self._call("summary", verify_ms)

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(("close",))
            self.process.join(timeout=30)
        os.sched_setaffinity(0, self.restore)


def open_speculation(
    proposer, branches: int = 8, exponent: float = 1.0, backup: str = "draft", concurrent: bool = True
) -> InlineSpeculation:
    """SSD's drafter side for a feature-free proposer: in a worker process (``concurrent``) or inline."""
    speculator = Speculator(proposer, branches, exponent, backup)
    return WorkerSpeculation(speculator) if concurrent else InlineSpeculation(speculator)


def _tensors(answer, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    drafts, logits = answer
    return torch.tensor(drafts, dtype=torch.long, device=device), None if logits is None else torch.from_numpy(
        logits
    ).to(device)


class SpeculationProposer(Proposer):
    """The loop's side of SSD: a :class:`~serve_eval.proposers.Proposer` of one row whose drafts come from
    the speculation (:meth:`propose` starts the next build, inline or in the worker, and hands out the
    drafts the last outcome resolved to; :meth:`observe` resolves the step's outcome). ``seed`` seeds the
    drafter's own random stream; ``verify_ms`` collects each resolved step's time between the two."""

    def __init__(self, speculation: InlineSpeculation, sampler: Sampler, seed: int = 0):
        self.speculation, self.sampler, self.seed = speculation, sampler, seed
        self.block_size = speculation.block_size
        self.verify_ms: list[float] = []
        self.drafts: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def start(self, prompts, features, firsts) -> None:
        if len(prompts) != 1:
            raise ValueError("speculative speculation decodes one row at a time")
        s = self.sampler
        settings = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": self.seed}
        self.device = prompts[0].device
        self.drafts, self.logits = _tensors(
            self.speculation.begin(prompts[0].tolist(), int(firsts[0]), settings), self.device
        )

    def observe(self, starts, tokens, features) -> None:
        self.verify_ms.append(1e3 * (time.perf_counter() - self.handed_out))
        emitted = tokens[0].tolist()
        self.drafts, self.logits = _tensors(self.speculation.resolve(len(emitted) - 1, emitted[-1]), self.device)

    def propose(self, anchors, positions, samplers, stop=None) -> Proposal:
        self.speculation.speculate()  # inline: builds it here; concurrent: while the target verifies
        self.handed_out = time.perf_counter()
        return Proposal(self.drafts[None], None if self.logits is None else self.logits[None])


def ssd_generate(
    target,
    speculation: InlineSpeculation,
    prompt: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    sampler: Sampler | None = None,
    seed: int = 0,
    kv: KVQuant | None = None,
    backend: Backend = TORCH,
):
    """Speculative speculative decoding of one prompt (module docstring) in the decoding loop
    (:func:`~serve_eval.loop.generate`, chains verified whole): the speculation builds the next drafts while
    the target verifies (concurrent), or between verifications (inline). ``seed`` seeds the drafter's own
    random stream. Returns the tokens, the prompt's :class:`~serve_eval.loop.GenerationStats`
    (``draft_seconds``: time the loop waited for drafts) and the verification times per resolved step (ms)."""
    sampler = sampler or Sampler()
    proposer = SpeculationProposer(speculation, sampler, seed)
    outs, run = generate(
        target, [prompt.view(-1)], max_new_tokens, eos_token_id, [sampler], proposer, kv=kv, backend=backend
    )
    return outs[0], run.prompts[0], proposer.verify_ms


def ssd_report(speculation: InlineSpeculation, totals: dict, verify_ms: list[float], prompts: int) -> dict:
    """An eval report's ``ssd`` section: the speculator's summary, and plain speculative decoding of the
    same prompts with the same drafter (``totals["sd_*"]``, measured prompt by prompt beside SSD and
    plain decoding); for an inline run, the speedup a drafter on a device of its own would give."""
    ssd = speculation.summary(None if speculation.concurrent else verify_ms)
    sd_tokens_per_s = totals["sd_tokens"] / totals["sd_s"]
    plain_tokens_per_s = totals["base_tokens"] / totals["base_s"]
    ssd["concurrent"] = speculation.concurrent
    ssd["speculative_decoding"] = {
        "tau": round(totals["sd_tokens"] / max(1, totals["sd_forwards"]), 4),
        "tokens_per_s": round(sd_tokens_per_s, 2),
        "speedup": round(sd_tokens_per_s / plain_tokens_per_s, 4),
    }
    ssd["over_speculative_decoding"] = round(totals["tokens"] / totals["spec_s"] / sd_tokens_per_s, 4)
    if "modeled_separate_device_ms_per_step" in ssd:  # the prefill and each prompt's first token excluded
        steps = totals["forwards"] - prompts
        modeled = (totals["tokens"] - prompts) / (1e-3 * ssd["modeled_separate_device_ms_per_step"] * steps)
        ssd["modeled_separate_device_speedup"] = round(modeled / plain_tokens_per_s, 4)
    return ssd
