"""Which backend runs an op: the ``backend=`` argument > ``FASTCL_BACKEND`` > automatic.

A backend is a module listed in :data:`BACKEND_MODULES` that defines

* ``OPS``: ``{op_name: implementation}``; each implementation has ``name``,
  ``autograd`` (True: differentiated by autograd, False: explicit forward/backward used by
  fastcl's ``torch.autograd.Function``) and ``unsupported(*inputs) -> list[str]``;
* ``unavailable() -> str | None``: why the whole backend cannot run here (not installed,
  build failed), checked lazily.

An explicit request that cannot take the inputs raises :class:`BackendUnavailableError`
listing *every* reason; the automatic choice takes the first backend of
:data:`AUTO_ORDER` with no reason, and the ``torch`` backend takes everything, so
automatic choice never fails and never changes the result beyond float rounding.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

BACKEND_MODULES = {
    "reference": "fastcl.reference",
    "torch": "fastcl.ops._torch_impl",
    "cpp": "fastcl.ops._cpp",
    "triton": "fastcl.ops._triton",
    "cuda": "fastcl.ops._cuda",
}

# Preference per device type when the caller says "auto".
AUTO_ORDER = {
    "cuda": ("triton", "cuda", "torch"),
    "cpu": ("cpp", "torch"),
}
FALLBACK = "torch"

ENV_VAR = "FASTCL_BACKEND"


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run the given inputs (the message says why)."""


def _module(name: str) -> tuple[Any | None, str | None]:
    path = BACKEND_MODULES[name]
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name == path:
            return None, f"backend {name!r} is not part of this build of fastcl"
        return None, f"cannot import {path}: {exc}"
    except Exception as exc:  # a broken optional dependency must not break dispatch
        return None, f"cannot import {path}: {type(exc).__name__}: {exc}"
    return module, None


def _unavailable(name: str, module: Any) -> str | None:
    """The backend's own reason, or the error its check raised (a broken build is a reason)."""
    try:
        return module.unavailable()
    except Exception as exc:
        return f"backend {name!r} failed its availability check: {type(exc).__name__}: {exc}"


def reasons(name: str, op: str, *inputs: Any) -> list[str]:
    """Every reason why backend ``name`` cannot run ``op`` on ``inputs`` (empty: it can)."""
    if name not in BACKEND_MODULES:
        return [f"unknown backend {name!r}; choose from {sorted(BACKEND_MODULES)} or 'auto'"]
    module, why = _module(name)
    if module is None:
        return [why]
    why = _unavailable(name, module)
    if why:
        return [why]
    impl = module.OPS.get(op)
    if impl is None:
        return [f"backend {name!r} does not implement {op!r}"]
    return list(impl.unsupported(*inputs))


def implementation(name: str, op: str) -> Any:
    module, _ = _module(name)
    return module.OPS[op]


def requested_backend(argument: str | None) -> str:
    """The backend the caller asked for: the argument unless it is 'auto', then the env var."""
    if argument not in (None, "auto"):
        return argument
    return os.environ.get(ENV_VAR, "auto") or "auto"


def choose(op: str, device: torch.device, *inputs: Any, backend: str | None = "auto") -> Any:
    """The implementation of ``op`` that runs ``inputs`` (see the module docstring)."""
    name = requested_backend(backend)
    if name != "auto":
        why = reasons(name, op, *inputs)
        if why:
            lines = "\n".join(f"  - {w}" for w in why)
            raise BackendUnavailableError(f"backend {name!r} cannot run {op!r} on these inputs:\n{lines}")
        return implementation(name, op)
    for candidate in AUTO_ORDER.get(device.type, ()):
        if not reasons(candidate, op, *inputs):
            return implementation(candidate, op)
    return implementation(FALLBACK, op)


def describe() -> dict[str, str]:
    """``{backend: "available" or the reason it is not}`` for ``python -m fastcl.info``."""
    out = {}
    for name in BACKEND_MODULES:
        module, why = _module(name)
        if module is not None:
            why = _unavailable(name, module)
        out[name] = "available" if not why else why
    return out
