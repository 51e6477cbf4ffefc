"""Masked cosine-LSE forward sweep: split online LSE over both candidate blocks in one launch.

The contract is ``fastcl/ops/contract.py``: anchors ``A [B, d]``, candidate blocks
``C0 [N0, d]``, ``C1 [N1, d]`` with int32 tags, ``l_ic = <a_i, c> * ia_i * ic_c / tau`` where
``ia, ic`` are the row scales of the pre-pass (``norms.py``).

A program owns ``BM`` anchor rows and a contiguous run (*split*) of column tiles, block 0's
tiles first, then block 1's (a tile never straddles them); for each tile it runs the GEMM
main loop over ``d`` (:func:`~fastcl.kernels._common.dot_tile`), applies the structural mask
and keeps an online max / sum / softmax-weighted logit sum. The tile loop is flattened with
the ``d`` loop (``tl.range(..., flatten=True)``), so the software pipeline does not drain at
each tile's end. Splits (flash-decoding style) fill the device when ``B / BM`` alone would
not; the head kernel (``head.py``) merges them in a fixed order. Never a B x N buffer.

Loads are unmasked: rows past a block's end are clamped to its last row and masked in the
epilogue, so a padded candidate's NaN can reach its own column of the tile only, which the
structural mask drops (``-inf``, never read). A NaN/Inf in a kept column makes its rows' LSE
NaN.

Matryoshka prefixes (``PREFIXES``; docs/triton.md, "Matryoshka prefixes") run the same loop:
the ``d`` loop runs segment by segment (sorted prefix lengths in ``BOUNDS``) and the running
accumulator at the end of segment ``k`` is prefix ``k``'s raw dot tile, so one main loop
serves all K prefixes; K online-LSE states live in ``[KP, BM]`` register tiles. A plain
problem is the one-prefix case whose one segment is all of ``d``: with ``PREFIXES`` off the
segment loop has a constant single trip, which the compiler removes, and the prefix work
(per-prefix row scales, state selection) is not generated at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from ._common import (
    FILTER_NONE,
    ExtArgs,
    Kernel,
    KernelArgs,
    PrefixArgs,
    RowArgs,
    block_of_tile,
    dot_tile,
    ext_guide,
    ext_logits,
    ext_own,
    load_tags,
    prefix_segment,
    reduce_tile,
    structural_mask,
)

# Matryoshka: at most this many prefixes (their online-LSE states are one [MAX_PREFIXES, BM] tile)
MAX_PREFIXES = 8
KP = tl.constexpr(MAX_PREFIXES)


@triton.jit
def _tile_setup(A, C0, C1, TAGS0, TAGS1, t, tiles0, n0, n1, B, d, BN: tl.constexpr):
    """Column tile ``t``: its rows' pointers (clamped), tags, validity, norm offsets, whether it
    is in block 0 and its rows in its block."""
    in0, local, n, base = block_of_tile(t, tiles0, n0, n1, n0)
    C = tl.where(in0, C0, C1)
    TAGS = tl.where(in0, TAGS0, TAGS1)
    cols = local * BN + tl.arange(0, BN)
    col_ok = cols < n
    c_rows = C + tl.minimum(cols, n - 1).to(tl.int64)[:, None] * d
    tags = load_tags(TAGS, cols, col_ok)
    return cols, col_ok, c_rows, tags, B + base + cols, in0, n


@triton.jit
def _prefix_state(x, k, PREFIXES: tl.constexpr):
    """Prefix ``k``'s running state ``[BM]`` from the ``[KP, BM]`` tile (a sum over one row:
    -inf, NaN and values pass exactly); a plain problem's state is itself."""
    if PREFIXES:
        return tl.sum(tl.where(tl.arange(0, KP)[:, None] == k, x, 0.0), 0)
    else:
        return x


@triton.jit
def _set_prefix_state(x, k, xk, PREFIXES: tl.constexpr):
    """The state with prefix ``k``'s row replaced by ``xk`` (plain: ``xk``)."""
    if PREFIXES:
        return tl.where(tl.arange(0, KP)[:, None] == k, xk[None, :], x)
    else:
        return xk


