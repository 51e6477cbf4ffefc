"""Matryoshka LSE (``LSEProblem.dims``): K prefix problems from one pass over ``d``.

Prefix ``k`` is the plain problem on the first ``m_k`` coordinates (docs/design.md,
"Matryoshka prefixes"). Its raw dot products are partial sums of the full ones, so every
tile kernel here runs the plain kernels' ``d`` loop *segment by segment* (segment ``j``:
coordinates ``[m_{j-1}, m_j)`` of the sorted prefixes) and, at the end of segment ``k``,
uses the running accumulator as prefix ``k``'s dot tile: one GEMM main loop for all K.
The launchers sort ``dims`` (the kernels see ascending boundaries in ``BOUNDS``) and put
the outputs back in the caller's order. ``K`` is a runtime argument (at most
``MAX_PREFIXES``): one compiled kernel serves every dims tuple.

Pre-pass ``_prefix_norms_kernel``: per prefix and row, what the plain pre-pass computes
for that prefix (``INV``/``RINV [K, rows]``: inverse clamped norms, or the dot row scale 1 /
NaN, NaN exactly when the *prefix* holds a NaN/Inf), from one pass over the row.

Forward ``_prefix_fwd_kernel``: the plain split forward, K online LSEs per row (state
``[MAX_PREFIXES, BM]`` in registers); partials go to a ``[3, slots, K * B]`` buffer that
the plain combine kernel reduces as ``K * B`` independent rows.

Backward: the gradient w.r.t. coordinate ``j`` of a row sums the prefixes that contain
``j``, i.e. prefixes ``k >= seg(j)``. ``_prefix_ds_kernel`` recomputes the K logit tiles of
a chunk the same way and writes ``dS_k = G_k * ia_k * ic_k / tau`` (norms folded: they
differ per prefix), then turns them in place into suffix sums ``T_j = sum_{k >= j} dS_k``;
the plain GEMM (``matmul.py``) then runs once per segment on ``T_j`` and the segment's
columns of the other operand, so the products cover ``d`` once. The radial term of the
cosine backward is ``- sum_{k >= j} rinv_k^2 <G_k, l_k> x`` on segment ``j``; the ds kernel
emits the per-prefix partial sums already multiplied by ``rinv_k^2`` and the launcher takes
their suffix sums over ``k`` ([K, rows] sized), handed to the GEMM's RADIAL epilogue with a
row scale of one.

Numerics (differences from the plain path): the tiles are scaled after the product, never
on load (one load scale cannot serve prefixes with different norms), and the GEMMs take
``ia_k * ic_k`` folded into dS and ``rinv_k^2`` in the radial weights. Cosine rows are
therefore scale-free only while those stay in range: a row holding an entry of magnitude
``2^50`` (about 1e15; ``2^400`` for fp64) or more is refused numerically, as a non-finite
row is (its prefixes' row scales are NaN, so every row that sees it gets a NaN loss)
instead of overflowing into a silently dropped ``-inf`` logit. 16-bit inputs keep dS in
float32 (the ``input`` dS mode does not apply: the suffix sums would add rounded terms).
Extra memory: O((B + N) * K) norms and row statistics and one dS chunk of ``K * B * width``
elements whose width shrinks with K (bytes as the plain chunk); no B x N buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastcl.ops.contract import new_output, prefix_order

from . import plan
from ._common import (
    PAD_TAG,
    SCALE_HI_F32,
    SCALE_HI_F64,
    SCALE_LO_F32,
    SCALE_LO_F64,
    Kernel,
    acc_dtype,
    arch_of,
    cfg,
    dot_precision,
    dtype_class,
    dummy,
    launch,
    load_tags,
    mma,
    online_lse,
    register_op,
    sqrt_rn,
    structural_mask,
)
from .lse_bwd import SUM_PARTS, gradient_gemm
from .lse_fwd import COMBINE, _check_layout, _ssq_step, _store_inverse_norms

# the forward keeps its K online-LSE states in one [MAX_PREFIXES, BM] register tile
MAX_PREFIXES = 8
KP = tl.constexpr(MAX_PREFIXES)


@triton.jit
def _prefix_norms_kernel(
    X,
    TAGS,
    BOUNDS,
    INV,
    RINV,
    n_rows,
    d,
    n_prefixes,
    stride_p,
    eps,
    HAS_TAGS: tl.constexpr,
    NORMS: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
):
    """The plain pre-pass (``lse_fwd._row_norms_kernel``) with a snapshot per prefix: the
    scale-free sum of squares (or the count of non-finite entries) runs on, segment by
    segment, and is turned into prefix ``k``'s row scales at the end of segment ``k``."""
    ACC: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < n_rows
    read = ok
    if HAS_TAGS:  # padded rows read as zero: their NaN/Inf cannot reach a norm
        read = ok & (tl.load(TAGS + rows, mask=ok, other=PAD_TAG) != PAD_TAG)
    x_rows = X + rows.to(tl.int64)[:, None] * d
    LO: tl.constexpr = SCALE_LO_F64 if ACC == tl.float64 else SCALE_LO_F32
    HI: tl.constexpr = SCALE_HI_F64 if ACC == tl.float64 else SCALE_HI_F32
    BIG: tl.constexpr = 2.5822498780869086e120 if ACC == tl.float64 else 1125899906842624.0  # 2^400, 2^50
    scale = tl.full([BR], LO, dtype=ACC)
    ssq = tl.zeros([BR], dtype=ACC)
    n_bad = tl.zeros([BR], dtype=tl.int32)
    lo = 0
    for k in range(0, n_prefixes):
        hi = tl.load(BOUNDS + k)
        for k0 in range(lo, hi, BD):
            ks = k0 + tl.arange(0, BD)
            x = tl.load(x_rows + ks[None, :], mask=read[:, None] & (ks < hi)[None, :], other=0.0).to(ACC)
            if NORMS:
                scale, ssq = _ssq_step(scale, ssq, x, HI)
            else:
                n_bad += tl.sum(tl.where(tl.abs(x) < float("inf"), 0, 1), 1)
        lo = hi
        out = k * stride_p + rows
        if NORMS:
            norm = scale * sqrt_rn(ssq)
            # a row with an entry >= BIG is refused numerically (NaN, as a non-finite row):
            # the tiles here multiply raw rows, whose products could overflow, and fold
            # ia * ic, which could underflow (module docstring, "Numerics")
            bad = (norm != norm) | (norm == float("inf")) | (scale >= BIG)
            _store_inverse_norms(INV + out, RINV + out, ok, norm, bad, eps)
        else:
            inv = tl.where(n_bad > 0, float("nan"), tl.full([BR], 1.0, dtype=ACC))
            tl.store(INV + out, inv, mask=ok)
            tl.store(RINV + out, inv, mask=ok)


