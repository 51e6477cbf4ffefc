"""Masked cosine-LSE backward: recompute the logit tiles from ``lse``, two GEMMs on dS chunks.

The gradient of a logit is ``G_ic = g_i * softmax_ic``. With ``d`` up to 1024 a row of
``d anchor`` does not fit in registers beside a logit tile (a [64, 768] fp32 accumulator
alone is 192 KB, most of an SM's register file), so the two products with ``G`` run as
GEMMs on a bounded *chunk* of recomputed ``dS`` instead; for each chunk of ``R`` columns
of one block (``B x R`` elements, default <= 32 MiB)::

    _lse_ds_kernel   recompute the logit tiles, dS = G * ia * ic / tau (or G / tau),
                     plus partial sums of G * l per row and per column (radial terms)
    _sum_parts       row sums accumulate over chunks (fixed order)
    _mm  dC[chunk] = dS^T @ A  - ic^2 <G, l>_col * C[chunk]         (complete, K = B)
    _mm  dA       += dS @ C[chunk]; last chunk: - ia^2 <G, l>_row * A

Four GEMM-sized passes in all (forward, recompute, two products), the ``8 B N d`` FLOPs
of the contract, every product on tensor cores. Deterministic: each output element has
one owner, reductions run in a fixed order, no atomics. Extra memory: ``plan.backward_plan``.

Norms: bf16 folds ``ia * ic`` into dS; fp16 (whose range ``ia * ic / tau`` can leave) and
fp32/fp64 (where ``ia * ic`` underflows for rows of norm ~1e30) keep ``G / tau`` in dS and
let the GEMMs normalise their ``Y`` operand on load (``plan.fold_norms``).
Dot similarity recomputes its logit tiles with the row scales 1 / NaN of the pre-pass
(``lse_fwd``), as the forward does; the GEMMs then take raw rows (a NaN logit already made
its dS entries NaN).

Padding: padded candidates are never read and get exactly zero gradient, whatever they hold.
Offsets: the logit-tile kernels use 64-bit row offsets (any block size); the GEMM uses
32-bit ones, so chunks stay under 2**31 elements and larger anchor blocks are refused
(``plan.size_reasons``, also in the backend's ``unsupported``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from fastcl.ops.contract import new_output

from . import plan
from ._common import (
    PAD_TAG,
    Kernel,
    acc_dtype,
    arch_of,
    cast_to,
    dot_precision,
    dtype_class,
    dummy,
    launch,
    load_tags,
    raw_dot_tile,
    register_op,
    structural_mask,
)
from .lse_fwd import _logits, prepare
from .matmul import MM


@triton.jit
def _lse_ds_kernel(
    A,
    C,
    TAGS,
    IA,
    IC,
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
    stride_ds,
    stride_roww,
    stride_colw,
    n_row_parts,
    n_col_parts,
    pos_offset,
    pos_count,
    COSINE: tl.constexpr,
    SCALE_TILE: tl.constexpr,
    SCALE_ON_LOAD: tl.constexpr,
    FOLD_NORMS: tl.constexpr,
    FOLD_POS: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PART: tl.constexpr,
):
    ACC: tl.constexpr = tl.float64 if A.dtype.element_ty == tl.float64 else tl.float32
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < B
    col_ok = cols < NC
    inv_tau = 1.0 / tl.load(TAU)
    tags = load_tags(TAGS, cols, col_ok)
    s = raw_dot_tile(
        A, C, IA, IC, rows, cols, row_ok, col_ok & (tags != PAD_TAG), d, d, d, BM, BN, BK, ACC, PRECISION, SCALE_ON_LOAD
    )
    logits = _logits(s, rows, cols, row_ok, col_ok, IA, IC, inv_tau, SCALE_TILE)
    keep = structural_mask(rows, B, tags, col_ok)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    g = tl.load(G + rows, mask=row_ok, other=0.0)
    grad = tl.where(keep, tl.exp(logits - lse[:, None]) * g[:, None], 0.0)  # dLoss/dlogit
    if FOLD_POS:
        # the own-positive logits' gradient d_pos [B, P] (contract: OwnPositives): column c
        # is positive k = c - pos_offset - row * P of its row; added to the float32 dS
        # before any rounding, whatever the tag (as the torch backend's _fold_positives)
        row_start = rows.to(tl.int64)[:, None] * pos_count
        k = cols[None, :] - pos_offset - row_start
        is_pos = (k >= 0) & (k < pos_count) & row_ok[:, None] & col_ok[None, :]
        grad += tl.load(DPOS + row_start + k, mask=is_pos, other=0.0)
    if COSINE:
        # <G, l> per row and per column, for the radial part of the normalisation
        # backward; stored per PART-wide group so the layout does not depend on BM/BN
        gl = grad * logits  # padded and out-of-range columns: logits 0 (never read), grad 0
        row_sums = tl.sum(tl.reshape(gl, [BM, BN // PART, PART]), 2)
        col_groups = pid_n * (BN // PART) + tl.arange(0, BN // PART)
        tl.store(
            ROWW + col_groups.to(tl.int64)[None, :] * stride_roww + rows[:, None],
            row_sums,
            mask=row_ok[:, None] & (col_groups < n_col_parts)[None, :],
        )
        col_sums = tl.sum(tl.reshape(gl, [BM // PART, PART, BN]), 1)
        row_groups = pid_m * (BM // PART) + tl.arange(0, BM // PART)
        tl.store(
            COLW + row_groups.to(tl.int64)[:, None] * stride_colw + cols[None, :],
            col_sums,
            mask=(row_groups < n_row_parts)[:, None] & col_ok[None, :],
        )
    ds = grad * inv_tau
    if FOLD_NORMS:
        ia = tl.load(IA + rows, mask=row_ok, other=0.0)
        ic = tl.load(IC + cols, mask=col_ok, other=0.0)
        ds = ds * ia[:, None] * ic[None, :]
    tl.store(
        DS + rows.to(tl.int64)[:, None] * stride_ds + cols[None, :],
        cast_to(ds, DS.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _sum_parts_kernel(PARTS, OUT, n, n_parts, stride_p, ACCUMULATE: tl.constexpr, BR: tl.constexpr):
    j = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = j < n
    if ACCUMULATE:
        acc = tl.load(OUT + j, mask=ok, other=0.0)
    else:
        acc = tl.zeros([BR], dtype=OUT.dtype.element_ty)
    for p in range(0, n_parts):
        acc += tl.load(PARTS + p * stride_p + j, mask=ok, other=0.0)
    tl.store(OUT + j, acc, mask=ok)


DS = Kernel(_lse_ds_kernel, plan.DS_TILES, dtype_arg="A")
SUM_PARTS = Kernel(_sum_parts_kernel, plan.REDUCE, dtype_arg="OUT")


def _lse_backward(
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
    cosine: bool,
    eps: float,
    fp32_ds: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``d anchor, d block0, d block1`` (input dtype) from ``g = dLoss/dlse [B]``.

    ``d_pos [B, P]`` (or None): gradient of the own-positive logits, anchor ``i``'s positive
    ``k`` being row ``pos_offset + i * P + k`` of block 0; folded into dS (float32).
    """
    dev, dt = anchor.device, anchor.dtype
    B, d = anchor.shape
    acc = acc_dtype(dt)
    arch = arch_of(dev)
    blocks, tags = (block0, block1), (tags0, tags1)
    d_anchor = new_output((B, d), dtype=dt, device=dev)
    d_blocks = tuple(new_output(b.shape, dtype=dt, device=dev) for b in blocks)
    sizes = (block0.shape[0], block1.shape[0])
    too_big = plan.size_reasons(B, d)
    if too_big:
        raise ValueError(f"triton LSE backward: {too_big[0]}")
    width = plan.chunk_width(B, sizes, d, dt, arch, fp32_ds)
    chunks = [(i, c0, min(c0 + width, n)) for i, n in enumerate(sizes) for c0 in range(0, n, width)]
    if B == 0 or not chunks:  # no anchor or no candidate: every gradient is zero
        for t in (d_anchor, *d_blocks):
            t.zero_()
        return (d_anchor, *d_blocks)
    ws = plan.backward_plan(B, sizes, d, dt, cosine, arch, fp32_ds).allocate(dev)
    tau, sizes, views = prepare(anchor, blocks, tags, tau, cosine, eps, ws["norms"], arch)
    lse, g = lse.to(acc).contiguous(), g.to(acc).contiguous()
    pos_count = 0 if d_pos is None else d_pos.shape[1]
    dpos = d_pos.to(acc).contiguous() if pos_count else None
    part = plan.partial_width(arch, dtype_class(dt))
    fold = plan.fold_norms(dt, cosine)
    on_load = plan.scale_on_load(dt)
    on_load_mm = cosine and not fold  # the GEMMs normalise Y's rows and scale output rows
    none = dummy(dev)
    ia, ra = views[0]  # row scales: inverse norms (cosine) or 1 / NaN (dot)
    ds = ws["ds"]
    row_parts, col_parts = ws.get("row_parts", none), ws.get("col_parts", none)
    row_w = ws.get("row_w", none)
    acc_buf = ws.get("d_anchor_acc", none)
    precision = dot_precision(dt)
    for idx, (bi, c0, c1) in enumerate(chunks):
        first, last = idx == 0, idx == len(chunks) - 1
        nc = c1 - c0
        blk, tg, d_blk = blocks[bi][c0:c1], tags[bi][c0:c1], d_blocks[bi][c0:c1]
        ic, rc = views[bi + 1][0][c0:c1], views[bi + 1][1][c0:c1]
        n_row_parts, n_col_parts = plan.cdiv(B, part), plan.cdiv(nc, part)

        # does this chunk of block 0 hold rows pos_offset .. pos_offset + B * P - 1?
        fold_pos = bi == 0 and pos_count > 0 and c0 < pos_offset + B * pos_count and pos_offset < c1
        grid = lambda meta, nc=nc: (triton.cdiv(B, meta["BM"]), triton.cdiv(nc, meta["BN"]))  # noqa: E731
        launch(
            DS,
            grid,
            arch,
            tune=(B, width, d),
            A=anchor,
            C=blk,
            TAGS=tg,
            IA=ia,
            IC=ic,
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
            stride_ds=width,
            stride_roww=B,
            stride_colw=width,
            n_row_parts=n_row_parts,
            n_col_parts=n_col_parts,
            pos_offset=pos_offset - c0 if fold_pos else 0,
            pos_count=pos_count if fold_pos else 0,
            COSINE=cosine,
            SCALE_TILE=not on_load,
            SCALE_ON_LOAD=on_load,
            FOLD_NORMS=fold,
            FOLD_POS=fold_pos,
            PRECISION=precision,
        )
        if cosine:
            grid = lambda meta: (triton.cdiv(B, meta["BR"]),)  # noqa: E731
            launch(
                SUM_PARTS,
                grid,
                arch,
                PARTS=row_parts,
                OUT=row_w,
                n=B,
                n_parts=n_col_parts,
                stride_p=B,
                ACCUMULATE=not first,
            )

        # d candidates of this chunk: dS^T @ A (dS read transposed through its strides)
        gradient_gemm(
            arch, ds, anchor, d_blk, tg, x_transposed=True, pad_out_rows=True, precision=precision,
            KSCALE=ia if on_load_mm else none, MSCALE=ic if on_load_mm else none, on_load=on_load_mm,
            RINV=rc if cosine else none, RADW=col_parts, Z=blk if cosine else none,
            n_parts=n_row_parts, stride_radw=width, radial=cosine,
        )  # fmt: skip
        # d anchor: accumulate dS @ C[chunk] over chunks in fixed order
        radial = cosine and last
        gradient_gemm(
            arch, ds, blk, d_anchor if last else acc_buf, tg, x_transposed=False, pad_out_rows=False,
            precision=precision, ACC_IN=None if first else acc_buf,
            KSCALE=ic if on_load_mm else none, MSCALE=ia if on_load_mm else none, on_load=on_load_mm,
            RINV=ra if radial else none, RADW=row_w if radial else none, Z=anchor if radial else none,
            n_parts=1, stride_radw=B, radial=radial,
        )  # fmt: skip
    return (d_anchor, *d_blocks)


