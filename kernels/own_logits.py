"""Own-positive logits ``l_ik = s(a_i, c_{offset + i P + k}) / tau`` ``[B, P]`` in one launch.

The recompute strategy's head needs each anchor's logits with its own ``P`` positives. In
PyTorch ops that is a normalised ``[rows, P, d]`` float32 copy per block of rows and ~18
small ops per block (``fastcl/ops/positive_logits.py``); on a GPU each op is a launch.
Here a program owns ``BR`` anchors and one positive slot ``k`` and streams ``d`` once:
O(B P d) reads, no copy of any input.

Same values as the PyTorch path (``own_positive_similarities``), by the same rules
(docs/losses.md): norms from power-of-two-scaled sums of squares (no overflow, no
underflow, like ``_row_norms_kernel``), clamped at ``eps``; a masked positive reads as a
zero row; a row holding NaN or Inf makes its logits NaN (also with a masked partner, as
``0 * NaN`` does in PyTorch). Dot similarity: the raw dot product, NaN for such rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastcl.ops.contract import new_output

from . import plan
from ._common import (
    SCALE_HI_F32,
    SCALE_HI_F64,
    SCALE_LO_F32,
    SCALE_LO_F64,
    Kernel,
    acc_dtype,
    arch_of,
    dummy,
    launch,
    register_op,
    sqrt_rn,
)
from .lse_fwd import rescale


@triton.jit
def _own_logits_kernel(
    A,
    C,
    MASK,
    TAU,
    OUT,
    B,
    P,
    d,
    pos_offset,
    eps,
    HAS_MASK: tl.constexpr,
    COSINE: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
):
    ACC: tl.constexpr = tl.float64 if A.dtype.element_ty == tl.float64 else tl.float32
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    k = tl.program_id(1)
    ok = rows < B
    keep = ok
    if HAS_MASK:
        keep = ok & (tl.load(MASK + rows.to(tl.int64) * P + k, mask=ok, other=0) != 0)
    a_rows = A + rows.to(tl.int64)[:, None] * d
    c_rows = C + (pos_offset + rows.to(tl.int64) * P + k)[:, None] * d
    LO: tl.constexpr = SCALE_LO_F64 if ACC == tl.float64 else SCALE_LO_F32
    HI: tl.constexpr = SCALE_HI_F64 if ACC == tl.float64 else SCALE_HI_F32
    # cosine: the dot product and both sums of squares in units of the rows' running scales
    # (rescaled as the scales grow); dot: the plain sums
    sa = tl.full([BR], LO, dtype=ACC)
    sc = tl.full([BR], LO, dtype=ACC)
    ssa = tl.zeros([BR], dtype=ACC)
    ssc = tl.zeros([BR], dtype=ACC)
    dot = tl.zeros([BR], dtype=ACC)
    n_bad = tl.zeros([BR], dtype=tl.int32)
    for k0 in range(0, d, BD):
        ks = k0 + tl.arange(0, BD)
        in_d = (ks < d)[None, :]
        a = tl.load(a_rows + ks[None, :], mask=ok[:, None] & in_d, other=0.0).to(ACC)
        c = tl.load(c_rows + ks[None, :], mask=keep[:, None] & in_d, other=0.0).to(ACC)
        n_bad += tl.sum(tl.where(tl.abs(a) < float("inf"), 0, 1) + tl.where(tl.abs(c) < float("inf"), 0, 1), 1)
        if COSINE:
            new_a, a = rescale(sa, a, HI)
            new_c, c = rescale(sc, c, HI)
            ra, rc = sa / new_a, sc / new_c
            ssa = ssa * ra * ra + tl.sum(a * a, 1)
            ssc = ssc * rc * rc + tl.sum(c * c, 1)
            dot = dot * ra * rc + tl.sum(a * c, 1)
            sa, sc = new_a, new_c
        else:
            dot += tl.sum(a * c, 1)
    sim = dot
    if COSINE:
        # a.c / (max(|a|, eps) max(|c|, eps)) with |a| = sa sqrt(ssa): divide in the rows' units
        sim = dot / (tl.maximum(sqrt_rn(ssa), eps / sa) * tl.maximum(sqrt_rn(ssc), eps / sc))
    sim = tl.where(n_bad > 0, float("nan"), sim)
    tau = tl.load(TAU)
    tl.store(OUT + rows.to(tl.int64) * P + k, sim / tau, mask=ok)


OWN_LOGITS = Kernel(_own_logits_kernel, plan.OWN_ROWS, dtype_arg="A")


def _own_logits(
    anchor: Tensor,
    block0: Tensor,
    pos_mask: Tensor | None,
    tau: Tensor,
    pos_offset: int,
    pos_count: int,
    cosine: bool,
    eps: float,
) -> Tensor:
    """``[B, P]`` logits (accumulation dtype) of anchor ``i`` with rows
    ``pos_offset + i * P + k`` of ``block0``; ``pos_mask [B, P]`` (bool) or None."""
    dev, dt = anchor.device, anchor.dtype
    B, d = anchor.shape
    acc = acc_dtype(dt)
    if pos_offset < 0 or pos_offset + B * pos_count > block0.shape[0]:
        raise ValueError(
            f"own positives {pos_offset} + {B} * {pos_count} do not fit in block0 of {block0.shape[0]} rows"
        )
    if not (anchor.is_contiguous() and block0.is_contiguous()):
        raise ValueError("triton own-positive logits need contiguous inputs")
    out = new_output((B, pos_count), dtype=acc, device=dev)
    if B == 0 or pos_count == 0:
        return out
    grid = lambda meta: (triton.cdiv(B, meta["BR"]), pos_count)  # noqa: E731
    launch(
        OWN_LOGITS,
        grid,
        arch_of(dev),
        A=anchor,
        C=block0,
        MASK=pos_mask.contiguous().view(torch.uint8) if pos_mask is not None else dummy(dev),
        TAU=tau.to(acc).reshape(1),
        OUT=out,
        B=B,
        P=pos_count,
        d=d,
        pos_offset=pos_offset,
        eps=float(eps),
        HAS_MASK=pos_mask is not None,
        COSINE=cosine,
    )
    return out


own_logits = register_op("fastcl_triton::own_logits", _own_logits)
