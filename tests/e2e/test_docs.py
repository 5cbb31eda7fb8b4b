"""The documentation describes the product as it is.

* The generated reference pages (docs/reference/) equal what ``python -m recipes.reference`` writes.
* README.md and docs/ carry no work history (ordinals of work periods, "this session", "tonight", dates
  of work outside the benchmarks page, notes on how fast the machine felt); neither do the code, the
  recipes' comments and the C++ operators (CHANGELOG.md is where history goes).
* Everything README.md and docs/ cite exists: relative links and their anchors, repository paths,
  ``python -m`` modules, ``make`` targets, shipped recipe names, dotted modules, recipe keys given as
  overrides, and ``draftsmith`` flags.
* README.md stays within 180 lines and docs/benchmarks.md within 400.
"""

from __future__ import annotations

import re
from functools import cache, lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PACKAGES = ("distill", "drafters", "parcae", "serve_eval", "recipes")
TOP_DIRS = (*PACKAGES, "tests", "docs", "accelerate_configs", ".ci")
FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "md", "png", "cpp", "safetensors", "npy", "txt"}
SKIP_DIRS = {".venv", "runs", ".git", "tests", "__pycache__", ".pytest_cache"}

_ORDINALS = [
    "first",
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
    "tenth",
    "eleventh",
    "twelfth",
    "thirteenth",
    "fourteenth",
    "fifteenth",
    "sixteenth",
    "seventeenth",
    "eighteenth",
    "nineteenth",
    "twentieth",
]
_ORDINALS += [f"twenty-{o}" for o in _ORDINALS[:9]] + ["thirtieth"]
_GAP = r"(?:\s|#|//|\*)+"  # words may wrap onto the next line of a comment
HISTORY = [
    re.compile(rf"\b({'|'.join(_ORDINALS)}|\d+(st|nd|rd|th)){_GAP}(work{_GAP})?sessions?\b", re.I),
    re.compile(
        rf"\b(this|that|the last|last|the next|the previous|an earlier|the same|three|two|several){_GAP}sessions?\b",
        re.I,
    ),
    re.compile(r"\bsession'?s (start|end)\b|\b(start|end) of (the|this) session\b", re.I),
    re.compile(r"\btonight\b|\bthis morning\b|\byesterday\b", re.I),
    re.compile(r"\bwe tried\b|\bwe then\b", re.I),
    re.compile(r"\b(slow|fast|quiet|busy|noisy) (day|phase|spell)\b", re.I),
    re.compile(r"\bthe machine (ran|was|felt) (about )?(\w+ )?(slower|faster|slow|fast)\b", re.I),
]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _history_hits(text: str, dates: bool) -> list[str]:
    hits = []
    for pattern in HISTORY + ([DATE] if dates else []):
        for m in pattern.finditer(text):
            hits.append(f"{text.count(chr(10), 0, m.start()) + 1}: {' '.join(m.group(0).split())!r}")
    return sorted(hits, key=lambda h: int(h.split(":")[0]))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------------------- generated pages


def test_reference_pages_are_generated_from_the_schema_and_the_parser():
    from recipes.reference import stale_pages

    stale = [_rel(p) for p in stale_pages()]
    assert not stale, f"stale generated pages {stale}: run `python -m recipes.reference` and commit them"


def test_the_reference_walks_nested_sections():
    """A section nested inside a section (and a mapping of sections) gets its own table under its dotted path."""
    from typing import Optional

    from pydantic import BaseModel, Field

    from recipes.reference import _walk, type_name

    class Inner(BaseModel):
        """An inner section."""

        depth: int = Field(3, gt=0, description="how deep")

    class Middle(BaseModel):
        inner: Inner = Field(default_factory=Inner)
        maybe: Inner | None = None
        named: dict[str, Inner] = Field(default_factory=dict)

    class Top(BaseModel):
        middle: Middle = Field(default_factory=Middle)

    seen, order = {}, []
    _walk(Top, "", "top", seen, order)
    assert order == [Middle, Inner]
    assert list(seen[Inner]) == ["middle.inner", "middle.maybe", "middle.named.<name>"]
    assert type_name(Optional[Inner]) == type_name(Inner | None) == "[Inner](#inner) | null"  # noqa: UP045 both spellings


# ------------------------------------------------------------------------------ sizes and history