def gradient_gemm(
    arch, X, Y, OUT, tags, *, x_transposed, pad_out_rows, precision, ACC_IN=None, KSCALE, MSCALE, on_load=False,
    RINV, RADW, Z, n_parts, stride_radw, radial,
):  # fmt: skip
    """One backward product ``OUT = X @ Y`` on the MM kernel (kernels/matmul.py), for the plain
    and the Matryoshka launchers: ``X`` is a dS chunk ``[B, width]``, read transposed through
    its strides for the candidates' gradient; ``pad_out_rows``: ``tags`` mark padded rows of
    ``OUT`` (candidates' gradient) instead of ``Y``'s (anchors'); ``ACC_IN`` is added."""
    (M, N), K, sx = OUT.shape, Y.shape[0], X.stride()
    launch(
        MM,
        lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),),
        arch,
        tune=(M, N, X.shape[0] if x_transposed else X.shape[1]),  # the chunk's width, not its fill
        X=X, Y=Y, OUT=OUT, ACC_IN=dummy(X.device) if ACC_IN is None else ACC_IN,
        KSCALE=KSCALE, MSCALE=MSCALE, RINV=RINV, RADW=RADW, Z=Z, TAGS=tags,
        M=M, N=N, K=K,
        stride_xm=sx[1] if x_transposed else sx[0], stride_xk=sx[0] if x_transposed else sx[1],
        stride_yk=Y.stride(0), stride_yn=1, stride_om=OUT.stride(0),
        n_parts=n_parts, stride_radw=stride_radw,
        SPLIT_X=X.dtype != Y.dtype, Y_KSCALE=on_load, M_SCALE=on_load, ACCUMULATE=ACC_IN is not None,
        RADIAL=radial, PAD_K=not pad_out_rows, PAD_M=pad_out_rows, PRECISION=precision,
    )  # fmt: skip


lse_backward = register_op("fastcl_triton::lse_backward", _lse_backward)
