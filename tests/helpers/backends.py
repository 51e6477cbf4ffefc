"""Which fused backends the backend-matrix tests run, and on which device.

``FASTCL_TEST_BACKENDS``  comma list (default: ``torch,cpp``); the Triton interpreter
                          suite runs the same tests in its own process with ``triton``.
``FASTCL_TEST_DEVICE``    ``cpu`` (default) or ``cuda`` (on a GPU machine).
``FASTCL_REQUIRE_BACKENDS`` comma list of backends that must be available: CI sets it so a
                          broken build fails instead of skipping.
``FASTCL_TEST_SMALL=1``   only the small shapes (for the slow Triton interpreter).
"""

from __future__ import annotations

import os

import pytest
import torch

from fastcl.ops import dispatch


def _split(var: str, default: str = "") -> list[str]:
    return [x for x in os.environ.get(var, default).split(",") if x]


def backends_under_test() -> list[str]:
    return _split("FASTCL_TEST_BACKENDS", "torch,cpp")


def device_under_test() -> torch.device:
    return torch.device(os.environ.get("FASTCL_TEST_DEVICE", "cpu"))


def small_only() -> bool:
    return os.environ.get("FASTCL_TEST_SMALL") == "1"


def require(name: str) -> None:
    """Skip (or fail, if required) when backend ``name`` cannot run here at all."""
    status = dispatch.describe().get(name, f"unknown backend {name!r}")
    if status == "available":
        return
    if name in _split("FASTCL_REQUIRE_BACKENDS"):
        pytest.fail(f"backend {name!r} is required but unavailable: {status}")
    pytest.skip(f"backend {name!r} unavailable: {status}")
