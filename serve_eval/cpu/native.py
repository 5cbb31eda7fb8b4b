"""C++ operators of the decoding loop, built once per machine and loaded into ``torch.ops``.

:func:`load` compiles one source file with torch's extension builder into torch's extensions folder
(``TORCH_EXTENSIONS_DIR`` where set), under a name that hashes the source, the flags and the torch and
Python versions: a changed source or a new torch builds anew, anything else loads what is there. The
build happens in a private folder and is renamed into place, so a build killed halfway leaves nothing a
later run would load, and two processes building at once do not wait on each other's lock (each
builds, ~20 s; the second rename replaces the first's file with the same bytes).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch


@functools.cache  # once a process: a library's operators register once
def load(source: Path, cflags: tuple[str, ...] = ("-O2",)) -> None:
    """Build ``source`` (once per machine) and load its operators; raises where it cannot be built."""
    from torch.utils import cpp_extension

    key = source.read_bytes() + f"{cflags} {torch.__version__} {sys.version}".encode()
    name = f"draftsmith_{source.stem}_{hashlib.sha256(key).hexdigest()[:16]}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    built = root / f"{name}.so"
    if built.exists():
        torch.ops.load_library(str(built))
        return
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{name}.", dir=root) as folder:
        cpp_extension.load(
            name, [str(source)], build_directory=folder, is_python_module=False, extra_cflags=list(cflags)
        )  # builds, and loads
        os.replace(Path(folder) / f"{name}.so", built)


def avx2_operator(source: Path, what: str, fallback: str, flags: tuple[str, ...] = ()) -> bool:
    """Whether the AVX2 + FMA operator in ``source`` serves here: an x86 CPU with AVX2, and the operator
    built (:func:`load`, with ``flags`` besides). Where the build fails (no compiler, say), a warning
    names ``what`` did not build and that ``fallback`` serves instead."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        load(source, ("-O3", "-mavx2", "-mfma", *flags))
        return True
    except Exception as error:  # noqa: BLE001  (no compiler, a failed build: the fallback serves)
        warnings.warn(f"{what} could not be built ({type(error).__name__}: {error}); {fallback} serves", stacklevel=3)
        return False
