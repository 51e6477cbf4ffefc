"""Shared pieces of fastcl's Triton kernels: jit helpers, dtype rules, tuned launches.

Jit helpers: :func:`mma` (``tl.dot`` with the interpreter's bf16 bug worked around),
:func:`raw_dot_tile` (one ``[BM, BN]`` tile of dot products over any ``d``), the
structural mask of ``fastcl/ops/contract.py`` and the masked online log-sum-exp.

Launches: a :class:`Kernel` is a jit function with one config table per ``(arch, dtype
class)``; :func:`launch` takes every argument by keyword, picks the autotuner of the
launch's size bucket and records the launch when a :func:`recording` is active. The AOT
compile list (``fastcl.kernels.aot``) is exactly the set of recorded launches, so it
cannot drift from what the launchers pass.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastcl.ops.contract import TAG_ALL, TAG_PADDING, compute_dtype, new_output

# Triton chooses interpreted or compiled kernels when a kernel module is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
IS_INTERPRETER = tl.constexpr(INTERPRET)

# The contract's tags as jit-time constants: the kernels apply contract.excluded's rule.
PAD_TAG = tl.constexpr(TAG_PADDING)
ALL_TAG = tl.constexpr(TAG_ALL)

# ---------------------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------------------

# Bounds of the power-of-two row scale of the scaled sums of squares (norm kernels, own
# logits): 1/scale stays a normal number, so multiplying by it is exact.
SCALE_LO_F64: tl.constexpr = tl.constexpr(2.0**-500)
SCALE_HI_F64: tl.constexpr = tl.constexpr(2.0**500)
SCALE_LO_F32: tl.constexpr = tl.constexpr(2.0**-100)
SCALE_HI_F32: tl.constexpr = tl.constexpr(2.0**100)


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
def raw_dot_tile(
    X,
    Y,
    SX,
    SY,
    rows,
    cols,
    row_ok,
    col_ok,
    d,
    stride_x,
    stride_y,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALE_ON_LOAD: tl.constexpr,
):
    """``[BM, BN]`` tile of ``<x_r, y_c>`` over the full feature dimension, in ``ACC``.

    Rows of ``X``/``Y`` outside ``row_ok``/``col_ok`` are never read (they count as zero:
    a padded candidate's NaN cannot reach the tile). Row offsets are 64-bit: a block
    with ``N * d >= 2**31`` elements is addressed correctly. ``SCALE_ON_LOAD`` (fp32 and
    fp64 cosine) multiplies the rows by their inverse norms ``SX``/``SY`` as they are
    loaded, so the product of two huge (or tiny) rows never leaves the float range.
    """
    acc = tl.zeros([BM, BN], dtype=ACC)
    x_rows = X + rows.to(tl.int64)[:, None] * stride_x
    y_rows = Y + cols.to(tl.int64)[:, None] * stride_y
    if SCALE_ON_LOAD:
        sx = tl.load(SX + rows, mask=row_ok, other=0.0)
        sy = tl.load(SY + cols, mask=col_ok, other=0.0)
    for k0 in range(0, d, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < d
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        y = tl.load(y_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALE_ON_LOAD:
            x = x * sx[:, None]
            y = y * sy[:, None]
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
    (``ALL_TAG`` and other rows' tags keep it); ``tests/kernels/test_triton_interpret.py`` checks
    this against ``contract.excluded`` on random tags.
    """
    keep = (tags[None, :] != PAD_TAG) & (tags[None, :] != rows[:, None]) & col_ok[None, :]
    return keep & (rows < n_rows)[:, None]


@triton.jit
def online_lse(m, l, u, logits, keep):
    """One step of the masked online LSE: running max ``m``, ``l = sum exp(x - m)`` and
    ``u = sum exp(x - m) * x`` (for the mean logit), all ``[BM]``; empty rows stay at
    ``m = -inf, l = u = 0`` without producing NaN. A NaN logit makes ``l`` NaN (never
    dropped: ``tl.max`` may skip NaN, ``exp(NaN - m)`` does not)."""
    x = tl.where(keep, logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_ref)
    p = tl.exp(x - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    u = u * alpha + tl.sum(p * tl.where(keep, logits, 0.0), 1)
    return m_new, l, u


# ---------------------------------------------------------------------------------------
# dtype rules
# ---------------------------------------------------------------------------------------

TRITON_TYPE = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",  # bool masks, passed as bytes
}


def dtype_class(dtype: torch.dtype) -> str:
    """Which config table a dtype uses: ``"16"``, ``"32"`` or ``"64"``."""
    return {torch.float16: "16", torch.bfloat16: "16", torch.float32: "32", torch.float64: "64"}[dtype]


acc_dtype = compute_dtype  # accumulation/statistics dtype: the contract's one rule


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 inputs use 3xTF32 (about fp32 accuracy on tensor
    cores; plain TF32 would miss the fp32 tolerance), fp64 IEEE; ignored for 16-bit."""
    return "tf32x3" if dtype == torch.float32 else "ieee"


# ---------------------------------------------------------------------------------------
# kernels with config tables, launches by keyword, recording
# ---------------------------------------------------------------------------------------

ARCHS = ("sm80", "sm90")


def cfg(num_warps: int = 4, num_stages: int = 2, **meta: int) -> triton.Config:
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


def bucket(n: int) -> int:
    """Autotune bucket of a size: its next power of two (at least 16); each bucket tunes once."""
    return max(16, triton.next_power_of_2(max(int(n), 1)))


class Kernel:
    """A jit kernel with a config table per ``(arch, dtype class)`` and lazy autotuners.

    ``tables[arch][dclass]`` lists configs (a missing class falls back to ``"16"``);
    ``"interp"`` has exactly one, passed as keyword arguments (``@triton.autotune`` cannot
    run without a GPU). ``dtype_arg`` names the argument whose dtype picks the table. On a
    GPU one autotuner per size bucket is built on first use (nothing queries a device at import).
    """

    registry: dict[str, Kernel] = {}

    def __init__(
        self,
        fn,
        tables: dict[str, dict[str, list[triton.Config]]],
        dtype_arg: str,
        restore_value: list[str] | None = None,
    ):
        self.fn, self.name, self.tables = fn, fn.__name__, tables
        self.dtype_arg, self.restore_value = dtype_arg, restore_value
        # the interpreter's function has no .params: read the annotations of the source function
        params = inspect.signature(fn.fn).parameters.values()
        self.constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
        self._tuners: dict[tuple, object] = {}
        self._lock = threading.Lock()
        Kernel.registry[self.name] = self

    def configs(self, arch: str, dclass: str) -> list[triton.Config]:
        table = self.tables[arch]
        return table.get(dclass, table["16"])

    def block_sizes(self, arch: str, dclass: str, name: str) -> list[int]:
        """Every value block size ``name`` takes in a table (launchers size buffers with it)."""
        return [c.kwargs[name] for c in self.configs(arch, dclass)]

    def runner(self, arch: str, dclass: str, tune: tuple):
        """``(launchable, extra keyword arguments)`` for this arch, dtype class and tuning key."""
        if arch == "interp":
            (config,) = self.configs(arch, dclass)
            return self.fn, dict(config.kwargs)
        key = (arch, dclass, tune)
        with self._lock:
            if key not in self._tuners:
                # key=[]: the bucket is in the dictionary key, not in the kernel's arguments
                self._tuners[key] = triton.autotune(
                    configs=self.configs(arch, dclass), key=[], restore_value=self.restore_value
                )(self.fn)
            return self._tuners[key], {}


def triton_type(value) -> str:
    """The Triton type a launch argument gets (pointers by dtype; ints by range)."""
    if isinstance(value, torch.Tensor):
        return "*" + TRITON_TYPE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


@dataclass(frozen=True)
class Launch:
    """What one launch passed: argument types and the launcher's constexprs (no block sizes)."""

    kernel: str
    dclass: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]

    @property
    def key(self) -> str:
        sig = ",".join(f"{k}:{v}" for k, v in self.signature)
        flags = ",".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.kernel}[{self.dclass}]({sig})<{flags}>"

    def describe(self) -> str:
        ptrs = sorted({v[1:] for _, v in self.signature if v.startswith("*")})
        flags = " ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.kernel} {'/'.join(ptrs)} {flags}".strip()


