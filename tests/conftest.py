"""Shared fixtures. Tolerances live in fastcl/testing.py; backend lists in tests/backends.py."""

from __future__ import annotations

import pytest

from fastcl._paths import data_dir as _data_dir


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


def pytest_report_header(config):
    import torch

    return f"fastcl test seed: {torch.initial_seed()} (set FASTCL_TEST_SEED to reproduce)"
