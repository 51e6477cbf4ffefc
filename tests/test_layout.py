"""The library holds only the library: nothing under ``fastcl/`` or ``kernels/`` (installed as
``fastcl.kernels``) imports the benchmark harness, its peers or the tests, and the harness and
the Triton developer tools are not part of the installed package; the tuned config tables the
tools write are package data."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ("benchmarks", "tests", "scripts")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_library_imports_nothing_outside_it():
    bad = []
    for folder in ("fastcl", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in _imports(path):
                if name.split(".")[0] in OUTSIDE:
                    bad.append(f"{path.relative_to(ROOT)}: import {name}")
    assert not bad, bad


def test_the_installed_packages_are_the_library_and_the_tables_are_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "fastcl" or p.startswith("fastcl.") for p in tool["packages"]), tool["packages"]
    assert "fastcl.bench" not in tool["packages"]
    assert not (ROOT / "fastcl" / "bench").exists()
    assert not (ROOT / "kernels" / "tune.py").exists() and not (ROOT / "kernels" / "aot.py").exists()
    assert "tuned/*.json" in tool["package-data"]["fastcl.kernels"]
    # the table directory the runtime reads is the one the package data names
    from fastcl.kernels import configs

    assert configs.TUNED_DIR == ROOT / "kernels" / "tuned"


def test_importing_the_library_loads_no_harness():
    code = (
        "import sys, fastcl, fastcl.losses, fastcl.ops.dispatch, fastcl.testing, fastcl.__main__; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('benchmarks', 'tests')); "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