class _State(threading.local):
    records: list | None = None  # launches are appended here while recording
    dry: bool = False  # record (or just run the launcher) without launching
    arch: str | None = None  # planning arch for dry runs on CPU tensors


_STATE = _State()


@contextlib.contextmanager
def recording(dry: bool = False, arch: str | None = None):
    """Collect every :class:`Launch` made inside; ``dry``: launch nothing (tensors may live on
    any device); ``arch``: plan for this arch instead of the tensors' device."""
    saved = _STATE.records, _STATE.dry, _STATE.arch
    _STATE.records, _STATE.dry, _STATE.arch = [], dry, arch
    try:
        yield _STATE.records
    finally:
        _STATE.records, _STATE.dry, _STATE.arch = saved


def arch_of(device: torch.device) -> str:
    """Config table for a device: ``interp`` under the interpreter, else by compute capability."""
    if _STATE.arch is not None:
        return _STATE.arch
    if INTERPRET:
        return "interp"
    major, _ = torch.cuda.get_device_capability(device)
    return "sm90" if major >= 9 else "sm80"


def launch(kernel: Kernel, grid, arch: str, tune: tuple[int, ...] = (), **args) -> None:
    """Launch ``kernel`` with every non-block-size argument by keyword.

    ``tune``: the real sizes the autotuner is keyed on (bucketed here). Checks that the
    arguments are exactly the kernel's (minus the config's block sizes), records the
    launch, then launches through ``wrap_triton`` so ``torch.compile`` can trace the
    kernel inside a ``triton_op``.
    """
    dclass = dtype_class(args[kernel.dtype_arg].dtype)
    configured = set(kernel.configs(arch, dclass)[0].kwargs)
    expected = set(kernel.fn.arg_names) - configured
    if set(args) != expected:
        raise TypeError(
            f"{kernel.name}: missing {sorted(expected - set(args))}, unexpected {sorted(set(args) - expected)}"
        )
    names = [n for n in kernel.fn.arg_names if n in args]
    flags = tuple((n, args[n]) for n in names if n in kernel.constexprs)
    if _STATE.records is not None:
        sig = tuple((n, triton_type(args[n])) for n in names if n not in kernel.constexprs)
        _STATE.records.append(Launch(kernel.name, dclass, sig, flags))
    if _STATE.dry:
        return
    # one tuning per size bucket and specialisation (flags change the code being timed)
    fn, extra = kernel.runner(arch, dclass, (tuple(bucket(n) for n in tune), flags))
    from torch.library import wrap_triton

    wrap_triton(fn)[grid](**args, **extra)


def register_op(name: str, fn):
    """Register launcher ``fn`` as the custom op ``name``.

    Compiled Triton: ``torch.library.triton_op``, so ``torch.compile`` traces through to the
    kernels (``wrap_triton`` in :func:`launch`). Under the interpreter ``wrap_triton`` cannot
    trace (it hands back the interpreted function, which needs real data), so the op is an
    opaque ``custom_op`` whose fake implementation runs ``fn`` dry: same output shapes and
    dtypes, no kernel.
    """
    if not INTERPRET:
        return torch.library.triton_op(name, mutates_args=())(fn)
    op = torch.library.custom_op(name, fn, mutates_args=())

    def fake(*args, **kwargs):
        saved, _STATE.dry = _STATE.dry, True
        try:
            return fn(*args, **kwargs)
        finally:
            _STATE.dry = saved

    op.register_fake(fake)
    return op


def dummy(device: torch.device) -> torch.Tensor:
    """A one-element float32 tensor for pointer arguments a specialisation never reads.

    Uninitialised (NaN under the tests' ``poison_outputs``, so a read would show): zeros
    cost a fill kernel each, most of the 28 fill launches per step the H100 profile counted."""
    return new_output((1,), dtype=torch.float32, device=device)
