"""Which backend runs a problem: the ``backend=`` argument > ``fastcl.config``'s ``backend``
(``FASTCL_BACKEND``) > automatic (the first of :data:`AUTO_ORDER` with no reason, else
``torch``); docs/design.md, "Dispatch".
"""

from __future__ import annotations

from .. import config
from .backend import Backend, extension_reasons
from .contract import LSEProblem

NAMES = ("reference", "torch", "cpp", "triton")

# Preference per device type when the caller says "auto".
AUTO_ORDER = {"cuda": ("triton", "torch"), "cpu": ("cpp", "torch")}

REMOVED = {"cuda": "the 'cuda' backend was removed; on NVIDIA GPUs use backend='triton' (or 'auto')"}


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run the given inputs (the message says why)."""


def get(name: str) -> Backend:
    """The backend called ``name``. Its module is imported on first use, by import statements
    rather than importlib because torch.compile traces the former: importing fastcl imports
    neither triton nor the C++ backend."""
    if name == "reference":
        from ..reference import BACKEND as reference

        return reference
    if name == "torch":
        from ._torch_impl import BACKEND as chunked_torch

        return chunked_torch
    if name == "cpp":
        from ._cpp import BACKEND as cpp

        return cpp
    if name == "triton":
        from ._triton import BACKEND as triton

        return triton
    raise KeyError(name)


def _constant_under_compile(fn):
    """``torch.compiler.assume_constant_result(fn)`` (torch.compile calls ``fn`` eagerly and
    takes its answer as a constant) without importing torch._dynamo, and with it triton;
    tests/ops/test_compile.py fails if torch ever changes the mark."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile
def unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run in this process (None: it can); a check that raises is a
    reason. It may build a C++ library; under torch.compile it runs once, eagerly."""
    if name not in NAMES:
        return REMOVED.get(name, f"unknown backend {name!r}; choose from {sorted(NAMES)} or 'auto'")
    try:
        return get(name).unavailable()
    except config.ConfigError:  # a setting the user asked for: refused, never a silent fallback
        raise
    except Exception as exc:
        return f"backend {name!r} failed its availability check: {type(exc).__name__}: {exc}"


def reasons(name: str, problem: LSEProblem | None = None) -> list[str]:
    """Every reason why backend ``name`` cannot run ``problem`` (empty: it can)."""
    why = unavailable(name)
    if why:
        return [why]
    if problem is None:
        return []
    impl = get(name)
    return list(impl.unsupported(problem)) + extension_reasons(impl, problem)


def choose(problem: LSEProblem, backend: str = "auto") -> Backend:
    """The backend that runs ``problem`` (see the module docstring)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string ('auto' or one of {list(NAMES)}), got {backend!r}")
    name = backend if backend != "auto" else config.get().backend
    if name != "auto":
        why = reasons(name, problem)
        if why:
            lines = "\n".join(f"  - {w}" for w in why)
            raise BackendUnavailableError(f"backend {name!r} cannot run these inputs:\n{lines}")
        return get(name)
    for candidate in AUTO_ORDER.get(problem.device.type, ()):
        if not reasons(candidate, problem):
            return get(candidate)
    return get("torch")  # takes everything


def describe() -> dict[str, str]:
    """``{backend: "available" or the reason it is not}`` for ``python -m fastcl.info``."""
    return {name: unavailable(name) or "available" for name in NAMES}
