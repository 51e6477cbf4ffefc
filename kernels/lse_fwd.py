"""Masked cosine-LSE forward: the norm pre-pass, the split LSE kernel and its combine.

The contract is ``fastcl/ops/contract.py``: anchors ``A [B, d]``, candidate blocks
``C0 [N0, d]``, ``C1 [N1, d]`` with int32 tags, ``l_ic = <a_i, c> * ia_i * ic_c / tau``
where ``ia, ic`` are inverse clamped norms (cosine) or row scales 1 / NaN (dot).

Pre-pass (both similarities): ``_row_norms_kernel`` writes per row, O(B + N) floats and no
normalised copy of any input: for cosine ``inv = 1 / max(|x|, eps)`` and ``rinv``
(``inv``, or 0 where the norm is clamped), scale-free (power-of-two rescaling of the sum
of squares); for dot similarity ``inv = 1``, or NaN for a row holding NaN/Inf, so that
such a row's logits are all NaN (a raw ``+-inf`` dot product could give a ``-inf`` logit,
which ``exp`` turns into a silent 0). NaN for a bad row in both cases. Padded candidate
rows (tag ``PAD``) read as zero.

Forward (never a B x N buffer): a ``_lse_fwd_kernel`` program owns ``BM`` anchor rows and
one contiguous *split* of a block's columns; it streams ``BN``-column tiles (a GEMM main
loop over ``d`` in ``BK`` chunks), applies the structural mask and keeps an online max /
sum / weighted logit sum. Splits (flash-decoding style) fill the device when ``B / BM``
alone would not; ``_lse_combine_kernel`` merges them in a fixed order.

Non-finite values: padded columns are never read; a NaN/Inf in a kept column makes its
rows' ``lse`` NaN (the combine tells an empty row, ``l == 0``, from a NaN one).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from fastcl.ops.contract import new_output

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
    dot_precision,
    dtype_class,
    dummy,
    launch,
    load_tags,
    online_lse,
    raw_dot_tile,
    register_op,
    sqrt_rn,
    structural_mask,
)


@triton.jit
def _pow2_floor(x):
    """The power of two with ``x``'s exponent (``x >= 0``; 0 for subnormals, Inf for Inf/NaN)."""
    if x.dtype == tl.float64:
        return (x.to(tl.int64, bitcast=True) & 0x7FF0000000000000).to(tl.float64, bitcast=True)
    else:
        return (x.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def rescale(scale, x, HI: tl.constexpr):
    """A row's power-of-two unit after its ``[BR, BD]`` chunk ``x`` (at least ``scale``, near
    the running max ``|x|``, at most ``HI``) and the chunk in that unit (exact: a power of two)."""
    new = tl.minimum(tl.maximum(scale, _pow2_floor(tl.max(tl.abs(x), 1))), HI)
    return new, x * (1.0 / new)[:, None]


@triton.jit
def _ssq_step(scale, ssq, x, HI: tl.constexpr):
    """Add a ``[BR, BD]`` chunk to the sum of squares ``ssq`` kept in units of ``scale^2``."""
    new = tl.minimum(tl.maximum(scale, _pow2_floor(tl.max(tl.abs(x), 1))), HI)
    ratio = scale / new  # written out, not through rescale(): that ordering spilled 16 B (sm_80/90)
    xs = x * (1.0 / new)[:, None]
    return new, ssq * ratio * ratio + tl.sum(xs * xs, 1)


@triton.jit
def _store_inverse_norms(INV, RINV, ok, norm, bad, eps):
    """``inv = 1 / max(norm, eps)`` and ``rinv`` (``inv``, 0 where clamped); NaN where ``bad``."""
    inv = tl.where(bad, float("nan"), 1.0 / tl.maximum(norm, eps))
    tl.store(INV, inv, mask=ok)
    tl.store(RINV, tl.where(norm > eps, inv, tl.where(bad, inv, 0.0)), mask=ok)


@triton.jit
def _row_norms_kernel(
    X, TAGS, INV, RINV, n_rows, d, eps, HAS_TAGS: tl.constexpr, NORMS: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr
):
    ACC: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < n_rows
    read = ok
    if HAS_TAGS:  # padded rows read as zero: their NaN/Inf cannot reach a norm
        read = ok & (tl.load(TAGS + rows, mask=ok, other=PAD_TAG) != PAD_TAG)
    x_rows = X + rows.to(tl.int64)[:, None] * d
    if NORMS:
        # |x| = scale * sqrt(ssq) with scale a power of two near the running max |x_k| (clamped
        # to [LO, HI] so that 1/scale is a normal number): squares neither overflow nor
        # underflow, and multiplying by 1/scale is exact
        LO: tl.constexpr = SCALE_LO_F64 if ACC == tl.float64 else SCALE_LO_F32
        HI: tl.constexpr = SCALE_HI_F64 if ACC == tl.float64 else SCALE_HI_F32
        scale = tl.full([BR], LO, dtype=ACC)
        ssq = tl.zeros([BR], dtype=ACC)
        for k0 in range(0, d, BD):
            ks = k0 + tl.arange(0, BD)
            x = tl.load(x_rows + ks[None, :], mask=read[:, None] & (ks < d)[None, :], other=0.0).to(ACC)
            scale, ssq = _ssq_step(scale, ssq, x, HI)
        norm = scale * sqrt_rn(ssq)
        # only a NaN or Inf entry makes the norm NaN or Inf (tl.max may skip a NaN): keep NaN
        bad = (norm != norm) | (norm == float("inf"))
        _store_inverse_norms(INV + rows, RINV + rows, ok, norm, bad, eps)
    else:
        # dot similarity: a row scale of 1 for a finite row, NaN for a row holding NaN or Inf
        # (|x| < inf is false exactly there); the tile kernels multiply rows by it, so every
        # logit of a non-finite row is NaN and no -inf logit can vanish as exp(-inf) = 0
        n_bad = tl.zeros([BR], dtype=tl.int32)
        for k0 in range(0, d, BD):
            ks = k0 + tl.arange(0, BD)
            x = tl.load(x_rows + ks[None, :], mask=read[:, None] & (ks < d)[None, :], other=0.0)
            n_bad += tl.sum(tl.where(tl.abs(x) < float("inf"), 0, 1), 1)
        inv = tl.where(n_bad > 0, float("nan"), tl.full([BR], 1.0, dtype=ACC))
        tl.store(INV + rows, inv, mask=ok)
        tl.store(RINV + rows, inv, mask=ok)  # unused by dot similarity; written so no slot is stale


@triton.jit
def _logits(s, rows, cols, row_ok, col_ok, IA, IC, inv_tau, SCALE_TILE: tl.constexpr):
    """Raw dot tile -> logits: scaled by the inverse norms (``SCALE_TILE``) and 1/tau."""
    if SCALE_TILE:
        ia = tl.load(IA + rows, mask=row_ok, other=0.0)
        ic = tl.load(IC + cols, mask=col_ok, other=0.0)
        return s * (ia * inv_tau)[:, None] * ic[None, :]
    else:
        return s * inv_tau


@triton.jit
def _lse_fwd_kernel(
    A,
    C,
    TAGS,
    IA,
    IC,
    TAU,
    PARTS,
    B,
    NC,
    d,
    split_width,
    split_base,
    n_slots,
    SCALE_TILE: tl.constexpr,
    SCALE_ON_LOAD: tl.constexpr,
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
    m = tl.full([BM], float("-inf"), dtype=ACC)
    l = tl.zeros([BM], dtype=ACC)
    u = tl.zeros([BM], dtype=ACC)
    c_begin = pid_s * split_width
    c_end = tl.minimum(c_begin + split_width, NC)
    for c0 in range(c_begin, c_end, BN):
        cols = c0 + tl.arange(0, BN)
        col_ok = cols < c_end
        tags = load_tags(TAGS, cols, col_ok)
        s = raw_dot_tile(
            A,
            C,
            IA,
            IC,
            rows,
            cols,
            row_ok,
            col_ok & (tags != PAD_TAG),
            d,
            d,
            d,
            BM,
            BN,
            BK,
            ACC,
            PRECISION,
            SCALE_ON_LOAD,
        )
        logits = _logits(s, rows, cols, row_ok, col_ok, IA, IC, inv_tau, SCALE_TILE)
        m, l, u = online_lse(m, l, u, logits, structural_mask(rows, B, tags, col_ok))
    slot = split_base + pid_s
    tl.store(PARTS + slot * B + rows, m, mask=row_ok)
    tl.store(PARTS + (n_slots + slot) * B + rows, l, mask=row_ok)
    tl.store(PARTS + (2 * n_slots + slot) * B + rows, u, mask=row_ok)


@triton.jit
def _lse_combine_kernel(PARTS, LSE, MEAN_LOGIT, B, n_slots, BR: tl.constexpr):
    ACC: tl.constexpr = PARTS.dtype.element_ty
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < B
    m = tl.full([BR], float("-inf"), dtype=ACC)
    for s in range(0, n_slots):
        m = tl.maximum(m, tl.load(PARTS + s * B + rows, mask=ok, other=float("-inf")))
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BR], dtype=ACC)
    u = tl.zeros([BR], dtype=ACC)
    for s in range(0, n_slots):
        w = tl.exp(tl.load(PARTS + s * B + rows, mask=ok, other=float("-inf")) - m_ref)
        l += w * tl.load(PARTS + (n_slots + s) * B + rows, mask=ok, other=0.0)
        u += w * tl.load(PARTS + (2 * n_slots + s) * B + rows, mask=ok, other=0.0)
    # an empty row has l == 0 exactly (-inf and 0, without log(0) or 0/0); a NaN l is a
    # row that saw a NaN or Inf and must stay NaN
    empty = l == 0
    l_safe = tl.where(empty, 1.0, l)
    tl.store(LSE + rows, tl.where(empty, float("-inf"), m_ref + tl.log(l_safe)), mask=ok)
    tl.store(MEAN_LOGIT + rows, tl.where(empty, 0.0, u / l_safe), mask=ok)


