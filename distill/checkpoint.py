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


def write_atomically(accelerator, final: Path, write: Callable[[Path], None], step: int) -> None:
    """Run ``write(tmp_folder)`` on every process, then publish ``tmp_folder`` as ``final``."""
    final = Path(final)
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    write(tmp)
    accelerator.wait_for_everyone()
    fault_point("kill_during_save", step)
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def find_resumable(folder: Path) -> Path | None:
    """The newest complete copy of ``folder`` (itself, else the ``.old`` left by a kill mid-rename)."""
    folder = Path(folder)
    for candidate in (folder, folder.with_name(folder.name + ".old")):
        if (candidate / "trainer_state.json").exists():
            return candidate
    return None
