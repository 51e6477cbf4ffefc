"""open-clip-torch's own loss code, for parity tests and benchmarks.

The package imports torchvision at the top, whose PyPI build does not load beside the CPU
torch, and its dependencies would replace that torch; ``scripts/setup.sh`` installs it with
``--no-deps`` and this loads its ``loss.py`` (which needs only torch) as a module of its own.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

OPEN_CLIP_VERSION = "3.3.0"


@functools.cache
def open_clip_loss() -> ModuleType | None:
    """open_clip's ``loss`` module, or None when open-clip-torch is not installed."""
    spec = importlib.util.find_spec("open_clip")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "loss.py"
    loader = importlib.util.spec_from_file_location("open_clip_loss_module", path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def require_open_clip() -> ModuleType:
    """The module, or a skip naming the install command (CI installs it: scripts/setup.sh)."""
    import pytest

    module = open_clip_loss()
    if module is None:
        pytest.skip(f"open-clip-torch is not installed (pip install --no-deps open_clip_torch=={OPEN_CLIP_VERSION})")
    return module
