"""The packages' layers point one way, and importing them changes nothing in the user's process.

    distill.base      <- imports nothing else from the project
    drafters, parcae  <- the models: from distill only distill.base; no loop, no recipes
    serve_eval        <- the loop: the models and distill.base; no trainer, no recipes
    distill           <- the engine: distill.base and the models it trains; no loop, no recipes
    recipes           <- entry points: anything

Every import counts, including those inside functions (an import deferred into a function still
couples the packages; it only hides the cycle from the interpreter).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("distill", "drafters", "parcae", "serve_eval", "recipes")


def layer(module: str) -> str:
    return (
        "distill.base" if module == "distill.base" or module.startswith("distill.base.") else module.partition(".")[0]
    )


ALLOWED = {  # layer -> the project layers it may import
    "distill.base": {"distill.base"},
    "drafters": {"drafters", "distill.base"},
    "parcae": {"parcae", "distill.base"},
    "serve_eval": {"serve_eval", "drafters", "parcae", "distill.base"},
    "distill": {"distill", "distill.base", "drafters", "parcae"},
    "recipes": set(PACKAGES) | {"distill.base"},
}


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of a project package in ``path``."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from distill import base` imports distill.base; `from distill.base import x` imports distill.base
            names = [f"{stem}.{alias.name}" if stem in PACKAGES else stem for alias in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in PACKAGES]
    return found


def imports_against_the_layers() -> list[str]:
    """``path:line imports module`` for every import in the packages under ``REPO`` that its layer may not make."""
    bad = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for line, imported in project_imports(path):
                if layer(imported) not in ALLOWED[layer(module)]:
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    return bad


def test_layers_import_one_way():
    bad = imports_against_the_layers()
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_walk_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    """The checker itself: a deferred import and a relative one are both found, and of the three only the
    one against the layers is reported (the test above would pass vacuously if the walk saw nothing)."""
    pkg = tmp_path / "drafters"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text(
        "def f():\n    from serve_eval.engine import measure\n\nfrom .core import y\nfrom distill import base\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    found = {n: line for line, n in project_imports(pkg / "x.py")}
    assert found == {"serve_eval.engine": 2, "drafters.core": 4, "distill.base": 5}
    assert imports_against_the_layers() == ["drafters/x.py:2 imports serve_eval.engine"]  # the loop, from a model


def test_importing_the_packages_changes_nothing_in_the_process():
    """No environment variable set and no logger level changed by importing any project package
    (third-party libraries imported first, so only what the project itself does is compared)."""
    code = """
import logging, os
import torch, transformers, accelerate, torchao  # noqa: F401
env = dict(os.environ)
levels = {name: logging.getLogger(name).level for name in list(logging.root.manager.loggerDict)}
import distill, distill.base.features, drafters, parcae, serve_eval.loop, serve_eval.parity, distill.drafter_eval  # noqa
changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
relevelled = sorted(n for n, lv in levels.items() if logging.getLogger(n).level != lv)
print(changed, relevelled)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[] []", out.stdout + out.stderr
