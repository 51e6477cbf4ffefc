"""fastcl's tuning knobs: one typed, frozen configuration, read from the environment once.

Every knob is a field of a section below, with its environment variable as the default's
source (the list, with what each knob does: docs/configuration.md). The environment is read
at one defined time, the first :func:`get` (the first loss call that needs a knob), and
again only by :func:`reload`; :func:`override` sets knobs for a block of code (tests,
measurements) and restores them after. An invalid value raises ``ValueError`` naming the
variable or field, at that time, never later and never silently clamped.

    >>> import fastcl.config
    >>> fastcl.config.get().cpp.gemm
    'auto'
    >>> with fastcl.config.override(cpp={"gemm": "mkl"}):
    ...     fastcl.config.get().cpp.gemm
    'mkl'

What is not here: the build (``FASTCL_NO_BUILD``, ``FASTCL_CACHE_DIR``), the data folder
(``FASTCL_DATA_DIR``) and ``FASTCL_CHECK_FINITE``, read where they act; the algorithm of a
call (``strategy=``) is an argument of every loss, whose ``"auto"`` takes :attr:`Config.strategy`.

Adding a section (e.g. the Triton kernels' knobs): a frozen dataclass whose fields are
:func:`knob` s, and a field of :class:`Config` holding it; :func:`reload`, :func:`override`,
the validation and tests/test_config.py's check of docs/configuration.md then cover it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("auto", "fused", "recompute")
BACKENDS = ("auto", "reference", "torch", "cpp", "triton")  # fastcl.ops.dispatch.NAMES and "auto"
# decimal digits of the largest value an integer knob takes: it reaches C++ as an int64
_MAX_DIGITS = 18


class ConfigError(ValueError):
    """A knob's value is refused (by its kind, or by the library that would use it: the C++
    backend refuses ``cpp.gemm="own"`` without its AVX-512 build). Never turned into a
    backend being "unavailable": a setting the user asked for is honoured or refused."""


CPP_GEMMS = ("auto", "own", "mkl")
TRITON_DS = ("auto", "fp32", "input")


# --------------------------------------------------------------------------- kinds of knob


class PositiveInt:
    """An integer >= ``least`` (Python's, not a bool) and below 2^63 (the C++ library's int64);
    from the environment, decimal digits only."""

    def __init__(self, least: int = 1):
        self.least = least

    def check(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not self.least <= value < 10**_MAX_DIGITS:
            raise ConfigError(f"{name}={value!r}: expected an integer >= {self.least} (below 1e{_MAX_DIGITS})")
        return value

    def parse(self, name: str, raw: str) -> int:
        # "abc", "-3", "1e6", "4.5", "0x10", " 5", 20 digits: refused, never read as something else
        if not (raw.isascii() and raw.isdigit() and len(raw) <= _MAX_DIGITS) or int(raw) < self.least:
            raise ConfigError(
                f"{name}={raw!r}: expected an integer >= {self.least} (decimal digits, below 1e{_MAX_DIGITS})"
            )
        return int(raw)


class Choice:
    """One of ``choices``."""

    def __init__(self, choices: tuple[str, ...]):
        self.choices = choices

    def check(self, name: str, value: Any) -> str:
        if value not in self.choices:
            raise ConfigError(f"{name}={value!r}: expected one of {self.choices}")
        return value

    def parse(self, name: str, raw: str) -> str:
        return self.check(name, raw.strip())


class Text:
    """A non-empty string (a file path)."""

    def check(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{name}={value!r}: expected a non-empty string")
        return value

    def parse(self, name: str, raw: str) -> str:
        return self.check(name, raw.strip())


class OrNone:
    """``None`` (the automatic choice; an unset or empty variable) or a value of ``kind``."""

    def __init__(self, kind: PositiveInt | Choice | Text):
        self.kind = kind

    def check(self, name: str, value: Any) -> Any:
        return None if value is None else self.kind.check(name, value)

    def parse(self, name: str, raw: str) -> Any:
        return self.kind.parse(name, raw)


def knob(default: Any, env: str | None, kind: PositiveInt | Choice | Text | OrNone, doc: str) -> Any:
    """A configuration field: its default, the environment variable that overrides the
    default (``None``: set through :func:`override` only, a tuning detail with a measured
    default that needs no public name), its kind (checked on every construction) and one
    line on what it does."""
    return field(default=default, metadata={"env": env, "kind": kind, "doc": doc})


def _check_fields(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        if "kind" in f.metadata:
            f.metadata["kind"].check(f"{type(obj).__name__}.{f.name}", getattr(obj, f.name))


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class TorchOptions:
    """The chunked PyTorch backend (``fastcl/ops/_torch_impl.py``)."""

    tile: int = knob(
        1 << 22,
        None,
        PositiveInt(),
        "elements of one [rows, N] float32 logit tile (a block holds about three); 2^20..2^23 "
        "are within 5 % of each other at d = 768 on the 2-core CI machine",
    )

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class CppOptions:
    """The C++ CPU backend (``csrc/cpu``): handed to the library by ``fastcl::set_cpu_options``."""

    tile: int | None = knob(
        None,
        "FASTCL_CPP_TILE",
        OrNone(PositiveInt()),
        "element budget of a row block's [H, N] buffer (None: (B + N) * d, at least 2^21 per thread)",
    )
    gemm: str = knob(
        "auto",
        "FASTCL_CPP_GEMM",
        Choice(CPP_GEMMS),
        "step 1's GEMM: 'own' (fastcl's AVX-512 tile), 'mkl', or 'auto' (the tile from 512 anchors "
        "on AVX-512 CPUs other than Intel's)",
    )
    # Test hooks, not a public interface: tests and measurements cross the kernels' edges with them
    test_rows: int | None = knob(
        None,
        "_FASTCL_TEST_CPP_ROWS",
        OrNone(PositiveInt()),
        "test hook: force the row-block height H (None: automatic)",
    )
    test_chunk: int | None = knob(
        None,
        "_FASTCL_TEST_CPP_CHUNK",
        OrNone(PositiveInt()),
        "test hook: cap every GEMM call's candidates (None: no cap)",
    )
    test_keep_bytes: int | None = knob(
        None,
        "_FASTCL_TEST_CPP_KEEP_BYTES",
        OrNone(PositiveInt(0)),
        "test hook: largest block buffer kept between calls (None: 16 MiB; 0: none)",
    )

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class TritonOptions:
    """The Triton backend (``kernels/``, ``fastcl/ops/_triton.py``; docs/triton.md)."""

    ds: str = knob(
        "auto",
        "FASTCL_TRITON_DS",
        Choice(TRITON_DS),
        "the backward's dS of bf16 inputs: 'input' (rounded to bf16, one MMA per product), 'fp32' (two "
        "MMAs), 'auto' (= input); fp16 always keeps fp32 (its dS would be subnormal)",
    )
    ds_bytes: int = knob(
        40 << 20,
        None,
        PositiveInt(),
        "bytes of one recomputed dS chunk (at least 2048 columns): fewer chunks, fewer launches, more scratch",
    )
    table: str | None = knob(
        None,
        "FASTCL_TRITON_TABLE",
        OrNone(Text()),
        "a config-table file to read instead of kernels/tuned/<arch>.json (written by python -m benchmarks.triton_tools.tune)",
    )

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class Config:
    """Every knob of fastcl (see the module docstring)."""

    backend: str = knob(
        "auto",
        "FASTCL_BACKEND",
        Choice(BACKENDS),
        "what a loss's backend='auto' means: 'auto' (the fastest available for the device) or one backend",
    )
    strategy: str = knob(
        "auto",
        "FASTCL_STRATEGY",
        Choice(STRATEGIES),
        "what a loss's strategy='auto' means: 'auto' (fused gradient-in-forward where the backend "
        "has it, for mean/sum), or always 'fused' / 'recompute'",
    )
    ring_pieces: int = knob(
        2,
        "FASTCL_RING_PIECES",
        PositiveInt(),
        "cross_device='ring': into how many row ranges each rank's candidates are cut for the trip "
        "(memory in flight ~ 5 blocks / pieces, constant in the world size from 2 pieces on)",
    )
    torch: TorchOptions = field(default_factory=TorchOptions)
    cpp: CppOptions = field(default_factory=CppOptions)
    triton: TritonOptions = field(default_factory=TritonOptions)

    def __post_init__(self) -> None:
        _check_fields(self)


def sections() -> dict[str, type]:
    """``{field name: section class}`` of :class:`Config`."""
    return {
        f.name: f.default_factory  # type: ignore[misc]
        for f in dataclasses.fields(Config)
        if f.default_factory is not dataclasses.MISSING
    }


def knobs() -> list[tuple[str, str | None, str, Any]]:
    """``(field path, environment variable or None, doc, default)`` of every knob, for the docs' table."""
    out = []
    for f in dataclasses.fields(Config):
        section = sections().get(f.name)
        owner, items = (f"{f.name}.", dataclasses.fields(section)) if section else ("", (f,))
        for g in items:
            out.append((owner + g.name, g.metadata["env"], g.metadata["doc"], g.default))
    return out


