"""Crash-safe checkpoints and shards: a checkpoint folder is either the complete old one or the complete new one.

Layout under ``<output_dir>/checkpoints/``::

    latest/   full training state, written by ``accelerate`` (model, optimizer, scheduler, RNG states
              of every process, data position and counters), for exact resume
    best/     the best model so far as a ``transformers`` folder (``from_pretrained`` loads it)

Write protocol (every process takes part, the main process renames)::

    write <name>.tmp/  ->  rename <name> to <name>.old  ->  rename <name>.tmp to <name>  ->  delete <name>.old

A kill at any point leaves either ``<name>`` or ``<name>.old`` complete; :func:`find_resumable`
prefers the former. ``.tmp`` folders are never read.

Data preparation (tokenizing, regenerating answers, caching features) is divided among the ranks of a
launch instead (:func:`run_sharded`): each rank publishes its own shard files atomically (temporary
name, fsync, rename), one rank merges them into the artefact a single process would have written, and
a killed run keeps the shards that were finished.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: test hook: "kill_after_step:N" or "kill_during_save:N" sends SIGKILL to this process
FAULT_ENV = "DRAFTSMITH_FAULT"


def fault_point(kind: str, step: int) -> None:
    """SIGKILL this process when ``DRAFTSMITH_FAULT`` names this point (used by the resume tests)."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec and spec == f"{kind}:{step}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def write_atomically(accelerator, final: Path, write: Callable[[Path], None], step: int | None = None) -> None:
    """Run ``write(tmp_folder)`` on every process (or, with ``accelerator=None``, in this one alone),
    then publish ``tmp_folder`` as ``final``. ``step``: a training checkpoint's step, for fault tests."""
    final = Path(final)
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    main = accelerator is None or accelerator.is_main_process
    barrier = (lambda: None) if accelerator is None else accelerator.wait_for_everyone
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    write(tmp)
    barrier()
    if step is not None:
        fault_point("kill_during_save", step)
    if main:
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def find_resumable(folder: Path) -> Path | None:
    """The newest complete copy of ``folder`` (itself, else the ``.old`` left by a kill mid-rename)."""
    folder = Path(folder)
    for candidate in (folder, folder.with_name(folder.name + ".old")):
        if (candidate / "trainer_state.json").exists():
            return candidate
    return None


# --------------------------------------------------------------------------------------------------
# Data preparation divided among ranks: per-rank shards, published atomically, merged by one rank
# --------------------------------------------------------------------------------------------------


def _alone() -> None:
    return None


def _alone_gather(obj) -> list:
    return [obj]


@dataclass(frozen=True)
class Ranks:
    """The processes that divide a piece of data preparation among them, and this one's place.

    ``barrier()`` returns once every rank has called it; ``gather(obj)`` returns every rank's ``obj`` in
    rank order, on every rank (a barrier too). Every rank must make the same sequence of these calls.
    The default is a world of one, where both are immediate."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = _alone
    gather: Callable[[object], list] = _alone_gather

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def of(cls, state) -> Ranks:
        """The ranks of an ``accelerate`` ``Accelerator`` or ``PartialState`` (None: a world of one)."""
        if state is None or state.num_processes == 1:
            return cls()

        def gather(obj) -> list:
            import torch.distributed as dist

            out = [None] * state.num_processes
            dist.all_gather_object(out, obj)
            return out

        return cls(state.process_index, state.num_processes, state.wait_for_everyone, gather)


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Make the complete file (or folder) ``tmp`` appear as ``final``: its data synced, renamed, and the
    rename synced, so ``final`` exists only complete, before and after a crash."""
    if tmp.is_dir():
        for child in tmp.iterdir():
            fsync_path(child)
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


def write_file_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` a hidden sibling of ``final`` (same suffix, unique to this process and thread), then
    :func:`publish` it as ``final``; a failure leaves no ``tmp`` behind and ``final`` as it was."""
    final = Path(final)
    tmp = final.with_name(f".{final.stem}.tmp-{os.getpid()}-{threading.get_ident()}{final.suffix}")
    try:
        write(tmp)
        publish(tmp, final)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return final


def shard_bounds(n: int, world: int, per: int) -> list[tuple[int, int]]:
    """Contiguous ranges ``[lo, hi)`` covering items ``0 .. n-1`` in order: ``ceil(n / per)`` of them, but at
    least one a rank while there are items for it, their sizes within one of each other (none over ``per``)."""
    count = max(-(-n // per), min(world, n))
    return [(i * n // count, (i + 1) * n // count) for i in range(count)]


def run_sharded(
    ranks: Ranks,
    count: int,
    done: Callable[[int], bool],
    write: Callable[[int], object],
    merge: Callable[[], None],
    what: str,
) -> list[list]:
    """Units ``0 .. count-1`` of a job done by all ranks, then merged by the main one.

    The units that are not ``done`` as the main rank sees them before anyone starts are dealt round-robin
    (the ``k``-th to rank ``k % world``), so the ranks' shares differ by at most one unit and a resumed run
    divides only what is left. Each rank ``write``s its own; ``write(i)`` must publish unit ``i``
    atomically (after it ``done(i)`` holds and not before), so a killed run leaves finished units, which
    the next run keeps, and never half a unit. Then every rank checks that it sees every unit (the units
    live on one filesystem all ranks share; otherwise every rank raises the same error), the main rank
    calls ``merge()`` and the others wait for it: nobody waits on anyone before the slowest share is done.

    Returns, in rank order, the list of what each rank's ``write`` calls returned (one entry a unit
    written). Collectives: gather, barrier, gather, barrier, on every rank."""
    todo = ranks.gather([i for i in range(count) if not done(i)])[0]
    results = [write(i) for i in todo[ranks.rank :: ranks.world]]
    ranks.barrier()  # every unit written: now each rank checks what it sees
    report = ranks.gather((results, [i for i in range(count) if not done(i)]))
    unseen = {rank: missing[:5] for rank, (_, missing) in enumerate(report) if missing}
    if unseen:
        raise RuntimeError(
            f"{what}: units finished by some ranks are missing on others (rank: first missing units "
            f"{unseen}); every rank must see the same folder: put the cache on a filesystem they share"
        )
    if ranks.is_main:
        merge()
    ranks.barrier()
    return [r for r, _ in report]
