"""Combine the forward's split partials and, fused with it, the loss head.

``_head_kernel``: a program owns ``BR`` rows (anchors, or prefix-anchor rows ``k * B + i``
with Matryoshka dims) and

1. merges the ``[3, slots, rows]`` partials (max, sum, weighted logit sum) of the forward
   sweep in a fixed order into ``lse`` and the softmax-weighted mean logit (an empty row has
   ``l == 0`` exactly: ``lse = -inf``, mean 0; a NaN row stays NaN);
2. with ``HEAD`` on, the loss head of ``fastcl/ops/head.py`` (same formulas, docs/design.md
   "The loss head"): the own-positive logits (``FOLDED``: the anchor's ``P`` positives are
   rows ``pos_offset + i * P + k`` of block 0, dotted with the anchor here using the
   pre-pass's row scales, the same numbers as the logit tiles; else given as ``POS_IN``), the
   per-row loss, ``dloss/dlse``, ``dloss/dpos`` and ``w_row = dlse * mean_logit + sum_k dpos_k
   * l_k`` (the temperature's gradient is ``-sum_i s_i * w_row_i / tau``), and the block's
   reduction weighted by ``WEIGHTS``.

``_sum_kernel`` adds the programs' partial losses in order in one program and writes the
scalar in the output dtype: the reduced loss is deterministic.

Together they replace the combine kernel, the own-logits kernel and ~20 small PyTorch ops
(launches on a GPU) of the head.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from ._common import Kernel, KernelArgs, cast_to, log1p

KIND_CROSS_ENTROPY = 0
KIND_SOFTPLUS = 1
KINDS = {"cross_entropy": KIND_CROSS_ENTROPY, "softplus": KIND_SOFTPLUS}
# own positives per anchor the fused head takes (a [BR, MAX_OWN] register tile); more take
# the PyTorch head
MAX_OWN = 64


@triton.jit
def _logaddexp(a, b):
    """``log(exp(a) + exp(b))``: ``-inf`` for two ``-inf``, NaN for a NaN."""
    mx = tl.maximum(a, b)
    ref = tl.where(mx == float("-inf"), 0.0, mx)
    return ref + tl.log(tl.exp(a - ref) + tl.exp(b - ref))


@triton.jit
def _own_logits(A, C0, NORMS, POISON, rows, row_ok, valid, kk, P, d, B, pos_offset, inv_tau, ia,
                POISONED: tl.constexpr, SCALE_ON_LOAD: tl.constexpr, PP: tl.constexpr, BR: tl.constexpr,
                BD: tl.constexpr):  # fmt: skip
    """``[BR, PP]`` logits of each row with its own positives (0 in invalid slots). ``POISONED``
    (a filtered problem: ``A``, ``C0`` hold its inputs with non-finite rows read as zeros): the
    rows' poison is added, as to every logit of the tiles."""
    ACC: tl.constexpr = tl.float64 if A.dtype.element_ty == tl.float64 else tl.float32
    a_rows = A + rows.to(tl.int64)[:, None] * d
    first = pos_offset + rows.to(tl.int64) * P  # block-0 row of each anchor's first positive
    dots = tl.zeros([BR, PP], dtype=ACC)
    for k0 in range(0, d, BD):
        ks = k0 + tl.arange(0, BD)
        in_d = (ks < d)[None, :]
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & in_d, other=0.0).to(ACC)
        if SCALE_ON_LOAD:
            a = a * ia[:, None]
        for j in range(0, P):
            ok_j = tl.sum(tl.where(kk == j, valid, 0), 1) > 0
            c = tl.load(C0 + (first + j)[:, None] * d + ks[None, :], mask=ok_j[:, None] & in_d, other=0.0).to(ACC)
            if SCALE_ON_LOAD:
                c = c * tl.load(NORMS + B + first + j, mask=ok_j, other=0.0)[:, None]
            dots += tl.where(kk == j, tl.sum(a * c, 1)[:, None], 0.0)
    if not SCALE_ON_LOAD:
        slot = (first[:, None] + kk).to(tl.int64)
        ic = tl.load(NORMS + B + slot, mask=valid != 0, other=0.0)
        dots = dots * ia[:, None] * ic
    if POISONED:
        slot = (first[:, None] + kk).to(tl.int64)
        poison = tl.load(POISON + rows, mask=row_ok, other=0.0)[:, None]
        dots += poison + tl.load(POISON + B + slot, mask=valid != 0, other=0.0)
    return tl.where(valid != 0, dots * inv_tau, 0.0)


