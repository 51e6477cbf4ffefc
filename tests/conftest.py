"""Shared fixtures. Tolerances live in tests/tolerances.py; backend lists in tests/backends.py."""

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
