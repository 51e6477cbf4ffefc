"""Shared pieces of fastcl's Triton kernels: jit helpers, tuning tables, launch specs.

Jit helpers
    :func:`mma` (``tl.dot`` with the interpreter's bf16 bug worked around), :func:`raw_dot_tile`
    (one ``[BM, BN]`` tile of raw dot products, looping over the feature dimension in chunks
    of ``BK`` so any ``d`` works), :func:`scaled_logits` and :func:`online_lse` (masked
    online log-sum-exp that also tracks the softmax-weighted mean logit).

Tuning
    Every kernel has a table of :class:`Cfg` per ``(arch, dtype class)``: ``arch`` is
    ``"sm80"`` (A100 and other sm_8x), ``"sm90"`` (H100, and newer parts) or ``"interp"``
    (the Triton interpreter: exactly one config, because ``@triton.autotune`` with several
    configs cannot run without a GPU); the dtype class is ``"16"`` (bf16/fp16), ``"32"`` or
    ``"64"``. :class:`Tuned` builds one ``triton.autotune`` wrapper per table lazily, when a
    launcher first needs it, so nothing queries a device at import.

Specs
    A :class:`Spec` is one specialisation a launcher can produce: kernel, argument types and
    constexpr flags. Launchers build specs with the same functions that
    ``fastcl.kernels.aot`` enumerates, so the ahead-of-time compile test covers exactly what
    can run; with ``FASTCL_TRITON_RECORD=path`` every launched spec is also appended to that
    file, and a test checks each one is in the AOT list.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from fastcl.ops.contract import TAG_ALL, TAG_PADDING, compute_dtype

# Triton chooses interpreted or compiled kernels when a kernel module is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
IS_INTERPRETER = tl.constexpr(INTERPRET)

RECORD_ENV = "FASTCL_TRITON_RECORD"

# The contract's tags (fastcl/ops/contract.py) as jit-time constants: the kernels apply the
# rule of ``contract.excluded`` with these values, never their own literals.
PAD_TAG = tl.constexpr(TAG_PADDING)
ALL_TAG = tl.constexpr(TAG_ALL)

# ---------------------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` on tensor cores, accumulating in ``acc``'s dtype (fp32 or fp64)."""
    if IS_INTERPRETER:
        # The interpreter multiplies bf16 tiles as their raw uint16 bits; bf16 -> fp32 is
        # exact, so converting first gives the product the GPU computes.
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
        if b.dtype == tl.bfloat16:
            b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc.dtype)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` rounding to nearest even, as the GPU does.

    The interpreter truncates float32 -> bfloat16 (round toward zero), which would bias
    every bf16 result the tests check; round the bits explicitly there instead.
    """
    if IS_INTERPRETER and DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def sqrt_rn(x):
    """Correctly rounded square root (``tl.sqrt_rn`` is fp32 only; fp64 ``sqrt`` already is)."""
    if x.dtype == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def raw_dot_tile(X, Y, rows, cols, n_rows, n_cols, d, stride_x, stride_y,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 ACC: tl.constexpr, PRECISION: tl.constexpr):
    """``[BM, BN]`` tile of ``<x_r, y_c>`` over the full feature dimension, in ``ACC``.

    Rows ``rows`` of ``X`` and ``cols`` of ``Y`` (both row-major with feature stride 1);
    out-of-range rows, columns and features load as zero. The feature loop runs in chunks
    of ``BK``, so ``d`` is unbounded.
    """
    acc = tl.zeros([BM, BN], dtype=ACC)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    for k0 in range(0, d, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < d
        x = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        y = tl.load(Y + cols[:, None] * stride_y + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = mma(x, tl.trans(y), acc, PRECISION)
    return acc


@triton.jit
def load_tags(TAGS, cols, col_ok):
    """Tags of a tile's columns; columns past the end read as padding."""
    return tl.load(TAGS + cols, mask=col_ok, other=PAD_TAG)


@triton.jit
def structural_mask(rows, n_rows, tags, col_ok):
    """``~contract.excluded`` on a ``[BM, BN]`` tile, restricted to in-range rows and columns.

    A column is left out of row ``r`` when its tag is ``PAD_TAG`` or equals ``r``
    (``ALL_TAG`` and other rows' tags keep it); ``tests/test_triton_interpret.py`` checks this
    against ``contract.excluded`` on random tags.
    """
    keep = (tags[None, :] != PAD_TAG) & (tags[None, :] != rows[:, None]) & col_ok[None, :]
    return keep & (rows < n_rows)[:, None]


@triton.jit
def online_lse(m, l, u, logits, keep):
    """One step of the masked online LSE: running max ``m``, ``l = sum exp(x - m)`` and
    ``u = sum exp(x - m) * x`` (for the mean logit), all ``[BM]``; empty rows stay at
    ``m = -inf, l = u = 0`` without producing NaN."""
    x = tl.where(keep, logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_ref)
    p = tl.exp(x - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    u = u * alpha + tl.sum(p * tl.where(keep, logits, 0.0), 1)
    return m_new, l, u


# ---------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------

TRITON_TYPE = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "i32",
}


def dtype_class(dtype: torch.dtype) -> str:
    """Which tuning table a dtype uses: ``"16"``, ``"32"`` or ``"64"``."""
    return {torch.float16: "16", torch.bfloat16: "16", torch.float32: "32", torch.float64: "64"}[dtype]


acc_dtype = compute_dtype  # accumulation/statistics dtype: the contract's one rule


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 inputs use 3xTF32 (about fp32 accuracy on tensor
    cores; plain TF32 would miss the fp32 tolerance), fp64 IEEE; ignored for 16-bit."""
    return "tf32x3" if dtype == torch.float32 else "ieee"


# ---------------------------------------------------------------------------------------
# tuning tables
# ---------------------------------------------------------------------------------------

ARCHS = ("sm80", "sm90")


@dataclass(frozen=True)
class Cfg:
    """One autotune config: constexpr block sizes plus warps and pipeline stages."""

    meta: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 2

    @staticmethod
    def of(num_warps: int = 4, num_stages: int = 2, **meta: int) -> "Cfg":
        return Cfg(tuple(sorted(meta.items())), num_warps, num_stages)

    @property
    def kwargs(self) -> dict[str, int]:
        return dict(self.meta)

    def triton(self) -> triton.Config:
        return triton.Config(self.kwargs, num_warps=self.num_warps, num_stages=self.num_stages)

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.meta) + f" w{self.num_warps} s{self.num_stages}"


def arch_of(device: torch.device) -> str:
    """Tuning table for a device: ``interp`` under the interpreter, else by compute capability."""
    if INTERPRET:
        return "interp"
    major, _ = torch.cuda.get_device_capability(device)
    return "sm90" if major >= 9 else "sm80"


class Tuned:
    """A jit kernel with per-``(arch, dtype class)`` config tables and lazy autotuners.

    ``tables[arch][dclass]`` is a list of :class:`Cfg`; a dtype class missing from an arch
    falls back to ``"16"``. Under the interpreter the single ``"interp"`` config is passed
    as plain keyword arguments (no autotuner at all).
    """

    def __init__(self, fn, tables: dict[str, dict[str, list[Cfg]]], key: list[str], restore_value=None):
        self.fn = fn
        self.name = fn.__name__
        self.tables = tables
        self.key = key
        self.restore_value = restore_value
        self._tuners: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()

    def configs(self, arch: str, dclass: str) -> list[Cfg]:
        table = self.tables[arch]
        return table.get(dclass, table["16"])

    def block_sizes(self, arch: str, dclass: str, name: str) -> list[int]:
        """Every value block size ``name`` takes in a table (launchers size buffers with it)."""
        return [c.kwargs[name] for c in self.configs(arch, dclass)]

    def kernel(self, arch: str, dclass: str):
        """``(launchable, extra_kwargs)`` for this arch and dtype class."""
        if arch == "interp":
            (cfg,) = self.configs(arch, dclass)
            return self.fn, dict(cfg.kwargs)
        with self._lock:
            tuner = self._tuners.get((arch, dclass))
            if tuner is None:
                configs = [c.triton() for c in self.configs(arch, dclass)]
                tuner = triton.autotune(configs=configs, key=self.key, restore_value=self.restore_value)(self.fn)
                self._tuners[(arch, dclass)] = tuner
        return tuner, {}


# ---------------------------------------------------------------------------------------
# specialisations
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One specialisation of a kernel: argument types and constexpr flags.

    ``signature`` maps every non-constexpr argument to a Triton type (``*bf16``, ``i32``,
    ``fp32``); ``flags`` are the constexprs the launcher sets (block sizes come from the
    tuning table); ``dclass`` picks the table.
    """

    kernel: Tuned = field(compare=False, hash=False)
    kernel_name: str
    dclass: str
    signature: tuple[tuple[str, str], ...]
    flags: tuple[tuple[str, object], ...]

    @staticmethod
    def make(kernel: Tuned, dclass: str, signature: dict[str, str], flags: dict[str, object]) -> "Spec":
        return Spec(kernel, kernel.name, dclass, tuple(signature.items()), tuple(sorted(flags.items())))

    @property
    def key(self) -> str:
        sig = ",".join(f"{k}:{v}" for k, v in self.signature)
        flags = ",".join(f"{k}={v}" for k, v in self.flags)
        return f"{self.kernel_name}[{self.dclass}]({sig})<{flags}>"

    def describe(self) -> str:
        ptrs = sorted({v[1:] for _, v in self.signature if v.startswith("*")})
        flags = " ".join(f"{k}={v}" for k, v in self.flags)
        return f"{self.kernel_name} {'/'.join(ptrs)} {flags}".strip()


def _triton_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TRITON_TYPE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


def _record(spec: Spec) -> None:
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(spec.key) + "\n")


def launch(spec: Spec, arch: str, grid, *args) -> None:
    """Launch ``spec`` with positional ``args`` (every non-constexpr argument, in order).

    Checks the arguments against the spec's signature (the AOT list is only as good as
    this check), records the spec when asked, then launches through ``wrap_triton`` so
    ``torch.compile`` can trace the kernel inside a ``triton_op``.
    """
    names = [name for name, _ in spec.signature]
    if len(args) != len(names):
        raise TypeError(f"{spec.kernel_name}: {len(args)} arguments for {len(names)} parameters")
    for (name, want), value in zip(spec.signature, args):
        got = _triton_type(value)
        if got != want and not (want == "i32" and got == "i32"):
            raise TypeError(f"{spec.kernel_name}: argument {name} is {got}, spec says {want}")
    _record(spec)
    if _NO_LAUNCH.active:
        return
    fn, extra = spec.kernel.kernel(arch, spec.dclass)
    from torch.library import wrap_triton

    wrap_triton(fn)[grid](*args, **dict(spec.flags), **extra)


class _NoLaunch(threading.local):
    active = False


_NO_LAUNCH = _NoLaunch()


def register_op(name: str, fn):
    """Register launcher ``fn`` as the custom op ``name``.

    Compiled Triton: ``torch.library.triton_op``, so ``torch.compile`` traces through to the
    kernels (``wrap_triton`` in :func:`launch`). Under the interpreter ``wrap_triton`` cannot
    trace (it hands back the interpreted function, which needs real data), so the op is an
    opaque ``custom_op`` whose fake implementation runs ``fn`` without launching: same
    output shapes and dtypes, no kernel.
    """
    if not INTERPRET:
        return torch.library.triton_op(name, mutates_args=())(fn)
    op = torch.library.custom_op(name, fn, mutates_args=())

    def fake(*args, **kwargs):
        _NO_LAUNCH.active = True
        try:
            return fn(*args, **kwargs)
        finally:
            _NO_LAUNCH.active = False

    op.register_fake(fake)
    return op


def dummy(device: torch.device) -> torch.Tensor:
    """A one-element float32 tensor for pointer arguments a specialisation never reads."""
    return torch.zeros(1, dtype=torch.float32, device=device)
