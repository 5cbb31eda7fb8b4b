"""Crash-safe checkpoints: a checkpoint folder is either the complete old one or the complete new one.

Layout under ``<output_dir>/checkpoints/``::

    latest/   full training state, written by ``accelerate`` (model, optimizer, scheduler, RNG states
              of every process, data position and counters), for exact resume
    best/     the best model so far as a ``transformers`` folder (``from_pretrained`` loads it)

Write protocol (every process takes part, the main process renames)::

    write <name>.tmp/  ->  rename <name> to <name>.old  ->  rename <name>.tmp to <name>  ->  delete <name>.old

A kill at any point leaves either ``<name>`` or ``<name>.old`` complete; :func:`find_resumable`
prefers the former. ``.tmp`` folders are never read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

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
