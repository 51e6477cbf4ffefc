"""The row pre-pass: one scale per row of the anchors and of both candidate blocks, in one launch.

``NORMS [2, K, R]`` (``R = B + N0 + N1``: anchors, then block 0, then block 1; ``K`` prefixes,
1 without Matryoshka dims) receives per row:

* cosine: ``inv = 1 / max(|x|, eps)`` and ``rinv`` (``inv``, or 0 where the norm is clamped).
  The sum of squares runs in units of a power of two near the running max ``|x_k|`` (clamped
  so that its reciprocal is a normal number), so ``|x|`` is exact-to-rounding for any finite
  scale and multiplying by the unit's reciprocal is exact;
* dot similarity: ``inv = rinv = 1`` for a finite row, NaN for a row holding NaN/Inf (the
  tile kernels multiply every row by it, so all of such a row's logits are NaN: a raw
  ``+-inf`` dot product could give a ``-inf`` logit that ``exp`` would turn into a silent 0).

A non-finite row gets NaN in both modes. Padded candidate rows (tag ``PAD``) read as zero.

``CLEAN`` (a filtered problem, ``contract.Filter``): the pass also writes each row set's copy
with non-finite entries read as zeros (``CLEAN_A``, ``CLEAN_C0``, ``CLEAN_C1``; padded rows all
zeros), the scales of those copies, and ``POISON [K, R]``: NaN for a row with a non-finite entry
in prefix ``k``, else 0 (the tile kernels add it to every logit of the row; a logit the filter
drops is masked by selection, so the NaN reaches only the rows that keep it).
With Matryoshka ``BOUNDS`` (sorted prefix lengths) the sums run on, segment by segment, and
prefix ``k``'s scales are written at the end of segment ``k``: one pass over each row. There
a row holding an entry of magnitude ``2^50`` or more (``2^400`` for fp64) is refused
numerically like a non-finite row (NaN scales): the prefix tiles multiply raw rows and fold
``ia * ic`` into dS, which could overflow or underflow beyond that (docs/triton.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from ._common import (
    SCALE_HI_F32,
    SCALE_HI_F64,
    SCALE_LO_F32,
    SCALE_LO_F64,
    TAG_PADDING,
    Kernel,
    KernelArgs,
    RowArgs,
    sqrt_rn,
)


@triton.jit
def _pow2_floor(x):
    """The power of two with ``x``'s exponent (``x >= 0``; 0 for subnormals, Inf for Inf/NaN)."""
    if x.dtype == tl.float64:
        return (x.to(tl.int64, bitcast=True) & 0x7FF0000000000000).to(tl.float64, bitcast=True)
    else:
        return (x.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def ssq_step(scale, ssq, x, HI: tl.constexpr):
    """Add a ``[BR, BD]`` chunk to the sum of squares ``ssq`` kept in units of ``scale^2``;
    returns the new unit (at least ``scale``, near the running max ``|x|``, at most ``HI``)."""
    new = tl.minimum(tl.maximum(scale, _pow2_floor(tl.max(tl.abs(x), 1))), HI)
    ratio = scale / new  # written out: a helper returning the rescaled chunk spilled 16 B (sm_80/90)
    xs = x * (1.0 / new)[:, None]
    return new, ssq * ratio * ratio + tl.sum(xs * xs, 1)


@triton.jit
def inverse_norms(norm, bad, eps):
    """``(inv, rinv)``: ``1 / max(norm, eps)`` and the same with 0 where clamped; NaN where ``bad``."""
    inv = tl.where(bad, float("nan"), 1.0 / tl.maximum(norm, eps))
    return inv, tl.where(norm > eps, inv, tl.where(bad, inv, 0.0))


@triton.jit
def _row_norms_kernel(
    A,
    C0,
    C1,
    TAGS0,
    TAGS1,
    BOUNDS,
    NORMS,
    CLEAN_A,
    CLEAN_C0,
    CLEAN_C1,
    POISON,
    B,
    n0,
    n1,
    d,
    n_prefixes,
    eps,
    COSINE: tl.constexpr,
    PREFIXES: tl.constexpr,
    CLEAN: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
):
    ACC: tl.constexpr = tl.float64 if A.dtype.element_ty == tl.float64 else tl.float32
    # program -> row set: anchors, then block 0, then block 1 (one launch for all three)
    pid = tl.program_id(0)
    g_a = tl.cdiv(B, BR)
    g_0 = tl.cdiv(n0, BR)
    in_a = pid < g_a
    in_0 = (pid >= g_a) & (pid < g_a + g_0)
    X = tl.where(in_a, A, tl.where(in_0, C0, C1))
    TAGS = tl.where(in_0, TAGS0, TAGS1)
    local = tl.where(in_a, pid, tl.where(in_0, pid - g_a, pid - g_a - g_0))
    n = tl.where(in_a, B, tl.where(in_0, n0, n1))
    base = tl.where(in_a, 0, tl.where(in_0, B, B + n0))
    R = B + n0 + n1

    rows = local * BR + tl.arange(0, BR)
    ok = rows < n
    # padded candidate rows read as zero: their NaN/Inf cannot reach a norm
    # (a [BR] vector: the interpreter cannot take a scalar bool inside a load mask)
    is_candidate = tl.full([BR], 0, tl.int32) + pid >= g_a
    tag = tl.load(TAGS + rows, mask=ok & is_candidate, other=0)
    read = ok & (tag != TAG_PADDING)
    x_rows = X + rows.to(tl.int64)[:, None] * d
    if CLEAN:  # the row set's copy with non-finite entries read as zeros (contract.Filter)
        Y = tl.where(in_a, CLEAN_A, tl.where(in_0, CLEAN_C0, CLEAN_C1))
        y_rows = Y + rows.to(tl.int64)[:, None] * d
    out = NORMS + base + rows
    LO: tl.constexpr = SCALE_LO_F64 if ACC == tl.float64 else SCALE_LO_F32
    HI: tl.constexpr = SCALE_HI_F64 if ACC == tl.float64 else SCALE_HI_F32
    BIG: tl.constexpr = 2.5822498780869086e120 if ACC == tl.float64 else 1125899906842624.0  # 2^400, 2^50
    scale = tl.full([BR], LO, dtype=ACC)
    ssq = tl.zeros([BR], dtype=ACC)
    n_bad = tl.zeros([BR], dtype=tl.int32)
    lo = 0
    n_seg = n_prefixes if PREFIXES else 1
    # the clean copy's stores and selects beside the chunk spilled 8-32 B (fp32/fp64): half chunks
    BDC: tl.constexpr = BD // 2 if CLEAN else BD
    for k in range(0, n_seg):
        if PREFIXES:
            hi = tl.load(BOUNDS + k)
        else:
            hi = d
        for k0 in range(lo, hi, BDC):
            ks = k0 + tl.arange(0, BDC)
            x = tl.load(x_rows + ks[None, :], mask=read[:, None] & (ks < hi)[None, :], other=0.0)
            if CLEAN:
                finite = tl.abs(x.to(ACC)) < float("inf")  # false exactly for NaN and +-Inf
                n_bad += tl.sum(tl.where(finite, 0, 1), 1)
                x = tl.where(finite, x, 0.0)
                tl.store(y_rows + ks[None, :], x, mask=ok[:, None] & (ks < hi)[None, :])
            x = x.to(ACC)
            if COSINE:
                scale, ssq = ssq_step(scale, ssq, x, HI)
            elif not CLEAN:
                # |x| < inf is false exactly for NaN and +-Inf
                n_bad += tl.sum(tl.where(tl.abs(x) < float("inf"), 0, 1), 1)
        lo = hi
        if COSINE:
            norm = scale * sqrt_rn(ssq)
            # only a NaN or Inf entry makes the norm NaN or Inf (tl.max may skip a NaN): keep NaN
            bad = (norm != norm) | (norm == float("inf"))
            if PREFIXES:
                bad = bad | (scale >= BIG)
            inv, rinv = inverse_norms(norm, bad, eps)
        elif CLEAN:
            inv = tl.full([BR], 1.0, dtype=ACC)
            rinv = inv
        else:
            inv = tl.where(n_bad > 0, float("nan"), tl.full([BR], 1.0, dtype=ACC))
            rinv = inv  # unused by dot similarity; written so no slot is stale
        tl.store(out + k * R, inv, mask=ok)
        tl.store(out + (n_seg + k) * R, rinv, mask=ok)
        if CLEAN:  # NaN for a row with a non-finite entry in the prefix (padding: none)
            tl.store(POISON + k * R + base + rows, tl.where(n_bad > 0, float("nan"), 0.0).to(ACC), mask=ok)


ROW_NORMS = Kernel(_row_norms_kernel, "rows")


@dataclass(frozen=True)
class NormsArgs(KernelArgs):
    """:func:`_row_norms_kernel`'s arguments (``kernels/lse.py``'s ``_norms``): the prefixes
    follow from ``BOUNDS`` and ``CLEAN`` from ``POISON`` (given with the three clean copies)."""

    rows: RowArgs
    NORMS: Tensor
    eps: float
    COSINE: bool
    BOUNDS: Tensor | None = None
    CLEAN_A: Tensor | None = None
    CLEAN_C0: Tensor | None = None
    CLEAN_C1: Tensor | None = None
    POISON: Tensor | None = None

    def derived(self) -> dict:
        prefixes = self.BOUNDS is not None
        n = self.BOUNDS.shape[0] if self.BOUNDS is not None else 1
        return dict(n_prefixes=n, PREFIXES=prefixes, CLEAN=self.POISON is not None)