# --------------------------------------------------------------------------- reading


def _from_env(cls: type, environ: Mapping[str, str]) -> Any:
    values = {}
    for f in dataclasses.fields(cls):
        if "kind" in f.metadata:
            env = f.metadata["env"]
            raw = environ.get(env, "") if env else ""
            if raw.strip():  # unset or empty: the default
                values[f.name] = f.metadata["kind"].parse(env, raw)
        else:  # a section
            values[f.name] = _from_env(sections()[f.name], environ)
    return cls(**values)


def from_environment(environ: Mapping[str, str] | None = None) -> Config:
    """A :class:`Config` from ``environ`` (default: ``os.environ``), every value checked."""
    return _from_env(Config, os.environ if environ is None else environ)


_lock = threading.RLock()
_current: Config | None = None
_listeners: list[Callable[[Config], None]] = []


def get() -> Config:
    """The configuration in force: read from the environment at import (or on the first call
    after a bad value there)."""
    global _current
    current = _current
    if current is None:
        with _lock:
            if _current is None:
                _set(from_environment())
            current = _current
    assert current is not None
    return current


def _set(cfg: Config) -> None:
    """Make ``cfg`` current and tell the listeners (the C++ library); a listener that refuses
    it (``own`` GEMM without AVX-512) leaves the previous configuration in force."""
    global _current
    before = _current
    _current = cfg
    try:
        for listener in list(_listeners):
            listener(cfg)
    except Exception:
        _current = before
        if before is not None:
            for listener in list(_listeners):
                listener(before)
        raise