@triton.jit
def _head_kernel(
    PARTS,
    A,
    C0,
    NORMS,
    POISON,
    TAU,
    POS_IN,
    MASK,
    LOG_EXTRA,
    WEIGHTS,
    LSE,
    MEAN,
    DLSE,
    DPOS,
    WROW,
    ROWS,
    PARTIAL,
    n_rows,
    n_slots,
    B,
    d,
    P,
    pos_offset,
    HEAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    POISONED: tl.constexpr,
    KIND: tl.constexpr,
    FOLDED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    ROWS_OUT: tl.constexpr,
    SCALE_ON_LOAD: tl.constexpr,
    PP: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
):
    ACC: tl.constexpr = PARTS.dtype.element_ty
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    ok = rows < n_rows
    if SIGMOID:  # the sigmoid reduction's partial row sums add (no head: its loss is the value)
        v = tl.zeros([BR], dtype=ACC)
        s0 = tl.zeros([BR], dtype=ACC)
        s1 = tl.zeros([BR], dtype=ACC)
        for s in range(0, n_slots):
            v += tl.load(PARTS + s * n_rows + rows, mask=ok, other=0.0)
            s0 += tl.load(PARTS + (n_slots + s) * n_rows + rows, mask=ok, other=0.0)
            s1 += tl.load(PARTS + (2 * n_slots + s) * n_rows + rows, mask=ok, other=0.0)
        tl.store(LSE + rows, v, mask=ok)
        tl.store(MEAN + rows, s0, mask=ok)
        tl.store(MEAN + n_rows + rows, s1, mask=ok)
    else:
        # 1. combine the splits in a fixed order
        m = tl.full([BR], float("-inf"), dtype=ACC)
        for s in range(0, n_slots):
            m = tl.maximum(m, tl.load(PARTS + s * n_rows + rows, mask=ok, other=float("-inf")))
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        l = tl.zeros([BR], dtype=ACC)
        u = tl.zeros([BR], dtype=ACC)
        for s in range(0, n_slots):
            w = tl.exp(tl.load(PARTS + s * n_rows + rows, mask=ok, other=float("-inf")) - m_ref)
            l += w * tl.load(PARTS + (n_slots + s) * n_rows + rows, mask=ok, other=0.0)
            u += w * tl.load(PARTS + (2 * n_slots + s) * n_rows + rows, mask=ok, other=0.0)
        empty = l == 0
        l_safe = tl.where(empty, 1.0, l)
        lse = tl.where(empty, float("-inf"), m_ref + tl.log(l_safe))
        mean = tl.where(empty, 0.0, u / l_safe)
        tl.store(LSE + rows, lse, mask=ok)
        if not HEAD:
            tl.store(MEAN + rows, mean, mask=ok)
        else:
            # 2. the loss head of fastcl/ops/head.py on these rows
            kk = tl.arange(0, PP)[None, :]
            valid = ok[:, None] & (kk < P)
            if HAS_MASK:
                valid = valid & (tl.load(MASK + rows.to(tl.int64)[:, None] * P + kk, mask=valid, other=0) != 0)
            valid = valid.to(tl.int32)
            inv_tau = 1.0 / tl.load(TAU)
            if FOLDED:
                ia = tl.load(NORMS + rows, mask=ok, other=0.0)
                # (the poison's loads beside a full chunk spilled 8 B in fp64: half chunks there)
                BDP: tl.constexpr = BD // 2 if POISONED and ACC == tl.float64 else BD
                pos = _own_logits(A, C0, NORMS, POISON, rows, ok, valid, kk, P, d, B, pos_offset, inv_tau, ia, POISONED,
                                  SCALE_ON_LOAD, PP, BR, BDP)  # fmt: skip
            else:
                pos = tl.load(POS_IN + rows.to(tl.int64)[:, None] * P + kk, mask=valid != 0, other=0.0).to(ACC)
            count = tl.sum(valid, 1).to(ACC)
            inv_count = 1.0 / tl.maximum(count, 1.0)
            r = lse
            if HAS_EXTRA:
                r = _logaddexp(lse, tl.load(LOG_EXTRA + rows, mask=ok, other=float("-inf")))
            x = r[:, None] - pos
            if KIND == 0:  # cross_entropy: phi(x) = x
                phi = x
                dphi = tl.full([BR, PP], 1.0, dtype=ACC)
            else:  # softplus (SupMPN), exact for every x
                phi = tl.maximum(x, 0.0) + log1p(tl.exp(-tl.abs(x)))
                dphi = 1.0 / (1.0 + tl.exp(-x))
            phi = tl.where(valid != 0, phi, 0.0)
            dphi = tl.where(valid != 0, dphi, 0.0)
            loss = tl.sum(phi, 1) * inv_count
            dlse = tl.sum(dphi, 1) * inv_count
            if HAS_EXTRA:  # d logaddexp(lse, c) / d lse = exp(lse - r): none for an empty row (r = -inf); NaN stays NaN
                dlse = dlse * tl.where(r == float("-inf"), 0.0, tl.exp(lse - r))
            dpos = -dphi * inv_count[:, None]
            w_row = dlse * mean
            if FOLDED:
                w_row += tl.sum(dpos * pos, 1)
            tl.store(DLSE + rows, dlse, mask=ok)
            tl.store(DPOS + rows.to(tl.int64)[:, None] * P + kk, dpos, mask=ok[:, None] & (kk < P))
            tl.store(WROW + rows, w_row, mask=ok)
            if ROWS_OUT:
                tl.store(ROWS + rows, loss, mask=ok)
            weights = tl.load(WEIGHTS + rows, mask=ok, other=0.0).to(ACC)
            tl.store(PARTIAL + pid, tl.sum(tl.where(ok, loss * weights, 0.0), 0))


