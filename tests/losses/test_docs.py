"""The losses' documentation runs and is complete: docstring examples (doctest), the Python
examples of docs/losses.md, and every parameter of every public loss documented."""

from __future__ import annotations

import doctest
import inspect
import re
from pathlib import Path

import pytest

import fastcl.losses as L
from fastcl.losses import gclsr, mnrl, supcon, supmpn

DOC = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
_BLOCK = re.compile(r"```python\n(?P<code>.*?)```", re.S)
PUBLIC = [getattr(L, name) for name in L.__all__ if callable(getattr(L, name))]


@pytest.mark.parametrize("module", [supmpn, supcon, mnrl, gclsr], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{module.__name__} has no docstring example"
    assert result.failed == 0


def test_every_public_function_has_an_example():
    missing = [f.__name__ for f in PUBLIC if inspect.isfunction(f) and ">>>" not in (f.__doc__ or "")]
    assert not missing


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda f: f.__name__)
def test_every_argument_is_documented(obj):
    """Each parameter appears as ``name:`` in the docstring (shapes and dtypes live there), and no
    ``{shared}`` placeholder is left unfilled."""
    doc = obj.__doc__ or ""
    params = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj).parameters
    names = [p for p in params if p not in ("self", "kw", "args", "kwargs")]
    undocumented = [p for p in names if not re.search(rf"^\s*{p}:", doc, re.M)]
    assert not undocumented, f"{obj.__name__}: {undocumented}"
    assert "{shared}" not in doc and "{returns}" not in doc


def test_every_module_documents_the_options_it_forwards():
    """A loss module takes its function's keyword options: those are documented on the class."""
    for cls in (L.SupMPNLoss, L.SupConLoss, L.MNRLoss, L.InfoNCELoss, L.EdaCSELoss):
        for name in ("temperature", "learn_temperature", "reduction", "backend", "similarity", "matryoshka_dims"):
            assert re.search(rf"^\s*{name}:", cls.__doc__ or "", re.M), (cls.__name__, name)


def _doc_blocks():
    return _BLOCK.findall(DOC.read_text(encoding="utf-8"))


def test_docs_have_examples():
    assert _doc_blocks(), "docs/losses.md has no ```python example"


@pytest.mark.parametrize("index", range(len(_doc_blocks())))
def test_docs_example_runs(index):
    code = _doc_blocks()[index]
    exec(compile(code, f"docs/losses.md example {index}", "exec"), {"__name__": "__docs__"})