@triton.jit
def _lse_fwd_kernel(
    A,
    C0,
    C1,
    TAGS0,
    TAGS1,
    NORMS,
    TAU,
    PARTS,
    POISON,
    THR,
    GA,
    GC0,
    GC1,
    GNORMS,
    BIAS,
    B,
    n0,
    n1,
    d,
    g,
    pos_offset,
    P,
    tiles0,
    n_tiles,
    tiles_per_split,
    n_slots,
    BOUNDS,
    n_prefixes,
    stride_thr,
    SCALE_TILE: tl.constexpr,
    SCALE_ON_LOAD: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFIXES: tl.constexpr,
    FILTER: tl.constexpr,
    SIGMOID: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """``PREFIXES``: the ``n_prefixes`` sorted prefix lengths in ``BOUNDS``, one online state per
    prefix; ``NORMS [2, K, R]``, ``POISON [K, R]`` and a self filter's ``THR`` (prefix ``k`` at
    ``k * stride_thr``) per prefix, in sorted order. Off (plain), the segment loop has one trip
    of constant length and the kernel compiles to the one-pass loop: the prefix work below is
    behind ``PREFIXES`` only."""
    ACC: tl.constexpr = tl.float64 if A.dtype.element_ty == tl.float64 else tl.float32
    K = n_prefixes if PREFIXES else 1  # plain: a constant, so the segment loop folds away
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    R = B + n0 + n1  # prefix k's row scales start at NORMS + k * R
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < B
    a_rows = A + tl.minimum(rows, B - 1).to(tl.int64)[:, None] * d
    if not PREFIXES:  # one set of row scales, read once (a prefix's are read after its segment)
        ia = tl.load(NORMS + rows, mask=row_ok, other=0.0)
    inv_tau = 1.0 / tl.load(TAU)
    bias = 0.0
    if SIGMOID:  # running (sum term, sum sigma * l, sum sigma)
        bias = tl.load(BIAS).to(ACC)
        m = tl.zeros([KP, BM] if PREFIXES else [BM], dtype=ACC)
    else:  # running (max, sum exp, sum exp * l)
        m = tl.full([KP, BM] if PREFIXES else [BM], float("-inf"), dtype=ACC)
    l = tl.zeros([KP, BM] if PREFIXES else [BM], dtype=ACC)
    u = tl.zeros([KP, BM] if PREFIXES else [BM], dtype=ACC)
    t_begin = pid_s * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)
    # the extensions' longer epilogue beside the next tile's prefetch spilled: not flattened
    # (nor the prefixes' segment loop)
    FLAT: tl.constexpr = (FILTER == FILTER_NONE) and not SIGMOID and not PREFIXES
    for t in tl.range(t_begin, t_end, flatten=FLAT):
        cols, col_ok, c_rows, tags, norm_cols, in0, n = _tile_setup(
            A, C0, C1, TAGS0, TAGS1, t, tiles0, n0, n1, B, d, BN
        )
        if PREFIXES:  # every segment reads the structural mask
            structural = structural_mask(rows, B, tags, col_ok)
        else:
            ic = tl.load(NORMS + norm_cols, mask=col_ok, other=0.0)
        own = ext_own(rows, cols, pos_offset, tl.where(in0, P, 0), FILTER, SIGMOID)
        gdrop = ext_guide(GA, tl.where(in0, GC0, GC1), GNORMS, THR, rows, cols, B, n, rows, norm_cols, row_ok, col_ok,
                          own, g, FILTER)  # fmt: skip
        # one main loop: the running accumulator at the end of segment k is prefix k's raw dot tile
        acc = tl.zeros([BM, BN], dtype=ACC)
        lo = 0
        for k in range(0, K):
            if PREFIXES:  # segment k, then prefix k's scales
                acc, lo, ia, ic = prefix_segment(
                    acc, lo, k, BOUNDS, NORMS, R, a_rows, c_rows, rows, 0, norm_cols, row_ok, col_ok, PRECISION, BK
                )
            else:  # the mask after the product: no mask tile lives through the main loop
                acc = dot_tile(acc, a_rows, c_rows, 0, d, ia, ic, PRECISION, SCALE_ON_LOAD, EVEN_K, BK)
                structural = structural_mask(rows, B, tags, col_ok)
            logits, keep = ext_logits(acc, ia, ic, inv_tau, structural, own, gdrop, POISON + k * R,
                                      THR + k * stride_thr, rows, norm_cols, rows, row_ok, col_ok, FILTER,
                                      SCALE_TILE)  # fmt: skip
            mk, lk, uk = reduce_tile(
                _prefix_state(m, k, PREFIXES), _prefix_state(l, k, PREFIXES), _prefix_state(u, k, PREFIXES),
                logits, keep, own, bias, SIGMOID,
            )  # fmt: skip
            m = _set_prefix_state(m, k, mk, PREFIXES)
            l = _set_prefix_state(l, k, lk, PREFIXES)
            u = _set_prefix_state(u, k, uk, PREFIXES)
    # partials [3, slots, K * B]
    if PREFIXES:
        prefix = tl.arange(0, KP)[:, None]
        out = PARTS + pid_s * K * B + prefix.to(tl.int64) * B + rows[None, :]
        ok = (prefix < K) & row_ok[None, :]
    else:
        out = PARTS + pid_s * B + rows
        ok = row_ok
    tl.store(out, m, mask=ok)
    tl.store(out + n_slots * K * B, l, mask=ok)
    tl.store(out + 2 * n_slots * K * B, u, mask=ok)


FWD = Kernel(_lse_fwd_kernel, "fwd")


@dataclass(frozen=True)
class FwdArgs(KernelArgs):
    """:func:`_lse_fwd_kernel`'s arguments (``kernels/lse.py``'s ``_sweep``): the call's
    extension and prefix groups, both blocks' guide rows and block 0's own positives
    (``pos_offset``, ``P``); ``SCALE_TILE`` is ``not SCALE_ON_LOAD``."""

    rows: RowArgs
    NORMS: Tensor
    TAU: Tensor
    PARTS: Tensor
    tiles0: int
    n_tiles: int
    tiles_per_split: int
    n_slots: int
    SCALE_ON_LOAD: bool
    EVEN_K: bool
    PRECISION: str
    ext: ExtArgs
    prefix: PrefixArgs
    GC0: Tensor | None = None
    GC1: Tensor | None = None
    pos_offset: int = 0
    P: int = 0

    def derived(self) -> dict:
        return dict(SCALE_TILE=not self.SCALE_ON_LOAD)
