"""Shared pieces of fastcl's Triton kernels: jit helpers, dtype rules, launches.

Jit helpers (used by the plain and the Matryoshka kernels alike):

* :func:`mma` / :func:`cast_to`: ``tl.dot`` and float casts with the interpreter's bf16 quirks
  worked around;
* :func:`block_of_tile`: which candidate block a column tile belongs to (both blocks are
  served by one launch: block 0's tiles first, then block 1's);
* :func:`dot_tile`: the GEMM main loop of one ``[BM, BN]`` tile over a range of ``d``, and
  :func:`prefix_segment`, one Matryoshka segment of it;
* :func:`scale_logits`, :func:`structural_mask`, :func:`online_lse`: the logit epilogue of
  the forward and backward sweeps.

Launches: every kernel launch goes through :func:`launch`, which takes every argument by
keyword (the launchers produce them from one argument record per launch family,
:class:`KernelArgs`) and one :class:`~fastcl.kernels.configs.Config` from the config table
(never an autotuner: a training step never benchmarks), checks the arguments once per kernel, records
the launch while a :func:`recording` is active and launches through ``wrap_triton`` so that
``torch.compile`` can trace into the kernel. The AOT compile list
(``benchmarks.triton_tools.aot``) is exactly the set of recorded launches.
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

from fastcl.ops import contract
from fastcl.ops.contract import compute_dtype

# Triton chooses interpreted or compiled kernels when a kernel module is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
IS_INTERPRETER = tl.constexpr(INTERPRET)

# The contract's tags as jit-time constants: the kernels apply contract.excluded's rule.
TAG_PADDING = tl.constexpr(contract.TAG_PADDING)
TAG_ALL = tl.constexpr(contract.TAG_ALL)

# Bounds of the power-of-two row scale of the scaled sums of squares (norm and head
# kernels): 1/scale stays a normal number, so multiplying by it is exact.
SCALE_LO_F64: tl.constexpr = tl.constexpr(2.0**-500)
SCALE_HI_F64: tl.constexpr = tl.constexpr(2.0**500)
SCALE_LO_F32: tl.constexpr = tl.constexpr(2.0**-100)
SCALE_HI_F32: tl.constexpr = tl.constexpr(2.0**100)

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
def block_of_tile(t, tiles0, n0, n1, off1):
    """Column tile ``t`` of the two-block candidate range: ``(in_block0, local tile, rows in
    its block, offset of its block in the norms/tags layout)``. Block 0 owns tiles
    ``[0, tiles0)``, block 1 the rest; a tile never straddles the two."""
    in0 = t < tiles0
    local = tl.where(in0, t, t - tiles0)
    n = tl.where(in0, n0, n1)
    base = tl.where(in0, 0, off1)
    return in0, local, n, base


@triton.jit
def dot_tile(
    acc,
    x_rows,
    y_rows,
    k_lo,
    k_hi,
    sx,
    sy,
    PRECISION: tl.constexpr,
    SCALE_ON_LOAD: tl.constexpr,
    EVEN_K: tl.constexpr,
    BK: tl.constexpr,
):
    """``acc + <x_r[k_lo:k_hi], y_c[k_lo:k_hi]>`` for a ``[BM, BN]`` tile: the GEMM main loop.

    ``x_rows [BM, 1]`` / ``y_rows [BN, 1]`` are row pointers; rows beyond a block's end are
    clamped by the caller to a valid row (read, then masked in the epilogue), so the loads
    need a mask only on ``k`` and only when ``EVEN_K`` is off (``k_hi - k_lo`` not a multiple
    of ``BK``). ``SCALE_ON_LOAD`` (fp32/fp64 cosine) multiplies the rows by their row scales
    ``sx``/``sy`` as they are loaded, so a product of two huge rows never leaves the float range.
    """
    # running pointers advanced by BK (the Triton matmul tutorial's form: one live pointer
    # tile per operand, not one per pipeline stage)
    ks = k_lo + tl.arange(0, BK)
    x_ptrs = x_rows + ks[None, :]
    y_ptrs = y_rows + ks[None, :]
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            x = tl.load(x_ptrs)
            y = tl.load(y_ptrs)
        else:
            k_ok = (k0 + tl.arange(0, BK) < k_hi)[None, :]
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            y = tl.load(y_ptrs, mask=k_ok, other=0.0)
        x_ptrs += BK
        y_ptrs += BK
        if SCALE_ON_LOAD:
            x = x * sx[:, None]
            y = y * sy[:, None]
        acc = mma(x, tl.trans(y), acc, PRECISION)
    return acc


@triton.jit
def prefix_segment(
    acc,
    lo,
    k,
    BOUNDS,
    NORMS,
    R,
    x_rows,
    y_rows,
    x_off,
    y_base,
    y_off,
    x_ok,
    y_ok,
    PRECISION: tl.constexpr,
    BK: tl.constexpr,
):
    """Segment ``k``, ``[lo, BOUNDS[k])``, of a Matryoshka sweep's loop over ``d`` (``lse_fwd.py``,
    ``lse_bwd.py``): ``acc`` runs on unscaled (one load scale cannot serve every prefix), so it
    ends as prefix ``k``'s raw dot tile; returns it, the next segment's start and prefix ``k``'s
    row and column scales from ``NORMS [2, K, R]`` (at ``x_off``, ``y_base + y_off``)."""
    hi = tl.load(BOUNDS + k)
    acc = dot_tile(acc, x_rows, y_rows, lo, hi, 0.0, 0.0, PRECISION, False, False, BK)
    # the scales' addresses formed here, after the main loop, as the kernels did inline: formed
    # by the caller they lived through it (the ds kernel took up to 25 more registers and
    # spilled 12-24 B on sm_90)
    sx = tl.load(NORMS + k * R + x_off, mask=x_ok, other=0.0)
    sy = tl.load(NORMS + k * R + y_base + y_off, mask=y_ok, other=0.0)
    return acc, hi, sx, sy


@triton.jit
def scale_logits(s, ia, ic, inv_tau, SCALE_TILE: tl.constexpr):
    """Raw dot tile -> logits: times the row scales (``SCALE_TILE``: 16-bit rows, not scaled
    on load) and ``1 / tau``."""
    if SCALE_TILE:
        return s * (ia * inv_tau)[:, None] * ic[None, :]
    else:
        return s * inv_tau


@triton.jit
def load_tags(TAGS, cols, col_ok):
    """Tags of a tile's columns; columns past the end read as padding."""
    return tl.load(TAGS + cols, mask=col_ok, other=TAG_PADDING)


