"""A persistent strided GEMM with the epilogues the LSE backward needs (one kernel, flags per use).

    out[m, n] = mscale[m] * sum_k X[m, k] * (kscale[k] * Y[k, n])       (main loop)
              + ACC_IN[m, n]                                          (ACCUMULATE)
              - rinv[m]^2 * w[m] * Z[m, n]                           (RADIAL)
      w[m]    = sum_p RADW[p, m]  (RADIAL_SCALE 1: times RSCALE[m] * GO[0]; 2: times GO[m])

The grid is sized to the device (``n_progs`` programs, each looping over output tiles in
grouped order). Loads are masked only on the edges of contiguous dimensions that a tile
crosses (``EVEN_M``/``EVEN_N``/``EVEN_K`` off); strided rows past the end are clamped.

Flags, padding and determinism: docs/triton.md, "The backward GEMM". ``SPLIT_X``: ``X`` is
float32 and ``Y`` 16-bit; ``X`` is fed to the tensor cores as a hi + lo pair of 16-bit
halves (fp32-like accuracy at two MMAs). ``PAD_K``: ``TAGS`` mark padded rows of ``Y`` (read
as zero: a NaN there reaches nothing); ``PAD_M``: padded output rows (written as exact
zeros, ``Z`` not read). Every output element has one owner and a fixed summation order: no
atomics, no split-K, deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from torch import Tensor

from ._common import TAG_PADDING, Kernel, cast_to, grouped_tile, mma


@triton.jit
def _mm_kernel(
    X,
    Y,
    OUT,
    ACC_IN,
    KSCALE,
    MSCALE,
    RINV,
    RADW,
    RSCALE,
    GO,
    Z,
    TAGS,
    M,
    N,
    K,
    stride_x,
    stride_yk,
    stride_om,
    n_parts,
    stride_radw,
    n_progs,
    X_T: tl.constexpr,
    SPLIT_X: tl.constexpr,
    Y_KSCALE: tl.constexpr,
    M_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    RADIAL: tl.constexpr,
    RADIAL_SCALE: tl.constexpr,
    PAD_K: tl.constexpr,
    PAD_M: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    ACC: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    # int32 offsets: the launcher keeps every operand under 2**31 elements (plan.chunk_width,
    # plan.size_reasons), which keeps the main loop's registers free
    for tile in range(tl.program_id(0), num_m * num_n, n_progs):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        m_ok = rm < M
        n_ok = rn < N
        # Running pointers advanced by BK (one live pointer tile per operand). The contiguous
        # dimension of each operand is known at compile time (X_T: X read transposed, its m
        # contiguous) and never clamped: a clamped or two-stride index hides the contiguity,
        # 16-bit loads are then not vectorised, and unvectorised loads cannot be copied
        # asynchronously, so the main loop was not pipelined. Edges of contiguous dimensions
        # are masked instead (EVEN_M / EVEN_N / EVEN_K: none to mask); the strided dimension
        # of X is clamped, its rows past M read and never stored.
        rk = tl.arange(0, BK)
        if X_T:  # loaded as its [BK, BM] row-major tile and transposed
            x_ptrs = X + rm[None, :] + rk[:, None] * stride_x
        else:
            x_ptrs = X + tl.minimum(rm, M - 1)[:, None] * stride_x + rk[None, :]
        y_ptrs = Y + rn[None, :] + rk[:, None] * stride_yk
        acc = tl.zeros([BM, BN], dtype=ACC)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = (rk < K) | EVEN_K
            if X_T:
                x = tl.trans(tl.load(x_ptrs, mask=k_ok[:, None] & (m_ok | EVEN_M)[None, :], other=0.0))
                x_ptrs += BK * stride_x
            else:
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                x_ptrs += BK
            y_ok = k_ok
            if PAD_K:
                y_ok = y_ok & (tl.load(TAGS + rk, mask=k_ok, other=TAG_PADDING) != TAG_PADDING)
            y = tl.load(y_ptrs, mask=y_ok[:, None] & (n_ok | EVEN_N)[None, :], other=0.0)
            y_ptrs += BK * stride_yk
            if Y_KSCALE:
                ks = tl.load(KSCALE + rk, mask=k_ok, other=0.0)
                y = cast_to(y.to(ACC) * ks[:, None], y.dtype)
            if SPLIT_X:
                x_hi = cast_to(x, y.dtype)
                x_lo = cast_to(x - x_hi.to(tl.float32), y.dtype)
                acc = mma(x_hi, y, acc, PRECISION)
                acc = mma(x_lo, y, acc, PRECISION)
            else:
                acc = mma(x, y, acc, PRECISION)

        if M_SCALE:
            acc = acc * tl.load(MSCALE + rm, mask=m_ok, other=0.0)[:, None]
        out_offs = rm[:, None] * stride_om + rn[None, :]
        out_ok = m_ok[:, None] & n_ok[None, :]
        z_ok = out_ok
        if PAD_M:
            m_pad = tl.load(TAGS + rm, mask=m_ok, other=TAG_PADDING) == TAG_PADDING
            z_ok = out_ok & ~m_pad[:, None]
        if ACCUMULATE:
            acc += tl.load(ACC_IN + out_offs, mask=out_ok, other=0.0).to(ACC)
        if RADIAL:
            w = tl.zeros([BM], dtype=ACC)
            for p in range(0, n_parts):
                w += tl.load(RADW + p * stride_radw + rm, mask=m_ok, other=0.0).to(ACC)
            if RADIAL_SCALE == 1:  # the reduction's weights times the upstream scalar
                w = w * tl.load(RSCALE + rm, mask=m_ok, other=0.0).to(ACC) * tl.load(GO).to(ACC)
            if RADIAL_SCALE == 2:  # an upstream gradient per row (reduction "none")
                w = w * tl.load(GO + rm, mask=m_ok, other=0.0).to(ACC)
            rinv = tl.load(RINV + rm, mask=m_ok, other=0.0).to(ACC)
            z = tl.load(Z + out_offs, mask=z_ok, other=0.0).to(ACC)
            # (rinv * w) * (rinv * z): |x|^-2 itself could underflow for huge rows
            acc -= (rinv * w)[:, None] * (z * rinv[:, None])
        if PAD_M:
            acc = tl.where(m_pad[:, None], 0.0, acc)
        tl.store(OUT + out_offs, cast_to(acc, OUT.dtype.element_ty), mask=out_ok)


MM = Kernel(_mm_kernel, "mm")


class Product(NamedTuple):
    """One launch of :func:`_mm_kernel` as the LSE backward plans it (``kernels/lse.py``):
    ``OUT = X @ Y`` and its epilogue. ``X`` is a dS chunk ``[B, width]``, read transposed
    through its strides for the candidates' gradient (``x_transposed``); ``tags`` mark the
    padded rows of ``OUT`` (the candidates') or of ``Y`` (the anchors'; ``pad`` False: there
    are none and the loads need no mask); ``acc_in`` is added; ``kscale`` scales ``Y``'s rows
    on load and ``mscale`` the output rows; the radial term is on when ``rinv`` is given, with
    ``z`` and the weights ``sum_p radw[p]`` (``n_parts`` rows ``stride_radw`` apart;
    ``radial_scale`` 1: times ``rscale * go[0]``, 2: times ``go`` per row)."""

    X: Tensor
    Y: Tensor
    OUT: Tensor
    tags: Tensor
    x_transposed: bool
    pad: bool = True
    acc_in: Tensor | None = None
    kscale: Tensor | None = None
    mscale: Tensor | None = None
    rinv: Tensor | None = None
    radw: Tensor | None = None
    n_parts: int = 1
    stride_radw: int = 0
    z: Tensor | None = None
    rscale: Tensor | None = None
    go: Tensor | None = None
    radial_scale: int = 0

    def kwargs(self, cfg, precision: str, n_progs: int, none: Tensor) -> dict:
        """The kernel's keywords: the operands' sizes, strides and flags follow from them."""
        X, Y, OUT = self.X, self.Y, self.OUT
        (M, N), K = OUT.shape, Y.shape[0]
        radial = self.rinv is not None

        def ptr(t: Tensor | None) -> Tensor:  # a pointer the specialisation never reads: the placeholder
            return none if t is None else t

        # one dict literal: this runs for every GEMM launch of a backward (host time per launch)
        return {
            "X": X,
            "Y": Y,
            "OUT": OUT,
            "TAGS": self.tags,
            "ACC_IN": ptr(self.acc_in),
            "KSCALE": ptr(self.kscale),
            "MSCALE": ptr(self.mscale),
            "RINV": ptr(self.rinv),
            "RADW": ptr(self.radw),
            "RSCALE": ptr(self.rscale),
            "GO": ptr(self.go),
            "Z": ptr(self.z),
            "M": M,
            "N": N,
            "K": K,
            "n_parts": self.n_parts,
            "n_progs": n_progs,
            "stride_x": X.stride(0),
            "stride_yk": Y.stride(0),
            "stride_om": OUT.stride(0),
            "stride_radw": self.stride_radw,
            "X_T": self.x_transposed,
            "SPLIT_X": X.dtype != Y.dtype,
            "PRECISION": precision,
            "Y_KSCALE": self.kscale is not None,
            "M_SCALE": self.mscale is not None,
            "ACCUMULATE": self.acc_in is not None,
            "RADIAL": radial,
            "RADIAL_SCALE": self.radial_scale if radial else 0,
            "PAD_K": self.pad and not self.x_transposed,
            "PAD_M": self.x_transposed,
            "EVEN_M": M % cfg["BM"] == 0,
            "EVEN_N": N % cfg["BN"] == 0,
            "EVEN_K": K % cfg["BK"] == 0,
        }