def test_readme_and_benchmarks_page_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 180
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 400


def test_docs_record_no_work_history():
    hits = {}
    for path in DOCS:
        # dates belong to the benchmarks page's tables and the README's "measured at" line only
        dates = path.name != "benchmarks.md" or path.parent.name != "docs"
        text = path.read_text()
        if path.name == "README.md":
            text = "\n".join("" if line.startswith("Measured by") else line for line in text.splitlines())
        found = _history_hits(text, dates=dates and "reference" not in path.parts)
        if found:
            hits[_rel(path)] = found
    assert not hits, f"work history in the docs (it goes in CHANGELOG.md): {hits}"


def _code_files(tests: bool = False) -> list[Path]:
    """The code, the recipes and the C++ operators (with ``tests``, the tests' too)."""
    skip = SKIP_DIRS - ({"tests"} if tests else set())
    out = []
    for suffix in ("*.py", "*.yaml", "*.cpp", "Makefile"):
        for path in ROOT.rglob(suffix):
            if not skip & set(path.relative_to(ROOT).parts):
                out.append(path)
    return sorted(out)


def test_code_and_recipes_record_no_work_history():
    hits = {_rel(p): h for p in _code_files() if (h := _history_hits(p.read_text(errors="replace"), dates=True))}
    assert not hits, f"work history in code, recipe comments or C++ (it goes in CHANGELOG.md): {hits}"


def test_docs_pages_cited_in_code_exist():
    missing = {}
    for path in _code_files(tests=True):
        for m in re.finditer(r"\bdocs/[\w./-]+\.md", path.read_text(errors="replace")):
            if not (ROOT / m.group(0)).exists():
                missing.setdefault(_rel(path), []).append(m.group(0))
    assert not missing, f"code cites docs pages that do not exist: {missing}"


# --------------------------------------------------------------------------------- what is cited


def _strip_urls(text: str) -> str:
    return re.sub(r"https?://\S+", " ", text)