ROW_NORMS = Kernel(_row_norms_kernel, plan.ROWWISE, dtype_arg="X")
FWD = Kernel(_lse_fwd_kernel, plan.TILES, dtype_arg="A")
COMBINE = Kernel(_lse_combine_kernel, plan.REDUCE, dtype_arg="PARTS")


def _check_layout(tensors) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("triton LSE kernels need contiguous inputs")


def norm_views(norms: Tensor, B: int, sizes: tuple[int, int]):
    """``(inv, rinv)`` views of the norms buffer for anchors and each block."""
    bounds = [0, B, B + sizes[0], B + sizes[0] + sizes[1]]
    return [(norms[0, a:b], norms[1, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def prepare(anchor: Tensor, blocks, tags, tau: Tensor, cosine: bool, eps: float, norms: Tensor, arch: str):
    """Check layouts, convert tau, compute the row scales; shared by forward and backward."""
    _check_layout((anchor, *blocks, *tags))
    tau = tau.to(acc_dtype(anchor.dtype)).reshape(1)
    B = anchor.shape[0]
    sizes = (blocks[0].shape[0], blocks[1].shape[0])
    views = norm_views(norms, B, sizes)
    # both similarities: cosine needs the inverse norms; dot needs the row scales 1 / NaN
    # that make every logit of a row holding NaN/Inf NaN (docs/losses.md, non-finite inputs)
    for x, tg, (inv, rinv) in zip((anchor, *blocks), (None, *tags), views):
        n, d = x.shape
        if n == 0:
            continue
        grid = lambda meta, n=n: (triton.cdiv(n, meta["BR"]),)  # noqa: E731
        launch(
            ROW_NORMS,
            grid,
            arch,
            X=x,
            TAGS=tg if tg is not None else dummy(x.device),
            INV=inv,
            RINV=rinv,
            n_rows=n,
            d=d,
            eps=float(eps),
            HAS_TAGS=tg is not None,
            NORMS=cosine,
        )
    return tau, sizes, views


def _lse_forward(
    anchor: Tensor, block0: Tensor, block1: Tensor, tags0: Tensor, tags1: Tensor, tau: Tensor, cosine: bool, eps: float
) -> tuple[Tensor, Tensor]:
    dev, dt = anchor.device, anchor.dtype
    B, d = anchor.shape
    acc = acc_dtype(dt)
    arch = arch_of(dev)
    lse = new_output(B, dtype=acc, device=dev)
    mean_logit = new_output(B, dtype=acc, device=dev)
    if B == 0:
        return lse, mean_logit
    sizes = (block0.shape[0], block1.shape[0])
    sms = plan.num_sms(dev, arch)
    ws = plan.forward_plan(B, sizes, dt, cosine, arch, sms).allocate(dev)
    tau, sizes, views = prepare(anchor, (block0, block1), (tags0, tags1), tau, cosine, eps, ws["norms"], arch)
    ia = views[0][0]
    splits = plan.forward_splits(B, sizes, arch, dtype_class(dt), sms)
    n_slots = sum(s for s, _ in splits)
    on_load = plan.scale_on_load(dt)
    base = 0
    for blk, tg, (ic, _), (n_split, width) in zip((block0, block1), (tags0, tags1), views[1:], splits):
        if n_split == 0:
            continue
        grid = lambda meta, s=n_split: (triton.cdiv(B, meta["BM"]), s)  # noqa: E731
        launch(
            FWD,
            grid,
            arch,
            tune=(B, sum(sizes), d),
            A=anchor,
            C=blk,
            TAGS=tg,
            IA=ia,
            IC=ic,
            TAU=tau,
            PARTS=ws["parts"],
            B=B,
            NC=blk.shape[0],
            d=d,
            split_width=width,
            split_base=base,
            n_slots=n_slots,
            SCALE_TILE=not on_load,
            SCALE_ON_LOAD=on_load,
            PRECISION=dot_precision(dt),
        )
        base += n_split
    grid = lambda meta: (triton.cdiv(B, meta["BR"]),)  # noqa: E731
    launch(COMBINE, grid, arch, PARTS=ws["parts"], LSE=lse, MEAN_LOGIT=mean_logit, B=B, n_slots=n_slots)
    return lse, mean_logit


lse_forward = register_op("fastcl_triton::lse_forward", _lse_forward)
