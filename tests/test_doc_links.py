"""Relative links in the README, docs/, examples/, scripts/ and benchmarks/ reach a file of
the repository, and a ``#section`` reaches a heading of it (GitHub's anchor rule), so moving
a file or renaming a section without its links fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"```.*?```", re.S)


# text copied into benchmarks/RESULTS.md by the report, its links relative to RESULTS.md
# (which is checked)
_COPIED = {ROOT / "benchmarks" / "results" / "cpu-notes.md"}


def _markdown_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in ("docs", "examples", "scripts", "benchmarks"):
        files += sorted((ROOT / folder).rglob("*.md"))
    return [f for f in files if f not in _COPIED]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _CODE.sub("", path.read_text(encoding="utf-8"))
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _links(path: Path) -> list[str]:
    text = _CODE.sub("", path.read_text(encoding="utf-8"))
    return [m.group(1) for m in _LINK.finditer(text) if not re.match(r"[a-z]+:", m.group(1))]


def test_anchor_rule():
    assert _anchor("The primitive (`fastcl/ops/contract.py`)") == "the-primitive-fastclopscontractpy"
    assert _anchor("Matryoshka prefixes (`LSEProblem.dims`)") == "matryoshka-prefixes-lseproblemdims"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path):
    broken = []
    for link in _links(path):
        target, _, section = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(f"{link}: no such file")
        elif section and file.suffix == ".md" and section not in _anchors(file):
            broken.append(f"{link}: no heading with that anchor")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)