@triton.jit
def structural_mask(rows, n_rows, tags, col_ok):
    """``~contract.excluded`` on a ``[BM, BN]`` tile, restricted to in-range rows and columns.

    A column is left out of row ``r`` when its tag is ``TAG_PADDING`` or equals ``r``
    (``TAG_ALL`` and other rows' tags keep it); ``tests/kernels/test_triton_interpret.py`` checks
    this against ``contract.excluded`` on random tags.
    """
    keep = (tags[None, :] != TAG_PADDING) & (tags[None, :] != rows[:, None]) & col_ok[None, :]
    return keep & (rows < n_rows)[:, None]


@triton.jit
def online_lse(m, l, u, logits, keep):
    """One step of the masked online LSE: running max ``m``, ``l = sum exp(x - m)`` and
    ``u = sum exp(x - m) * x`` (for the mean logit), all ``[BM]``; empty rows stay at
    ``m = -inf, l = u = 0`` without producing NaN. A NaN logit makes ``l`` NaN (never
    dropped: ``tl.max`` may skip NaN, ``exp(NaN - m)`` does not); a masked column's value,
    NaN included, is never read."""
    x = tl.where(keep, logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_ref)
    p = tl.exp(x - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    u = u * alpha + tl.sum(p * tl.where(keep, logits, 0.0), 1)
    return m_new, l, u


@triton.jit
def log1p(x):
    """``log(1 + x)`` accurate for small ``x`` (``x * log(u) / (u - 1)``, ``u = 1 + x``)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


# ---------------------------------------------------------------------------------------
# the primitive's extensions (contract.Filter, contract.Sigmoid) on a [BM, BN] tile
# ---------------------------------------------------------------------------------------

FILTER_KINDS = ("none", "self", "guide")  # the kernels' FILTER constexpr is the index
FILTER_NONE = tl.constexpr(0)
FILTER_SELF = tl.constexpr(1)  # the model's own similarity against the threshold
FILTER_GUIDE = tl.constexpr(2)  # a guide model's cosine, a second (narrow) dot tile


@triton.jit
def own_columns(rows, cols, first, P):
    """``[BM, BN]``: column ``cols[c]`` is one of row ``rows[r]``'s own positives, the columns
    ``first + r * P .. first + (r + 1) * P - 1`` (``contract.own_positive_columns``; ``P = 0``:
    none). What the sigmoid's ``z = +1`` and the filter's exemption read."""
    lo = first + rows.to(tl.int64) * P
    c = cols.to(tl.int64)[None, :]
    return (c >= lo[:, None]) & (c < (lo + P)[:, None])


@triton.jit
def similarity(s, ia, ic, SCALE_TILE: tl.constexpr):
    """Raw dot tile -> the model's similarity (cosine, or the dot product with row scales of 1):
    ``scale_logits`` without the temperature, for the filters."""
    if SCALE_TILE:
        return s * ia[:, None] * ic[None, :]
    else:
        return s


@triton.jit
def filter_logits(s, ia, ic, inv_tau, POISON, a_off, c_off, row_ok, col_ok, SCALE_TILE: tl.constexpr):
    """``(sim, logits)`` of a filtered problem's tile: the similarity with the rows' poison added
    (NaN for an input row that held a NaN or an Inf, read as zeros in the product: contract.Filter)."""
    pa = tl.load(POISON + a_off, mask=row_ok, other=0.0)
    pc = tl.load(POISON + c_off, mask=col_ok, other=0.0)
    sim = similarity(s, ia, ic, SCALE_TILE) + pa[:, None] + pc[None, :]
    return sim, sim * inv_tau


@triton.jit
def guide_similarity(GA, GC, GNORMS, rows, cols, n_rows, n_cols, a_off, c_off, row_ok, col_ok, g):
    """``[BM, BN]`` cosine of the guide embeddings (rows of ``GA [B, g]`` against rows of
    ``GC [n, g]``, row scales ``GNORMS``): the guide filter's second, narrow dot tile. fp32/fp64
    guides are scaled on load, 16-bit ones after the product (``dot_tile``'s rule)."""
    GT: tl.constexpr = GA.dtype.element_ty
    WIDE: tl.constexpr = (GT == tl.float32) or (GT == tl.float64)
    GACC: tl.constexpr = tl.float64 if GT == tl.float64 else tl.float32
    GPREC: tl.constexpr = "tf32x3" if GT == tl.float32 else "ieee"
    # narrow k steps: the guide's operand tiles live in registers beside the model's tile (fp32
    # guides split each into two halves for 3xTF32)
    GBK: tl.constexpr = 16 if WIDE else 32
    iga = tl.load(GNORMS + a_off, mask=row_ok, other=0.0)
    igc = tl.load(GNORMS + c_off, mask=col_ok, other=0.0)
    ga_rows = GA + tl.minimum(rows, n_rows - 1).to(tl.int64)[:, None] * g
    gc_rows = GC + tl.minimum(cols, n_cols - 1).to(tl.int64)[:, None] * g
    acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=GACC)
    gs = dot_tile(acc, ga_rows, gc_rows, 0, g, iga, igc, GPREC, WIDE, False, GBK)
    return similarity(gs, iga, igc, not WIDE)


@triton.jit
def filter_drop(fsim, THR, rows, row_ok, own):
    """The filter's drops on a tile: ``fsim > threshold[row]`` (strict; a NaN on either side drops
    nothing) unless an own positive (``contract.filtered``)."""
    thr = tl.load(THR + rows, mask=row_ok, other=float("nan"))
    return (fsim > thr[:, None]) & ~own


@triton.jit
def sigmoid_terms(logits, own, bias):
    """``(softplus(-z (l + b)), sigma = -z sigmoid(-z (l + b)))`` elementwise, ``z = +1`` on own
    positives and ``-1`` elsewhere (``contract.sigmoid_terms``), from one ``exp(-|u|)``, exact
    for every ``u``; NaN stays NaN."""
    x = logits + bias
    u = tl.where(own, -x, x)  # -z (l + b)
    e = tl.exp(-tl.abs(u))
    term = tl.maximum(u, 0.0) + log1p(e)
    r = 1.0 / (1.0 + e)
    sig = tl.where(u >= 0.0, r, e * r)
    return term, tl.where(own, -sig, sig)


@triton.jit
def ext_own(rows, cols, first, P, FILTER: tl.constexpr, SIGMOID: tl.constexpr):
    """The tile's own-positive columns where an extension reads them (``own_columns``), else a
    placeholder nothing reads (compiled away; Triton 3.6 cannot carry a None through a loop)."""
    if (FILTER != FILTER_NONE) or SIGMOID:
        return own_columns(rows, cols, first, P)
    else:
        return rows < 0


@triton.jit
def ext_guide(GA, GC, GNORMS, THR, rows, cols, n_rows, n_cols, a_off, c_off, row_ok, col_ok, own, g,
              FILTER: tl.constexpr):  # fmt: skip
    """The guide filter's drops on a tile (its similarity tile against the thresholds) when
    ``FILTER`` is the guide, formed before the model's tile, so that only a mask lives through
    the main loop; else ``own`` as a placeholder :func:`ext_logits` does not read (Triton 3.6
    cannot carry a None through a loop)."""
    if FILTER == FILTER_GUIDE:
        gsim = guide_similarity(GA, GC, GNORMS, rows, cols, n_rows, n_cols, a_off, c_off, row_ok, col_ok, g)
        return filter_drop(gsim, THR, rows, row_ok, own)
    else:
        return own


@triton.jit
def ext_logits(s, ia, ic, inv_tau, keep, own, gdrop, POISON, THR, a_off, c_off, rows, row_ok, col_ok,
               FILTER: tl.constexpr, SCALE_TILE: tl.constexpr):  # fmt: skip
    """``(logits, keep)`` of a tile from its raw dot products ``s``: the structural mask ``keep``
    less the filter's drops (self: the model's similarity with its poison; guide: ``gdrop``)."""
    if FILTER == FILTER_NONE:
        return scale_logits(s, ia, ic, inv_tau, SCALE_TILE), keep
    else:
        sim, logits = filter_logits(s, ia, ic, inv_tau, POISON, a_off, c_off, row_ok, col_ok, SCALE_TILE)
        if FILTER == FILTER_SELF:
            gdrop = filter_drop(sim, THR, rows, row_ok, own)
        return logits, keep & ~gdrop


@triton.jit
def reduce_tile(m, l, u, logits, keep, own, bias, SIGMOID: tl.constexpr):
    """The forward's per-tile row reduction: the online LSE's ``(max, sum exp, sum exp * l)``, or
    with ``SIGMOID`` the sigmoid reduction's plain row sums ``(sum term, sum sigma * l, sum
    sigma)`` (partials of splits then add, no rescaling)."""
    if SIGMOID:
        term, sigma = sigmoid_terms(logits, own, bias)
        m += tl.sum(tl.where(keep, term, 0.0), 1)
        l += tl.sum(tl.where(keep, sigma * logits, 0.0), 1)
        u += tl.sum(tl.where(keep, sigma, 0.0), 1)
        return m, l, u
    else:
        return online_lse(m, l, u, logits, keep)


@triton.jit
def grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of a linear tile index in grouped order: consecutive tiles share
    column panels of the second operand in L2 (the Triton matmul tutorial's swizzle)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_rows
    pid_n = (tile % per_group) // group_rows
    return pid_m, pid_n


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
# kernels, launches by keyword, recording
# ---------------------------------------------------------------------------------------

ARCHS = ("sm80", "sm90")


class Kernel:
    """A jit kernel and the config-table role it takes its block sizes from
    (``fastcl.kernels.configs``)."""

    registry: dict[str, Kernel] = {}

    def __init__(self, fn, role: str):
        self.fn, self.name, self.role = fn, fn.__name__, role
        # the interpreter's function has no .params: read the annotations of the source function
        params = inspect.signature(fn.fn).parameters.values()
        self.constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
        self.checked: set[frozenset] = set()  # argument-name sets already validated
        Kernel.registry[self.name] = self


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
    """What one launch passed: argument types, the launcher's constexprs and the config."""

    kernel: str
    dclass: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    config: object = None  # fastcl.kernels.configs.Config
    grid: tuple[int, ...] = ()

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
    sms: int | None = None  # planning SM count for dry runs


_STATE = _State()


@contextlib.contextmanager
def recording(dry: bool = False, arch: str | None = None, sms: int | None = None, record: bool = True):
    """Collect every :class:`Launch` made inside. ``dry``: launch nothing (tensors may live on
    any device; outputs stay uninitialised); ``arch`` / ``sms``: plan for this arch and SM
    count instead of the tensors' device (a dry run for an H100 on CPU tensors:
    ``recording(dry=True, arch="sm90", sms=132)``); ``record=False``: keep no list (a dry run
    that times the launchers' host cost, ``benchmarks.harness.launches.host_overhead``)."""
    saved = _STATE.records, _STATE.dry, _STATE.arch, _STATE.sms
    _STATE.records, _STATE.dry, _STATE.arch, _STATE.sms = ([] if record else None), dry, arch, sms
    try:
        yield _STATE.records if record else []
    finally:
        _STATE.records, _STATE.dry, _STATE.arch, _STATE.sms = saved


def arch_of(device: torch.device) -> str:
    """Config table for a device: ``interp`` under the interpreter, else by compute capability."""
    if _STATE.arch is not None:
        return _STATE.arch
    if INTERPRET:
        return "interp"
    major, _ = torch.cuda.get_device_capability(device)
    return "sm90" if major >= 9 else "sm80"


_SMS: dict[int, int] = {}
# "SMs" of the interpreter: persistent grids get a few programs, so their tile loops stride
INTERP_PROGRAMS = 3


def num_sms(device: torch.device, arch: str) -> int:
    """Streaming multiprocessors of ``device`` (cached; the planning override in a dry run;
    ``INTERP_PROGRAMS`` under the interpreter)."""
    if _STATE.sms is not None:
        return _STATE.sms
    if arch == "interp" or device.type != "cuda":
        return INTERP_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


class KernelArgs:
    """Base of the launchers' argument records (frozen dataclasses, one per launch family, next
    to their kernels): a field is named as the kernel parameter it fills, or is a record of the
    same kind whose fields join in (a parameter group two kernels share). A pointer left None is
    one the launch's specialisation never reads: :meth:`kwargs` passes the placeholder ``none``
    there (Triton takes no None for a pointer). The kernels keep flat parameters; the records
    live on the host only."""

    __slots__ = ()

    def kwargs(self, none: torch.Tensor) -> dict:
        """The launch's keywords (:func:`launch`)."""
        out: dict = {}
        for name, value in self.__dict__.items():  # the fields, in order (no __slots__ in the records)
            if value is None:
                out[name] = none
            elif isinstance(value, KernelArgs):
                out.update(value.kwargs(none))
            else:
                out[name] = value
        out.update(self.derived())
        return out

    def derived(self) -> dict:
        """Parameters that follow from the fields (flags of the pointers given)."""
        return {}


@dataclass(frozen=True)
class RowArgs(KernelArgs):
    """The row sets the pre-pass and the forward sweep read: the anchors ``A [B, d]`` and both
    candidate blocks ``C0 [n0, d]``, ``C1 [n1, d]`` with their tags."""

    A: torch.Tensor
    C0: torch.Tensor
    C1: torch.Tensor
    TAGS0: torch.Tensor
    TAGS1: torch.Tensor
    B: int
    n0: int
    n1: int
    d: int


@dataclass(frozen=True)
class PrefixArgs(KernelArgs):
    """The sweeps' Matryoshka parameters: the sorted segment ends, their count and a self
    filter's threshold stride per prefix (a plain problem reads none of them)."""

    BOUNDS: torch.Tensor | None = None
    n_prefixes: int = 1
    stride_thr: int = 0
    PREFIXES: bool = False


@dataclass(frozen=True)
class ExtArgs(KernelArgs):
    """The sweeps' extension parameters that hold for a whole call (``contract.Filter``,
    ``contract.Sigmoid``): the poison, thresholds, guide anchors and their scales, the bias
    and the guide's width; a sweep adds its guide candidates and own positives."""

    POISON: torch.Tensor | None = None
    THR: torch.Tensor | None = None
    GA: torch.Tensor | None = None
    GNORMS: torch.Tensor | None = None
    BIAS: torch.Tensor | None = None
    g: int = 0
    FILTER: int = 0
    SIGMOID: bool = False


def _check_arguments(kernel: Kernel, config, args: dict) -> None:
    expected = set(kernel.fn.arg_names) - set(config.kwargs)
    if set(args) != expected:
        raise TypeError(
            f"{kernel.name}: missing {sorted(expected - set(args))}, unexpected {sorted(set(args) - expected)}"
        )


def launch(kernel: Kernel, grid: tuple[int, ...], config, **args) -> None:
    """Launch ``kernel`` on ``grid`` with ``config``'s block sizes and every other argument by
    keyword. The argument names are checked on the first launch of each name set (and on
    every recorded launch); the launch is recorded when a :func:`recording` is active."""
    names = frozenset(args)
    if names not in kernel.checked or _STATE.records is not None:
        _check_arguments(kernel, config, args)
        kernel.checked.add(names)
    if _STATE.records is not None:
        ordered = [n for n in kernel.fn.arg_names if n in args]
        flags = tuple((n, args[n]) for n in ordered if n in kernel.constexprs)
        sig = tuple((n, triton_type(args[n])) for n in ordered if n not in kernel.constexprs)
        dclass = config.dclass
        _STATE.records.append(Launch(kernel.name, dclass, sig, flags, config, tuple(grid)))
    if _STATE.dry or 0 in grid:
        return
    from torch.library import wrap_triton

    wrap_triton(kernel.fn)[tuple(grid)](
        **args, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages
    )


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