def reload() -> Config:
    """Read the environment again (after changing ``os.environ``) and return the new configuration."""
    with _lock:
        _set(from_environment())
        assert _current is not None
        return _current


def replaced(cfg: Config, **changes: Any) -> Config:
    """``cfg`` with ``changes``: top-level knobs by value (``strategy="fused"``), sections by a
    mapping of their fields (``cpp={"gemm": "own"}``) or a whole section object."""
    updates: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(Config)}
    for name, value in changes.items():
        if name not in names:
            raise TypeError(f"fastcl.config has no knob or section {name!r}; it has {sorted(names)}")
        section = sections().get(name)
        if section is not None and isinstance(value, Mapping):
            value = dataclasses.replace(getattr(cfg, name), **value)
        elif section is not None and not isinstance(value, section):
            raise TypeError(f"{name} takes a mapping of its fields or a {section.__name__}, got {value!r}")
        updates[name] = value
    return dataclasses.replace(cfg, **updates)


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Config]:
    """Set knobs inside a ``with`` block (see :func:`replaced` for ``changes``); the previous
    configuration comes back after it, also on an error. Not thread-local: meant for tests,
    scripts and measurements, not for two threads wanting different knobs."""
    with _lock:
        before = get()
        _set(replaced(before, **changes))
        cfg = _current
    try:
        assert cfg is not None
        yield cfg
    finally:
        with _lock:
            _set(before)


def on_change(listener: Callable[[Config], None]) -> None:
    """Call ``listener(config)`` now and whenever the configuration changes (how the C++
    library, which cannot read Python, receives its knobs)."""
    with _lock:
        listener(get())  # first: a listener that refuses the configuration is not kept
        _listeners.append(listener)


# Read the environment now, at import: a loss's first call may run inside a torch.compile
# trace, and dynamo cannot enter the lock get() takes on a first read (fullgraph=True fails).
# A bad FASTCL_* value is not raised here (an import must not fail on it) but by the first
# call that reads the configuration, since nothing is set.
try:
    get()
except ConfigError:
    pass

__all__ = [
    "ConfigError",
    "Config",
    "CppOptions",
    "TorchOptions",
    "STRATEGIES",
    "from_environment",
    "get",
    "knobs",
    "on_change",
    "override",
    "reload",
]
