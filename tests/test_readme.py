"""The README's Python examples run as written (keeps the README true).

A block preceded by the line ``<!-- not run in tests: REASON -->`` is skipped with that
reason (e.g. it needs torchrun or a GPU).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"(?:<!-- not run in tests: (?P<why>[^>]*?) -->\s*\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks():
    text = README.read_text(encoding="utf-8")
    return [(m.group("code"), m.group("why")) for m in _BLOCK.finditer(text)]


def test_readme_has_examples():
    assert _blocks(), "README.md has no ```python example"


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_example_runs(index, monkeypatch, tmp_path):
    code, why = _blocks()[index]
    if why:
        pytest.skip(why)
    monkeypatch.chdir(tmp_path)  # examples that save files write into a scratch folder
    exec(compile(code, f"README.md example {index}", "exec"), {"__name__": "__readme__"})
