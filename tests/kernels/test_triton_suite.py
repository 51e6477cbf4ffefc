"""Runs the Triton interpreter suite from the plain test command.

The interpreter must be switched on before Triton kernels are imported, so the suite
(the core backend matrix, primitive, property, robustness and double-backward tests for
``triton`` on small shapes, plus the Triton-specific interpreter, non-finite, Matryoshka and extension tests) runs
in a child pytest process with
``TRITON_INTERPRET=1``. ``FASTCL_REQUIRE_BACKENDS=triton`` makes a backend that cannot
run fail there instead of skipping. ``-k triton`` keeps the tests that run Triton (its files,
and the shared files' cases whose id names the backend): the reference's cases and the
backend-free ones of those files run in the main process already (a third of the child's
tests, ~25 % of its time).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("already inside the interpreter suite", allow_module_level=True)
pytest.importorskip("triton")

TESTS = Path(__file__).resolve().parents[1]
FILES = [
    "ops/test_backend_matrix.py",
    "ops/test_primitive.py",
    "ops/test_property.py",
    "kernels/test_triton_interpret.py",
    "kernels/test_triton_step.py",
    "kernels/test_triton_nonfinite.py",
    "kernels/test_triton_dot_nonfinite.py",
    "kernels/test_triton_matryoshka.py",
    "ops/test_matryoshka_contract.py",
    "ops/test_robust.py",
    "ops/test_double_backward.py",
    "ops/test_extensions.py",
    "kernels/test_triton_extensions.py",
]


def test_triton_interpreter_suite():
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "FASTCL_TEST_BACKENDS": "triton",
        "FASTCL_REQUIRE_BACKENDS": "triton",
        "FASTCL_TEST_SMALL": "1",
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton"]
    cmd += [str(TESTS / f) for f in FILES]
    done = subprocess.run(cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1500)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
    assert done.returncode == 0, f"interpreter suite failed (exit {done.returncode}):\n{tail}"
    assert " passed" in tail and "no tests ran" not in tail, tail
    print(tail.splitlines()[-1])