@triton.jit
def _segment_dot(acc, x_rows, y_rows, row_ok, col_ok, lo, hi, BK: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + <x_r[lo:hi], y_c[lo:hi]>`` for a ``[BM, BN]`` tile (rows outside the masks read as zero)."""
    for k0 in range(lo, hi, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < hi
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        y = tl.load(y_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = mma(x, tl.trans(y), acc, PRECISION)
    return acc


@triton.jit
def _prefix_logits(acc, k, rows, cols, row_ok, col_ok, IA, IC, stride_p, inv_tau):
    """Prefix ``k``'s logit tile from its raw dot tile, and its two row-scale vectors."""
    ia = tl.load(IA + k * stride_p + rows, mask=row_ok, other=0.0)
    ic = tl.load(IC + k * stride_p + cols, mask=col_ok, other=0.0)
    return acc * (ia * inv_tau)[:, None] * ic[None, :], ia, ic


@triton.jit
def _prefix_fwd_kernel(
    A,
    C,
    TAGS,
    BOUNDS,
    IA,
    IC,
    TAU,
    PARTS,
    B,
    NC,
    d,
    n_prefixes,
    stride_p,
    split_width,
    split_base,
    n_slots,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    ACC: tl.constexpr = tl.float64 if A.dtype.element_ty == tl.float64 else tl.float32
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < B
    inv_tau = 1.0 / tl.load(TAU)
    # online-LSE state of every prefix: row k of each [KP, BM] tile
    prefix = tl.arange(0, KP)[:, None]
    m = tl.full([KP, BM], float("-inf"), dtype=ACC)
    l = tl.zeros([KP, BM], dtype=ACC)
    u = tl.zeros([KP, BM], dtype=ACC)
    a_rows = A + rows.to(tl.int64)[:, None] * d
    c_begin = pid_s * split_width
    c_end = tl.minimum(c_begin + split_width, NC)
    for c0 in range(c_begin, c_end, BN):
        cols = c0 + tl.arange(0, BN)
        col_ok = cols < c_end
        tags = load_tags(TAGS, cols, col_ok)
        keep = structural_mask(rows, B, tags, col_ok)
        c_rows = C + cols.to(tl.int64)[:, None] * d
        acc = tl.zeros([BM, BN], dtype=ACC)
        lo = 0
        for k in range(0, n_prefixes):
            hi = tl.load(BOUNDS + k)
            acc = _segment_dot(acc, a_rows, c_rows, row_ok, col_ok & (tags != PAD_TAG), lo, hi, BK, PRECISION)
            lo = hi
            logits, _, _ = _prefix_logits(acc, k, rows, cols, row_ok, col_ok, IA, IC, stride_p, inv_tau)
            # select prefix k's state (sums over one row: -inf, NaN and values pass exactly)
            sel = prefix == k
            mk = tl.sum(tl.where(sel, m, 0.0), 0)
            lk = tl.sum(tl.where(sel, l, 0.0), 0)
            uk = tl.sum(tl.where(sel, u, 0.0), 0)
            mk, lk, uk = online_lse(mk, lk, uk, logits, keep)
            m = tl.where(sel, mk[None, :], m)
            l = tl.where(sel, lk[None, :], l)
            u = tl.where(sel, uk[None, :], u)
    slot = split_base + pid_s
    KB = n_prefixes * B
    out = prefix.to(tl.int64) * B + rows[None, :]
    ok = (prefix < n_prefixes) & row_ok[None, :]
    tl.store(PARTS + slot * KB + out, m, mask=ok)
    tl.store(PARTS + (n_slots + slot) * KB + out, l, mask=ok)
    tl.store(PARTS + (2 * n_slots + slot) * KB + out, u, mask=ok)


@triton.jit
def _prefix_ds_kernel(
    A,
    C,
    TAGS,
    BOUNDS,
    IA,
    IC,
    RA,
    RC,
    TAU,
    LSE,
    G,
    DPOS,
    DS,
    ROWW,
    COLW,
    B,
    NC,
    d,
    n_prefixes,
    stride_p,
    stride_ds,
    stride_dsk,
    stride_roww,
    stride_colw,
    n_row_parts,
    n_col_parts,
    pos_offset,
    pos_count,
    COSINE: tl.constexpr,
    FOLD_POS: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PART: tl.constexpr,
):
    """``lse_bwd._lse_ds_kernel`` for every prefix of one tile, then the suffix sums
    ``DS[j] = sum_{k >= j} dS_k`` in place (the tile is this program's alone)."""
    ACC: tl.constexpr = tl.float64 if A.dtype.element_ty == tl.float64 else tl.float32
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < B
    col_ok = cols < NC
    inv_tau = 1.0 / tl.load(TAU)
    tags = load_tags(TAGS, cols, col_ok)
    a_rows = A + rows.to(tl.int64)[:, None] * d
    c_rows = C + cols.to(tl.int64)[:, None] * d
    ds_rows = rows.to(tl.int64) * stride_ds  # [BM]: the [BM, BN] offsets are formed per use
    tile_ok = row_ok[:, None] & col_ok[None, :]
    acc = tl.zeros([BM, BN], dtype=ACC)
    lo = 0
    for k in range(0, n_prefixes):
        hi = tl.load(BOUNDS + k)
        acc = _segment_dot(acc, a_rows, c_rows, row_ok, col_ok & (tags != PAD_TAG), lo, hi, BK, PRECISION)
        lo = hi
        logits, ia, ic = _prefix_logits(acc, k, rows, cols, row_ok, col_ok, IA, IC, stride_p, inv_tau)
        lse = tl.load(LSE + k * B + rows, mask=row_ok, other=0.0)
        g = tl.load(G + k * B + rows, mask=row_ok, other=0.0)
        keep = structural_mask(rows, B, tags, col_ok)
        grad = tl.where(keep, tl.exp(logits - lse[:, None]) * g[:, None], 0.0)
        if FOLD_POS:  # as lse_bwd: own positive p of row r is column pos_offset + r * P + p
            row_start = rows.to(tl.int64)[:, None] * pos_count
            p = cols[None, :] - pos_offset - row_start
            is_pos = (p >= 0) & (p < pos_count) & tile_ok
            grad += tl.load(DPOS + k * B * pos_count + row_start + p, mask=is_pos, other=0.0)
        if COSINE:
            # rinv_k^2 <G_k, l_k> per row and per column (radial term), per PART-wide group
            ra = tl.load(RA + k * stride_p + rows, mask=row_ok, other=0.0)
            rc = tl.load(RC + k * stride_p + cols, mask=col_ok, other=0.0)
            gl = grad * logits
            row_sums = tl.sum(tl.reshape(gl, [BM, BN // PART, PART]), 2) * (ra * ra)[:, None]
            col_groups = pid_n * (BN // PART) + tl.arange(0, BN // PART)
            tl.store(
                ROWW + col_groups.to(tl.int64)[None, :] * stride_roww + k * B + rows[:, None],
                row_sums,
                mask=row_ok[:, None] & (col_groups < n_col_parts)[None, :],
            )
            col_sums = tl.sum(tl.reshape(gl, [BM // PART, PART, BN]), 1) * (rc * rc)[None, :]
            row_groups = pid_m * (BM // PART) + tl.arange(0, BM // PART)
            tl.store(
                COLW + row_groups.to(tl.int64)[:, None] * stride_colw + k * stride_ds + cols[None, :],
                col_sums,
                mask=(row_groups < n_row_parts)[:, None] & col_ok[None, :],
            )
        # the prefixes' norms differ, so they are folded into dS (the GEMMs take raw rows)
        ds = grad * (ia * inv_tau)[:, None] * ic[None, :]
        tl.store((DS + k * stride_dsk + ds_rows)[:, None] + cols[None, :], ds, mask=tile_ok)
    total = tl.zeros([BM, BN], dtype=ACC)
    for j in range(0, n_prefixes):
        ptr = (DS + (n_prefixes - 1 - j) * stride_dsk + ds_rows)[:, None] + cols[None, :]
        total += tl.load(ptr, mask=tile_ok, other=0.0)
        tl.store(ptr, total, mask=tile_ok)


# Config tables of their own (the plain kernels' are unchanged), chosen from compiled
# candidates as in plan.py (registers and spills: docs/triton.md). The ds kernel keeps its
# dot accumulator live through each prefix's epilogue (one [BM, BN] tile more than the
# plain kernel): 16-bit tiles of 64x64 need 8 warps, and fp32 64x64 spills on sm_90.
_ROWWISE = {a: {"16": [cfg(4, 1, BR=32, BD=64)]} for a in ("sm80", "sm90")}
_ROWWISE["interp"] = plan.ROWWISE["interp"]
_FWD_TILES = {
    "sm80": plan.TILES["sm80"],
    "sm90": {
        "16": [cfg(8, 4, BM=128, BN=64, BK=32), cfg(4, 4, BM=64, BN=64, BK=32)],
        "32": plan.TILES["sm90"]["32"],
        "64": [cfg(4, 2, BM=32, BN=32, BK=16)],
    },
    "interp": plan.TILES["interp"],
}
_DS_TILES = {
    "sm80": {
        "16": [cfg(8, 4, BM=64, BN=64, BK=32, PART=32), cfg(4, 3, BM=32, BN=64, BK=32, PART=32)],
        "32": [cfg(8, 3, BM=64, BN=64, BK=16, PART=32), cfg(4, 3, BM=32, BN=64, BK=16, PART=32)],
        "64": [cfg(4, 2, BM=32, BN=32, BK=16, PART=32), cfg(8, 2, BM=32, BN=64, BK=16, PART=32)],
    },
    "sm90": {
        "16": [cfg(8, 4, BM=64, BN=64, BK=32, PART=64)],
        "32": [cfg(4, 3, BM=32, BN=64, BK=16, PART=32)],
        "64": [cfg(4, 2, BM=32, BN=32, BK=16, PART=32), cfg(8, 2, BM=32, BN=64, BK=16, PART=32)],
    },
    "interp": plan.DS_TILES["interp"],
}
NORMS = Kernel(_prefix_norms_kernel, _ROWWISE, dtype_arg="X")
FWD = Kernel(_prefix_fwd_kernel, _FWD_TILES, dtype_arg="A")
DS = Kernel(_prefix_ds_kernel, _DS_TILES, dtype_arg="A")


def _partial_width(arch: str, dclass: str) -> int:
    """PART of the ds table (one value per table: it divides every BM and BN there)."""
    return DS.configs(arch, dclass)[0].kwargs["PART"]


def prefix_reasons(dims) -> list[str]:
    if dims is not None and len(dims) > MAX_PREFIXES:
        return [f"the triton backend takes at most {MAX_PREFIXES} matryoshka dims, got {len(dims)}"]
    return []


def _prepare(anchor, blocks, tags, tau, bounds, cosine, eps, norms, arch):
    """Layouts, tau and the per-prefix row scales ``(inv, rinv)`` ``[K, rows]`` of each part."""
    _check_layout((anchor, *blocks, *tags))
    tau = tau.to(acc_dtype(anchor.dtype)).reshape(1)
    edges = [0, anchor.shape[0], anchor.shape[0] + blocks[0].shape[0], norms.shape[-1]]
    views = [(norms[0, :, a:b], norms[1, :, a:b]) for a, b in zip(edges[:-1], edges[1:])]
    for x, tg, (inv, rinv) in zip((anchor, *blocks), (None, *tags), views):
        n, d = x.shape
        if n == 0:
            continue
        launch(
            NORMS,
            lambda meta, n=n: (triton.cdiv(n, meta["BR"]),),
            arch,
            X=x,
            TAGS=tg if tg is not None else dummy(x.device),
            BOUNDS=bounds,
            INV=inv,
            RINV=rinv,
            n_rows=n,
            d=d,
            n_prefixes=bounds.shape[0],
            stride_p=norms.shape[-1],
            eps=float(eps),
            HAS_TAGS=tg is not None,
            NORMS=cosine,
        )
    return tau, views


def _lse_forward_prefixes(
    anchor: Tensor,
    block0: Tensor,
    block1: Tensor,
    tags0: Tensor,
    tags1: Tensor,
    tau: Tensor,
    dims: list[int],
    cosine: bool,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """``(lse, mean_logit)`` ``[K, B]`` in ``dims`` order."""
    dev, dt = anchor.device, anchor.dtype
    (B, d), K = anchor.shape, len(dims)
    acc = acc_dtype(dt)
    arch = arch_of(dev)
    order, inverse = prefix_order(dims)
    lse = new_output((K, B), dtype=acc, device=dev)
    mean_logit = new_output((K, B), dtype=acc, device=dev)
    if B == 0:
        return lse, mean_logit
    sizes = (block0.shape[0], block1.shape[0])
    splits = plan.forward_splits(B, sizes, arch, dtype_class(dt), plan.num_sms(dev, arch))
    n_slots = sum(s for s, _ in splits)
    bufs = {"parts": ((3, n_slots, K * B), acc), "norms": ((2, K, B + sum(sizes)), acc)}
    ws = plan.Plan(bufs).allocate(dev)
    bounds = torch.tensor([dims[i] for i in order], dtype=torch.int32, device=dev)
    tau, views = _prepare(anchor, (block0, block1), (tags0, tags1), tau, bounds, cosine, eps, ws["norms"], arch)
    base = 0
    for blk, tg, (ic, _), (n_split, width) in zip((block0, block1), (tags0, tags1), views[1:], splits):
        if n_split == 0:
            continue
        launch(
            FWD,
            lambda meta, s=n_split: (triton.cdiv(B, meta["BM"]), s),
            arch,
            tune=(B, sum(sizes), d),
            A=anchor,
            C=blk,
            TAGS=tg,
            BOUNDS=bounds,
            IA=views[0][0],
            IC=ic,
            TAU=tau,
            PARTS=ws["parts"],
            B=B,
            NC=blk.shape[0],
            d=d,
            n_prefixes=K,
            stride_p=ws["norms"].shape[-1],
            split_width=width,
            split_base=base,
            n_slots=n_slots,
            PRECISION=dot_precision(dt),
        )
        base += n_split
    sorted_lse = new_output((K, B), dtype=acc, device=dev)
    sorted_mean = new_output((K, B), dtype=acc, device=dev)
    grid = lambda meta: (triton.cdiv(K * B, meta["BR"]),)  # noqa: E731
    launch(COMBINE, grid, arch, PARTS=ws["parts"], LSE=sorted_lse, MEAN_LOGIT=sorted_mean, B=K * B, n_slots=n_slots)
    lse.copy_(sorted_lse[inverse])
    mean_logit.copy_(sorted_mean[inverse])
    return lse, mean_logit


def _suffix_sums_(x: Tensor) -> Tensor:
    """``x[j] = sum_{k >= j} x[k]`` along dim 0, in place (K <= 8 small adds, fixed order)."""
    for j in range(x.shape[0] - 2, -1, -1):
        x[j] += x[j + 1]
    return x


def _lse_backward_prefixes(
    anchor: Tensor,
    block0: Tensor,
    block1: Tensor,
    tags0: Tensor,
    tags1: Tensor,
    tau: Tensor,
    lse: Tensor,
    g: Tensor,
    d_pos: Tensor | None,
    pos_offset: int,
    dims: list[int],
    cosine: bool,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Summed prefix gradients (input dtype) from ``lse``/``g`` ``[K, B]`` and ``d_pos [K, B, P]``."""
    dev, dt = anchor.device, anchor.dtype
    (B, d), K = anchor.shape, len(dims)
    acc = acc_dtype(dt)
    arch = arch_of(dev)
    blocks, tags = (block0, block1), (tags0, tags1)
    d_anchor = new_output((B, d), dtype=dt, device=dev)
    d_blocks = tuple(new_output(b.shape, dtype=dt, device=dev) for b in blocks)
    sizes = (block0.shape[0], block1.shape[0])
    too_big = plan.size_reasons(B, d)
    if too_big:
        raise ValueError(f"triton LSE backward: {too_big[0]}")
    # K dS tiles per column: the chunk narrows by K (same bytes, K * B * width < 2**31)
    width = plan.chunk_width(B * K, sizes, d, dt, arch)
    chunks = [(i, c0, min(c0 + width, n)) for i, n in enumerate(sizes) for c0 in range(0, n, width)]
    order, _ = prefix_order(dims)
    top = max(dims)
    for t in (d_anchor, *d_blocks):  # coordinates beyond every prefix get no gradient
        t[:, top:].zero_()
    if B == 0 or not chunks:
        for t in (d_anchor, *d_blocks):
            t.zero_()
        return (d_anchor, *d_blocks)
    part = _partial_width(arch, dtype_class(dt))
    bufs = {
        "ds": ((K, B, width), plan.ds_dtype(dt, True)),
        "norms": ((2, K, B + sum(sizes)), acc),
    }
    if cosine:
        bufs["row_parts"] = ((plan.cdiv(width, part), K, B), acc)
        bufs["col_parts"] = ((plan.cdiv(B, part), K, width), acc)
        bufs["row_w"] = ((K, B), acc)
    if len(chunks) > 1:
        bufs["d_anchor_acc"] = ((B, d), acc)
    ws = plan.Plan(bufs).allocate(dev)
    bounds = torch.tensor([dims[i] for i in order], dtype=torch.int32, device=dev)
    tau, views = _prepare(anchor, blocks, tags, tau, bounds, cosine, eps, ws["norms"], arch)
    lse, g = lse[order].to(acc).contiguous(), g[order].to(acc).contiguous()
    pos_count = 0 if d_pos is None else d_pos.shape[2]
    dpos = d_pos[order].to(acc).contiguous() if pos_count else None
    none = dummy(dev)
    ones = torch.ones(max(B, width), dtype=acc, device=dev) if cosine else none
    ds, acc_buf = ws["ds"], ws.get("d_anchor_acc", none)
    row_parts, col_parts, row_w = ws.get("row_parts", none), ws.get("col_parts", none), ws.get("row_w", none)
    sorted_dims = [dims[i] for i in order]
    segments = list(zip([0, *sorted_dims[:-1]], sorted_dims))
    precision = dot_precision(dt)
    for idx, (bi, c0, c1) in enumerate(chunks):
        first, last = idx == 0, idx == len(chunks) - 1
        nc = c1 - c0
        blk, tg, d_blk = blocks[bi][c0:c1], tags[bi][c0:c1], d_blocks[bi][c0:c1]
        ic, rc = views[bi + 1][0][:, c0:c1], views[bi + 1][1][:, c0:c1]
        n_row_parts, n_col_parts = plan.cdiv(B, part), plan.cdiv(nc, part)
        fold_pos = bi == 0 and pos_count > 0 and c0 < pos_offset + B * pos_count and pos_offset < c1
        launch(
            DS,
            lambda meta, nc=nc: (triton.cdiv(B, meta["BM"]), triton.cdiv(nc, meta["BN"])),
            arch,
            tune=(B, width, d),
            A=anchor,
            C=blk,
            TAGS=tg,
            BOUNDS=bounds,
            IA=views[0][0],
            IC=ic,
            RA=views[0][1],
            RC=rc,
            TAU=tau,
            LSE=lse,
            G=g,
            DPOS=dpos if fold_pos else none,
            DS=ds,
            ROWW=row_parts,
            COLW=col_parts,
            B=B,
            NC=nc,
            d=d,
            n_prefixes=K,
            stride_p=ws["norms"].shape[-1],
            stride_ds=width,
            stride_dsk=B * width,
            stride_roww=K * B,
            stride_colw=K * width,
            n_row_parts=n_row_parts,
            n_col_parts=n_col_parts,
            pos_offset=pos_offset - c0 if fold_pos else 0,
            pos_count=pos_count if fold_pos else 0,
            COSINE=cosine,
            FOLD_POS=fold_pos,
            PRECISION=precision,
        )
        if cosine:
            launch(
                SUM_PARTS,
                lambda meta: (triton.cdiv(K * B, meta["BR"]),),
                arch,
                PARTS=row_parts,
                OUT=row_w,
                n=K * B,
                n_parts=n_col_parts,
                stride_p=K * B,
                ACCUMULATE=not first,
            )
            _suffix_sums_(col_parts.transpose(0, 1)[:, :n_row_parts])
            if last:
                _suffix_sums_(row_w)
        radial = cosine and last
        for j, (lo, hi) in enumerate(segments):
            # segment j of the candidates' gradient: T_j^T @ A[:, lo:hi] (T_j read transposed)
            gradient_gemm(
                arch, ds[j], anchor[:, lo:hi], d_blk[:, lo:hi], tg, x_transposed=True, pad_out_rows=True,
                precision=precision, KSCALE=none, MSCALE=none, RINV=ones if cosine else none,
                RADW=col_parts[:, j] if cosine else none, Z=blk[:, lo:hi] if cosine else none,
                n_parts=n_row_parts, stride_radw=K * width, radial=cosine,
            )  # fmt: skip
            # segment j of the anchors' gradient: T_j @ C[chunk, lo:hi], accumulated over chunks
            gradient_gemm(
                arch, ds[j], blk[:, lo:hi], (d_anchor if last else acc_buf)[:, lo:hi], tg, x_transposed=False,
                pad_out_rows=False, precision=precision, ACC_IN=None if first else acc_buf[:, lo:hi],
                KSCALE=none, MSCALE=none, RINV=ones if radial else none, RADW=row_w[j] if radial else none,
                Z=anchor[:, lo:hi] if radial else none, n_parts=1, stride_radw=B, radial=radial,
            )  # fmt: skip
    return (d_anchor, *d_blocks)


lse_forward_prefixes = register_op("fastcl_triton::lse_forward_prefixes", _lse_forward_prefixes)
lse_backward_prefixes = register_op("fastcl_triton::lse_backward_prefixes", _lse_backward_prefixes)
