"""Shared fixtures and the test tiers.

Layout: one folder per layer (``ops``, ``losses``, ``kernels``, ``distributed``, ``train``,
``eval``, ``integrations``, ``bench``), ``examples`` (every program of examples/ at a tiny
size) and one helper package, ``tests.helpers``
(backend lists, tiny models, process spawning; the tolerances are ``fastcl.testing``).

Tiers: ``pytest tests -m "not slow"`` is the fast tier a developer runs on every change
(under 2 minutes on a 2-core machine once the C++ backend is built); ``pytest tests``
(what ``.ci/run`` runs) is everything. A test is slow when it is marked ``slow`` itself or
when its file or test id is listed in :data:`SLOW` below: multi-process runs, real-model
and real-data evaluation, training loops, compiler checks (nvcc, Triton AOT) and the
Triton interpreter leg.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# torch.compile's kernel cache is private to this run (and the processes it spawns): the
# default /tmp/torchinductor_<user> is shared by every run on the machine, and two runs
# compiling the same graph at once have aborted inside a half-written cached kernel.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastcl-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

import pytest  # noqa: E402
import torch  # noqa: E402

from fastcl._paths import data_dir as _data_dir

# Paths relative to tests/; a "::name" suffix marks one test (every parametrisation).
SLOW = (
    "distributed/",
    "kernels/test_triton_suite.py",
    "kernels/test_triton_aot.py",
    "kernels/test_cuda_compile.py",
    "ops/test_memory.py",
    "ops/test_compile.py",
    "train/test_train.py",
    "train/test_train_resume.py",
    "train/test_gclsr_train.py::test_recipe_steps_decrease_the_loss",
    "eval/test_eval_minilm.py",
    "eval/test_eval_cli.py",
    "eval/test_eval_transfer.py",
    "eval/test_eval_classifier.py::test_fit_grid_equals_sentevals_classifier",
    "integrations/test_st_trainer.py",
    "integrations/test_st_trainer_api.py",
    "kernels/test_api_triton.py",
    "test_readme.py",
)
_TESTS = Path(__file__).resolve().parent


# The longest single tests (minutes of one core each on a 2-core machine) run first, so that
# under pytest-xdist (.ci/run: ``-n auto``) they overlap with the many short ones instead of
# finishing alone at the end.
LONGEST_FIRST = (
    "kernels/test_triton_suite.py",
    "kernels/test_triton_aot.py::test_kernels_compile_with_the_gpu_machines_triton",
    "kernels/test_triton_aot.py::test_every_launch_passes_the_frontend",
    "kernels/test_cpp_gemm_tile.py::test_cpp_contract_suites_with_the_tile_forced",
    "examples/test_examples.py",
    "distributed/test_ring_memory.py",
)


def _matches(rel: str, name: str, entries) -> bool:
    return _position(rel, name, entries) < len(entries)


def _position(rel: str, name: str, entries) -> int:
    """The index of the first entry ``rel`` (a path below tests/) or ``name`` (path::test) matches."""
    hits = (i for i, s in enumerate(entries) if (rel.startswith(s) if s.endswith("/") else s in (rel, name)))
    return next(hits, len(entries))


def pytest_collection_modifyitems(config, items):
    first = []
    for item in items:
        rel = Path(item.fspath).resolve().relative_to(_TESTS).as_posix()
        name = f"{rel}::{item.originalname}"
        if _matches(rel, name, SLOW):
            item.add_marker(pytest.mark.slow)
        first.append(_position(rel, name, LONGEST_FIRST))
    order = sorted(range(len(items)), key=lambda i: first[i])  # stable: the rest keep their order
    items[:] = [items[i] for i in order]


@pytest.fixture
def fastcl_config():
    """``fastcl_config(cpp={"gemm": "own"}, strategy="fused", ...)`` sets ``fastcl.config`` knobs
    for the rest of the test (calls stack); the configuration before the test comes back after."""
    import contextlib

    from fastcl import config

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(config.override(**changes))


@pytest.fixture
def threads():
    """``threads(n)`` sets torch's intra-op thread count for the test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def data_dir():
    """The staged data directory; tests that need it skip with the reason when absent."""
    path = _data_dir()
    if not path.is_dir():
        pytest.skip(f"staged data not found at {path} (set FASTCL_DATA_DIR)")
    return path


def pytest_configure(config):
    # Fresh random inputs every run; FASTCL_TEST_SEED reproduces a failing run.
    import os

    import torch

    seed = os.environ.get("FASTCL_TEST_SEED")
    if seed is not None:
        torch.manual_seed(int(seed))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one intra-op thread per pytest-xdist worker: the workers share the cores (tests that
        # need more set them with the ``threads`` fixture; spawned ranks choose their own)
        torch.set_num_threads(1)


def pytest_report_header(config):
    import torch

    return f"fastcl test seed: {torch.initial_seed()} (set FASTCL_TEST_SEED to reproduce)"