def _code_spans(text: str) -> list[str]:
    """Fenced blocks' lines and inline code spans."""
    spans, rest = [], []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        (spans if fenced else rest).append(line)
    spans += re.findall(r"`([^`\n]+)`", "\n".join(rest))
    return spans


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    anchors, counts = set(), {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m and not fenced:
            slug = _slug(m.group(1))
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
        anchors.update(re.findall(r'<a id="([^"]+)"', line))
    return frozenset(anchors)


def test_links_and_their_anchors_exist():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{_rel(path)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_rel(path)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


_PLACEHOLDER = re.compile(r"KIND|NAME|[<>*{}]|(^|/)[A-Z][A-Z_0-9]*(/|$|\.)")


def _module_exists(dotted: str) -> bool:
    """``a.b.c`` names a module, or an attribute defined in the deepest module it names."""
    parts = dotted.split(".")
    path = ROOT
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
            continue
        if (path / f"{part}.py").exists():
            path = path / f"{part}.py"
            rest = parts[i + 1 :]
            break
        rest = parts[i:]
        path = path / "__init__.py"
        break
    else:
        return True
    if not rest:
        return True
    source = path.read_text() if path.exists() else ""
    return re.search(rf"\b{re.escape(rest[0])}\b", source) is not None


@lru_cache(maxsize=1)
def _recipe_keys() -> tuple[frozenset[str], frozenset[str]]:
    """Every dotted key of every recipe schema ('<name>' for a mapping's keys) and the top-level fields."""
    from recipes.reference import models_in
    from recipes.registry import RECIPES, recipe_module

    keys, tops = set(), set()

    def walk(model, prefix):
        for name, info in model.model_fields.items():
            key = f"{prefix}{name}"
            keys.add(key)
            for step, sub in models_in(info.annotation):
                walk(sub, f"{key}{step.replace('[]', '')}.")

    for name in RECIPES:
        schema = recipe_module(name).SCHEMA
        tops.update(schema.model_fields)
        walk(schema, "")
    return frozenset(keys), frozenset(tops)


def _key_exists(dotted: str) -> bool:
    keys, _ = _recipe_keys()
    parts = dotted.split(".")
    for key in keys:
        kparts = key.split(".")
        if len(kparts) == len(parts) and all(k in (p, "<name>") for k, p in zip(kparts, parts)):
            return True
    return False


@lru_cache(maxsize=1)
def _flags() -> dict[str, frozenset[str]]:
    import argparse

    from recipes.cli import _parser

    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {
                name: frozenset(s for a in sub._actions for s in a.option_strings)
                for name, sub in action.choices.items()
            }
    return {}


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def _cited(path: Path) -> list[str]:
    """What ``path`` cites that does not exist, one message each."""
    text = _strip_urls(path.read_text())
    spans = _code_spans(text)
    configs = {p.name for p in (ROOT / "recipes" / "configs").glob("*.yaml")} | {
        p.name for p in (ROOT / "accelerate_configs").glob("*.yaml")
    }
    missing = []
    for m in re.finditer(rf"(?<![\w./-])((?:{'|'.join(re.escape(d) for d in TOP_DIRS)})/[\w./-]*)", text):
        cited = m.group(1).rstrip(".,:;/")
        if not _PLACEHOLDER.search(cited) and not (ROOT / cited).exists():
            missing.append(f"path {cited}")
    for module in re.findall(r"python -m ([\w.]+)", text):
        if module.split(".")[0] in PACKAGES and not _module_exists(module):
            missing.append(f"module {module}")
    _, tops = _recipe_keys()
    for span in spans:
        code = span.split(" # ")[0]
        missing += _cited_names(code, configs) + _cited_keys_and_flags(code, tops)
    return missing


def _cited_names(span: str, configs: set[str]) -> list[str]:
    """The make targets, shipped recipes, recipe files and modules one code span cites that do not exist."""
    missing = []
    for target in re.findall(r"\bmake ([a-z][\w-]*)", span):
        if target not in _make_targets():
            missing.append(f"make target {target}")
    for name in re.findall(r"\bdraftsmith (?:run|validate) ([\w-]+)(?=\s|$)", span):
        if not _PLACEHOLDER.search(name) and f"{name}.yaml" not in configs:
            missing.append(f"shipped recipe {name}")
    for name in re.findall(r"(?<![\w/.-])([\w-]+\.yaml)\b", span):
        if not _PLACEHOLDER.search(name) and name not in configs | {"recipe.yaml", "my_recipe.yaml", "r.yaml"}:
            missing.append(f"recipe file {name}")
    for dotted in re.findall(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.\w+)+)", span):
        if not _module_exists(dotted) and not _key_exists(dotted):
            missing.append(f"module {dotted}")
    return missing


def _cited_keys_and_flags(span: str, tops) -> list[str]:
    """The recipe keys and ``draftsmith`` flags one code span cites that do not exist."""
    missing = []
    is_command = re.search(r"draftsmith (run|validate)|recipes\.cli run|QUICKSTART_ARGS=", span)
    whole = re.fullmatch(r"'?([a-z_]\w*(?:\.[\w]+)+)(?:=.*|: .*)?'?", span.strip())
    overrides = re.findall(r"(?:^|\s|')([a-z_]\w*(?:\.\w+)*)=", span) if is_command else []
    for key in overrides + ([whole.group(1)] if whole else []):
        first, last = key.split(".")[0], key.rsplit(".", 1)[-1]
        if first in PACKAGES and _module_exists(key) or last in FILE_SUFFIXES:
            continue
        if first in tops and not _key_exists(key):
            missing.append(f"recipe key {key}")
    for command, rest in re.findall(r"\bdraftsmith (eval|export|run|validate|ls)\b([^|;&]*)", span):
        for flag in re.findall(r"(?<![\w-])(--[\w-]+)", rest):
            if flag not in _flags().get(command, ()):
                missing.append(f"flag draftsmith {command} {flag}")
    return missing


def test_everything_the_docs_cite_exists():
    written = [p for p in DOCS if "reference" not in p.relative_to(ROOT).parts]
    missing = {_rel(p): found for p in written if (found := sorted(set(_cited(p))))}
    assert not missing, f"the docs cite what does not exist: {missing}"


def test_the_generated_reference_cites_what_exists():
    """The reference pages carry the parser's examples and the schema's descriptions: their keys, flags and
    modules must exist too (a failure here is a fix in recipes/cli.py or the schema, then a regeneration)."""
    generated = sorted((ROOT / "docs" / "reference").glob("*.md"))
    missing = {_rel(p): found for p in generated if (found := sorted(set(_cited(p))))}
    assert not missing, f"the generated reference cites what does not exist: {missing}"
