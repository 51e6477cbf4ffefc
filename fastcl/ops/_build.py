"""Lazy, cached ninja builds of fastcl's C++ sources (``csrc/``, shipped as ``fastcl._csrc``).

A backend builds on its first ``unavailable()`` call, never at import; the outcome (the
loaded library or why it failed) is kept for the process. Cache directory, key and
``FASTCL_NO_BUILD``: docs/csrc.md, "Build".
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

NO_BUILD_ENV = "FASTCL_NO_BUILD"
CACHE_ENV = "FASTCL_CACHE_DIR"


def csrc_dir() -> Path:
    """Directory of the C++ sources (the ``fastcl._csrc`` package)."""
    import fastcl._csrc

    return Path(fastcl._csrc.__file__).resolve().parent


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastcl"


def cpu_capability_flags() -> tuple[str, list[str]]:
    """``(capability, flags)`` for the vectorised CPU kernels: ATen's ``at::vec`` picks its
    instruction set at compile time, so target the one torch uses here (AVX2 on AVX2 and
    AVX-512 CPUs, plain C++ elsewhere)."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # very old torch: stay portable
        cap = "DEFAULT"
    if cap == "AVX512":
        return "AVX512", [
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mfma",
            "-mf16c",
            "-DCPU_CAPABILITY=AVX512",
            "-DCPU_CAPABILITY_AVX512",
        ]
    if cap in ("AVX2",):
        return "AVX2", ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return "DEFAULT", ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"]


@dataclass
class Extension:
    """One lazily built library: its sources, flags and, once tried, the outcome."""

    name: str
    sources: list[str]  # relative to csrc_dir()
    cflags: list[str] = field(default_factory=list)
    ldflags: list[str] = field(default_factory=list)
    describe: str = "C++"
    key_extra: str = ""  # what else the binary depends on (e.g. target architectures)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _tried: bool = False
    _error: str | None = None
    library: str | None = None  # path of the loaded .so

    def key(self) -> str:
        h = hashlib.sha256()
        root = csrc_dir()
        headers = (str(p.relative_to(root)) for ext in ("*.h",) for p in root.rglob(ext))
        for src in sorted(self.sources) + sorted(headers):
            h.update(src.encode())
            h.update((root / src).read_bytes())
        for part in (self.cflags, self.ldflags):
            h.update(repr(part).encode())
        h.update(f"{sys.version_info[:2]} {torch.__version__} {torch.version.cuda} {self.key_extra}".encode())
        # ninja's build file names the sources by absolute path: two checkouts sharing one
        # build folder would rebuild each other's binary on every switch
        h.update(str(root.resolve()).encode())
        return h.hexdigest()[:16]

    def build_dir(self) -> Path:
        return cache_root() / "torch_extensions" / f"{self.name}-{self.key()}"

    def error(self) -> str | None:
        """Build (first call only) and load; the reason it failed, or None."""
        with self._lock:
            if not self._tried:
                self._tried = True
                self._error = self._build()
            return self._error

    def _build(self) -> str | None:
        if os.environ.get(NO_BUILD_ENV, "") not in ("", "0"):
            return f"building the {self.describe} backend is disabled ({NO_BUILD_ENV}={os.environ[NO_BUILD_ENV]})"
        from torch.utils import cpp_extension

        try:
            cpp_extension.verify_ninja_availability()
        except RuntimeError:
            return f"the {self.describe} backend is built with ninja, which is not installed (pip install ninja)"
        root = csrc_dir()
        build_dir = self.build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        cached = (build_dir / f"{self.name}.so").exists()
        if not cached:
            _say(f"compiling the {self.describe} backend (first use only, about a minute) in {build_dir}")
        start = time.perf_counter()
        try:
            cpp_extension.load(
                name=self.name,
                sources=[str(root / s) for s in self.sources],
                extra_cflags=self.cflags,
                extra_ldflags=self.ldflags,
                extra_include_paths=[str(root)],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:  # compiler missing, compile error, load error: keep the reason
            log = build_dir / "build-error.log"
            log.write_text(f"{type(exc).__name__}: {exc}\n")
            first = _first_error_line(str(exc))
            why = f"the {self.describe} backend failed to build: {first} (full log: {log})"
            _say(f"{why}; `python -m fastcl.info` lists the backends in use")
            return why
        self.library = str(build_dir / f"{self.name}.so")
        if not cached:
            _say(f"{self.describe} backend built in {time.perf_counter() - start:.0f} s")
        return None


def _say(message: str) -> None:
    print(f"fastcl: {message}", file=sys.stderr, flush=True)


def _first_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line.strip() for line in lines if "error" in line.lower() and not line.startswith("Error building")]
    return (errors or lines or ["unknown error"])[0][:300]
