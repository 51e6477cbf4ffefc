"""Masked cosine-LSE backward: recompute the logit tiles of a chunk of candidates into dS.

The gradient of a logit is ``G_ic = g_i * softmax_ic`` (plus the own-positive logits'
gradient ``d_pos`` at their columns). With ``d`` up to 1024 a row of ``d anchor`` does not
fit in registers beside a logit tile, so the two products with ``G`` run as GEMMs
(``matmul.py``) on a bounded *chunk* of recomputed ``dS`` (``B x width``, at most
``fastcl.config``'s ``triton.ds_bytes``). Per chunk (three launches)::

    _lse_ds_kernel   recompute the chunk's logit tiles; dS = G * ia * ic / tau (or G / tau),
                     partial sums of G * l per column (COLW, per row tile) and, unless the
                     fused head gave them (w_row), per row (ROWW, per column tile): the
                     radial part of the normalisation backward
    _mm  dC[chunk] = dS^T @ A - rc^2 <G, l>_col * C[chunk]          (complete, K = B)
    _mm  dA       += dS @ C[chunk]; last chunk: - ra^2 <G, l>_row * A

Four GEMM-sized passes in all (forward, recompute, two products): the ``8 B N d`` FLOPs of
the contract, every product on tensor cores. Deterministic: each output element has one
owner, reductions run in a fixed order, no atomics.

``g`` is ``G_ROWS[i]``, times ``ROW_W[i]`` (``ROW_W``) and the upstream gradient (``GO_MODE``
1: one scalar, 2: one per row): the fused head's backward hands over its unscaled
``dloss/dlse`` and the reduction weights, and no PyTorch op scales them first.

The ds kernel is persistent: ``n_progs`` programs loop over the chunk's tiles in grouped
order.

Matryoshka prefixes (``PREFIXES``) run the same loop: the K prefix tiles are recomputed
segment by segment (one main loop over ``d``), the kernel writes ``dS_k = G_k * ia_k * ic_k /
tau`` (norms folded: they differ per prefix) and turns them in place into suffix sums ``T_j =
sum_{k>=j} dS_k``, so that the GEMMs run once per segment and cover ``d`` once; its radial
partial sums come already multiplied by ``rinv_k^2``. A plain problem is the one-prefix case:
with ``PREFIXES`` off the segment loop has a constant single trip and the prefix work is not
generated.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from ._common import (
    FILTER_NONE,
    TAG_PADDING,
    ExtArgs,
    Kernel,
    KernelArgs,
    PrefixArgs,
    cast_to,
    dot_tile,
    ext_guide,
    ext_logits,
    ext_own,
    grouped_tile,
    load_tags,
    prefix_segment,
    sigmoid_terms,
    structural_mask,
)


@triton.jit
def _row_grad(logits, keep, own, lse, g, bias, SIGMOID: tl.constexpr):
    """``dLoss/dlogit`` of the tile for the rows' gradient ``g``: ``g softmax`` (LSE) or ``g sigma``
    (the sigmoid reduction), zero outside ``keep``."""
    if SIGMOID:
        _, sigma = sigmoid_terms(logits, own, bias)
        return tl.where(keep, sigma * g[:, None], 0.0)
    else:
        return tl.where(keep, tl.exp(logits - lse[:, None]) * g[:, None], 0.0)


@triton.jit
def _row_scale(rows, row_ok, ROW_W, GO, ROW_W_ON: tl.constexpr, GO_MODE: tl.constexpr, ACC: tl.constexpr):
    """``s_i``: the reduction weight times the upstream gradient (1 where neither is given)."""
    s = tl.full(rows.shape, 1.0, dtype=ACC)
    if ROW_W_ON:
        s = s * tl.load(ROW_W + rows, mask=row_ok, other=0.0).to(ACC)
    if GO_MODE == 1:
        s = s * tl.load(GO).to(ACC)
    if GO_MODE == 2:
        s = s * tl.load(GO + rows, mask=row_ok, other=0.0).to(ACC)
    return s


@triton.jit
def _fold_positives(grad, rows, cols, row_ok, DPOS, s, pos_offset, P, BM: tl.constexpr, BN: tl.constexpr):
    """Add the own-positive logits' gradient: positive ``k`` of row ``r`` is column
    ``pos_offset + r * P + k`` (added to the float32 tile before any rounding, so a confident
    positive does not leave a small difference of large rounded terms). Only the tiles that
    hold own positives (a band about ``BM * P`` columns wide) do any work, one ``[BM]`` column
    index per positive slot (a gathered ``[BM, BN]`` load held 64 more registers)."""
    r0 = tl.min(rows, 0)
    c0 = tl.min(cols, 0)
    first = pos_offset + r0 * P
    if (first < c0 + BN) & (first + BM * P > c0):
        start = pos_offset + rows.to(tl.int64) * P
        for k in range(0, P):
            d_k = tl.load(DPOS + rows.to(tl.int64) * P + k, mask=row_ok, other=0.0) * s
            grad += tl.where(cols[None, :] == (start + k)[:, None], d_k[:, None], 0.0)
    return grad


@triton.jit
def _lse_ds_kernel(
    A,
    C,
    TAGS,
    NORMS,
    TAU,
    LSE,
    G_ROWS,
    ROW_W,
    GO,
    DPOS,
    DS,
    ROWW,
    COLW,
    POISON,
    THR,
    GA,
    GC,
    GNORMS,
    BIAS,
    B,
    nc,
    d,
    g,
    c_norm,
    stride_ds,
    col_tile0,
    pos_offset,
    P,
    n_progs,
    BOUNDS,
    R,
    n_prefixes,
    stride_thr,
    COSINE: tl.constexpr,
    ROW_SUMS: tl.constexpr,
    SCALE_TILE: tl.constexpr,
    SCALE_ON_LOAD: tl.constexpr,
    FOLD_NORMS: tl.constexpr,
    FOLD_POS: tl.constexpr,
    ROW_W_ON: tl.constexpr,
    GO_MODE: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFIXES: tl.constexpr,
    FILTER: tl.constexpr,
    SIGMOID: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``PREFIXES``: every prefix of a tile (``BOUNDS``, ``NORMS [2, K, R]``, ``G_ROWS``, ``LSE``
    ``[K, B]``, ``DPOS [K, B, P]``, already scaled), then the suffix sums ``DS[j] = sum_{k >= j}
    dS_k`` in place (the tile is this program's alone); ``ROWW [col tiles, K, B]`` and ``COLW
    [row tiles, K, width]`` hold ``rinv_k^2 <G_k, l_k>`` partial sums. Off (plain), the segment
    loop has one trip of constant length and folds away: the prefix work is behind
    ``PREFIXES`` only."""
    ACC: tl.constexpr = tl.float64 if A.dtype.element_ty == tl.float64 else tl.float32
    K = n_prefixes if PREFIXES else 1  # plain: a constant, so the segment loop folds away
    inv_tau = 1.0 / tl.load(TAU)
    bias = 0.0
    if SIGMOID:
        bias = tl.load(BIAS).to(ACC)
    num_m = tl.cdiv(B, BM)
    num_n = tl.cdiv(nc, BN)
    stride_k = B * stride_ds  # prefix k's dS tiles
    # not flattened into the d loop as the forward's tiles are: the flattened loop spilled
    # 8-64 B on sm_90 (its prefetch is live through this epilogue); 227 registers, no spills
    for tile in range(tl.program_id(0), num_m * num_n, n_progs):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        row_ok = rows < B
        col_ok = cols < nc
        a_rows = A + tl.minimum(rows, B - 1).to(tl.int64)[:, None] * d
        c_rows = C + tl.minimum(cols, nc - 1).to(tl.int64)[:, None] * d
        if PREFIXES:  # every segment reads the masks and the tile's offsets
            tags = load_tags(TAGS, cols, col_ok)
            structural = structural_mask(rows, B, tags, col_ok)
            counted = row_ok[:, None] & (col_ok & (tags != TAG_PADDING))[None, :]
            tile_ok = row_ok[:, None] & col_ok[None, :]
            ds_offs = rows.to(tl.int64)[:, None] * stride_ds + cols[None, :]
        else:
            ia = tl.load(NORMS + rows, mask=row_ok, other=0.0)
            ic = tl.load(NORMS + c_norm + cols, mask=col_ok, other=0.0)
        acc = tl.zeros([BM, BN], dtype=ACC)
        own = ext_own(rows, cols, pos_offset, P, FILTER, SIGMOID)
        gdrop = ext_guide(GA, GC, GNORMS, THR, rows, cols, B, nc, rows, c_norm + cols, row_ok, col_ok, own, g, FILTER)
        # one main loop: the running accumulator at the end of segment k is prefix k's raw dot tile
        lo = 0
        for k in range(0, K):
            if PREFIXES:  # segment k, then prefix k's scales
                acc, lo, ia, ic = prefix_segment(
                    acc, lo, k, BOUNDS, NORMS, R, a_rows, c_rows, rows, c_norm, cols, row_ok, col_ok, PRECISION, BK
                )
            else:  # the mask after the product: no mask tile lives through the main loop
                acc = dot_tile(acc, a_rows, c_rows, 0, d, ia, ic, PRECISION, SCALE_ON_LOAD, EVEN_K, BK)
                tags = load_tags(TAGS, cols, col_ok)
                structural = structural_mask(rows, B, tags, col_ok)
            logits, keep = ext_logits(acc, ia, ic, inv_tau, structural, own, gdrop, POISON + k * R,
                                      THR + k * stride_thr, rows, c_norm + cols, rows, row_ok, col_ok, FILTER,
                                      SCALE_TILE)  # fmt: skip
            lse = 0.0
            if not SIGMOID:
                lse = tl.load(LSE + k * B + rows, mask=row_ok, other=0.0)
            scale = _row_scale(rows, row_ok, ROW_W, GO, ROW_W_ON, GO_MODE, ACC)
            g_row = tl.load(G_ROWS + k * B + rows, mask=row_ok, other=0.0) * scale
            grad = _row_grad(logits, keep, own, lse, g_row, bias, SIGMOID)  # dLoss/dlogit
            if FOLD_POS:
                grad = _fold_positives(grad, rows, cols, row_ok, DPOS + k * B * P, scale, pos_offset, P, BM, BN)
            # padded and out-of-range columns hold no gradient but may hold NaN logits (and so
            # may a column the filter drops)
            if not PREFIXES:
                counted = row_ok[:, None] & (col_ok & (tags != TAG_PADDING))[None, :]
            kept = counted
            if FILTER != FILTER_NONE:
                kept = counted & (keep | ~structural)
            if COSINE:
                # <G, l> per row (over this tile's columns) and per column (over its rows): the
                # radial part of the normalisation backward, summed by the GEMMs' epilogues
                # (prefixes: times rinv_k^2, so that one GEMM per segment serves every prefix's term)
                if PREFIXES:
                    ra = tl.load(NORMS + (K + k) * R + rows, mask=row_ok, other=0.0)
                    rc = tl.load(NORMS + (K + k) * R + c_norm + cols, mask=col_ok, other=0.0)
                gl = tl.where(kept, grad * logits, 0.0)
                if ROW_SUMS:  # (the fused head knows them from the forward: w_row)
                    row_part = ROWW + ((col_tile0 + pid_n).to(tl.int64) * K + k) * B + rows
                    row_sum = tl.sum(gl, 1)
                    if PREFIXES:
                        row_sum = row_sum * ra * ra
                    tl.store(row_part, row_sum, mask=row_ok)
                col_part = COLW + (pid_m.to(tl.int64) * K + k) * stride_ds + cols
                col_sum = tl.sum(gl, 0)
                if PREFIXES:
                    col_sum = col_sum * rc * rc
                tl.store(col_part, col_sum, mask=col_ok)
            if PREFIXES:  # norms folded: they differ per prefix
                ds = grad * (ia * inv_tau)[:, None] * ic[None, :]
                if FILTER != FILTER_NONE:  # exactly 0 where dropped, even beside a refused (NaN-scaled) row
                    ds = tl.where(kept, ds, 0.0)
                tl.store(DS + k * stride_k + ds_offs, cast_to(ds, DS.dtype.element_ty), mask=tile_ok)
            else:
                ds = grad * inv_tau
                if FOLD_NORMS:
                    ds = ds * ia[:, None] * ic[None, :]
                out = DS + rows.to(tl.int64)[:, None] * stride_ds + cols[None, :]
                tl.store(out, cast_to(ds, DS.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        if PREFIXES:  # suffix sums T_j = sum_{k >= j} dS_k, so that the GEMMs run once per segment
            total = tl.zeros([BM, BN], dtype=ACC)
            for j in range(0, K):
                ptr = DS + (K - 1 - j) * stride_k + ds_offs
                total += tl.load(ptr, mask=tile_ok, other=0.0)
                tl.store(ptr, total, mask=tile_ok)


DS = Kernel(_lse_ds_kernel, "ds")


@dataclass(frozen=True)
class DsArgs(KernelArgs):
    """:func:`_lse_ds_kernel`'s arguments common to a backward's chunks. ``kernels/lse.py``'s
    ``_ChunkPlan`` builds one per backward and turns it into keywords once; each chunk adds a
    :class:`DsChunk`. Flags of the pointers given: ``ROW_SUMS`` (``ROWW``), ``ROW_W_ON``
    (``ROW_W``); ``SCALE_TILE`` is ``not SCALE_ON_LOAD``."""

    A: Tensor
    NORMS: Tensor
    TAU: Tensor
    LSE: Tensor
    G_ROWS: Tensor
    DS: Tensor
    B: int
    d: int
    R: int
    stride_ds: int
    COSINE: bool
    SCALE_ON_LOAD: bool
    FOLD_NORMS: bool
    GO_MODE: int
    EVEN_K: bool
    PRECISION: str
    ext: ExtArgs
    prefix: PrefixArgs
    ROW_W: Tensor | None = None
    GO: Tensor | None = None
    ROWW: Tensor | None = None
    COLW: Tensor | None = None

    def derived(self) -> dict:
        flags = dict(ROW_SUMS=self.ROWW is not None, ROW_W_ON=self.ROW_W is not None)
        return dict(flags, SCALE_TILE=not self.SCALE_ON_LOAD)


@dataclass(frozen=True)
class DsChunk(KernelArgs):
    """One chunk's part of a ds launch: its candidate rows and tags, the own positives' fold
    (``FOLD_POS`` when ``DPOS`` is given; ``pos_offset`` relative to the chunk), the guide rows,
    the chunk's width, norm column and first column tile, and its persistent grid."""

    C: Tensor
    TAGS: Tensor
    DPOS: Tensor | None
    GC: Tensor | None
    nc: int
    c_norm: int
    col_tile0: int
    n_progs: int
    pos_offset: int
    P: int

    def derived(self) -> dict:
        return dict(FOLD_POS=self.DPOS is not None)
