"""Every tool in ``scripts/`` at least starts on the CPU: the Python ones answer ``--help``
(their imports resolve and their arguments build), the shell ones parse (``bash -n``).

Most of them only run on a lent GPU, where a broken import would cost minutes of a
15-minute loan; ``scripts/gpu_lease.sh`` itself is rehearsed with ``DRY_RUN=1``
(docs/benchmarks.md).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_python_tool_answers_help(path):
    proc = subprocess.run(
        [sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.sh")), ids=lambda p: p.name)
def test_shell_tool_parses(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_script_has_its_readme_line():
    """``scripts/`` keeps set-up and durable tools, each with a line in scripts/README.md."""
    readme = (SCRIPTS / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([^`]+)` \|", readme, re.M))
    present = {p.name for p in SCRIPTS.iterdir() if p.suffix in (".py", ".sh")}
    assert present == listed, f"not in the README: {sorted(present - listed)}; gone: {sorted(listed - present)}"