@triton.jit
def _sum_kernel(PARTIAL, OUT, n, BR: tl.constexpr, BD: tl.constexpr):
    ACC: tl.constexpr = PARTIAL.dtype.element_ty
    acc = tl.zeros([BR], dtype=ACC)
    for i in range(0, n, BR):
        j = i + tl.arange(0, BR)
        acc += tl.load(PARTIAL + j, mask=j < n, other=0.0)
    tl.store(OUT, cast_to(tl.sum(acc, 0), OUT.dtype.element_ty))


HEAD = Kernel(_head_kernel, "head")
SUM = Kernel(_sum_kernel, "rows")


@dataclass(frozen=True)
class HeadArgs(KernelArgs):
    """:func:`_head_kernel`'s arguments (``kernels/lse.py`` fills them): the combine of the
    forward's partials, and with ``HEAD`` the loss head. ``HAS_MASK``, ``HAS_EXTRA``,
    ``ROWS_OUT`` follow from the pointers given and ``PP`` (the positives' register tile)
    from ``P``."""

    PARTS: Tensor
    A: Tensor
    C0: Tensor
    TAU: Tensor
    LSE: Tensor
    n_rows: int
    n_slots: int
    B: int
    d: int
    MEAN: Tensor | None = None
    NORMS: Tensor | None = None
    POISON: Tensor | None = None
    POS_IN: Tensor | None = None
    MASK: Tensor | None = None
    LOG_EXTRA: Tensor | None = None
    WEIGHTS: Tensor | None = None
    DLSE: Tensor | None = None
    DPOS: Tensor | None = None
    WROW: Tensor | None = None
    ROWS: Tensor | None = None
    PARTIAL: Tensor | None = None
    P: int = 0
    pos_offset: int = 0
    HEAD: bool = False
    SIGMOID: bool = False
    POISONED: bool = False
    KIND: int = 0
    FOLDED: bool = False
    SCALE_ON_LOAD: bool = False

    def derived(self) -> dict:
        has = dict(HAS_MASK=self.MASK is not None, HAS_EXTRA=self.LOG_EXTRA is not None, ROWS_OUT=self.ROWS is not None)
        return dict(has, PP=max(16, 1 << (self.P - 1).bit_length()))
