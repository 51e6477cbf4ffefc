"""Rows whose denominator spans two problems, gradient in forward: ``JointLSE``.

GIST's row ``i`` holds the candidates of anchor ``a_i`` (its positives, other anchors,
negatives) and those of its positive ``p_i`` (the positive–positive block): one
log-sum-exp over two primitive problems with different anchors,

    loss_i = logaddexp(lse_q_i, lse_e_i) - l(a_i, p_i)

(``q``: the problem of ``a``, own positives folded; ``e``: the problem of ``p``). Composed
from two ``reduction="none"`` calls, both would recompute (eight GEMM-sized passes). Here,
as the ring does for its own block, ``e`` runs its forward first and its LSE enters the
gradient-in-forward sweep of ``q`` as the head's ``log_extra``: that sweep gives ``q``'s
loss rows and gradients in three passes; ``e``'s share of each row's gradient is then
``w_i * exp(lse_e_i - r_i)`` (``r_i`` the row's joint LSE), and ``e``'s backward runs at
once. Every gradient is formed in the forward; the backward scales them by the upstream
gradient. Needs a backend with a fused sweep and a ``mean`` or ``sum`` reduction (the
caller checks: :func:`takes`).

That composition costs ``e`` a forward and a recomputing backward: four GEMMs of ``e``'s
shape where a sweep that held both anchors' rows would need three. A backend with
``fused_joint`` (``cpp``) is that sweep: each block of rows takes ``q``'s candidates with
``q``'s anchors and ``e``'s with ``e``'s, one denominator, the gradient in the same pass
(:func:`native` says when; GIST at B = 4096 drops from 15.5 to 14 GEMM units).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blockwise import block_grad
from .contract import compute_dtype
from .contrastive import LossSpec, _first_order_only, _grad_store_dtype, _own_logits, _tau_grad
from .head import HeadInputs


@dataclass(frozen=True)
class JointSpec:
    """``q``: the rows' own problem (``LossSpec`` with own positives folded, ``kind``
    ``"cross_entropy"``, the reduction's ``weights``); ``e``: the extra problem (its tags,
    filter, ...; its own weights and head are not used)."""

    q: LossSpec
    e: LossSpec


def native(spec: JointSpec) -> bool:
    """Whether ``q``'s backend runs the joint rows in one sweep (``Backend.fused_joint``): a
    plain problem (no dims), ``e`` without own positives, the same similarity and filter rule
    (one threshold; both guided or neither); ``e``'s second block must be empty (the caller's
    check: a shape)."""
    q, e = spec.q, spec.e
    if q.impl.fused_joint is None or e.impl.name != q.impl.name or q.dims is not None or e.dims is not None:
        return False
    fq, fe = q.filter, e.filter
    same_filter = (fq is None and fe is None) or (
        fq is not None and fe is not None and fq.threshold is fe.threshold and fq.guided == fe.guided
    )
    return e.positives is None and q.cosine == e.cosine and same_filter


def takes(spec: LossSpec) -> bool:
    """Whether :class:`JointLSE` can run ``spec``'s rows: a fused sweep, mean/sum, folded positives."""
    impl = spec.impl
    fused = impl.fused is not None and (spec.dims is None or impl.fused_takes_dims)
    return fused and spec.reduction != "none" and spec.positives is not None and spec.strategy != "recompute"


class JointLSE(torch.autograd.Function):
    """``sum_i w_i [logaddexp(lse_q_i, lse_e_i) - l_i,pos]`` of ``q``'s anchor and blocks and
    ``e``'s anchor and blocks (module docstring); ``[K, B]`` prefix rows summed with the
    Matryoshka weights as ``ContrastiveLSE`` does."""

    @staticmethod
    def forward(ctx, q_anchor, q_b0, q_b1, e_anchor, e_b0, e_b1, tau, spec: JointSpec):
        q, e = spec.q, spec.e
        cd = compute_dtype(q_anchor.dtype)
        qp, ep = q.problem(q_anchor, q_b0, q_b1), e.problem(e_anchor, e_b0, e_b1)
        in_sweep = q.impl.forms_own_logits
        pos = None if in_sweep else _own_logits(q, qp, tau).detach().to(cd)
        weights = q.head_weights(q.row_weights.to(cd))  # [B], or [K, B] with dims
        if native(spec) and e_b1.shape[0] == 0:  # one sweep: the rows' loss, both problems' gradients, g . mean logit
            assert q.impl.fused_joint is not None
            out = q.impl.fused_joint(qp, ep, tau, HeadInputs(q.kind, pos, q.pos_mask, None, weights))
            d_qa, d_qb, g_dot, rows, d_pos = out.sweep_outputs()
            assert out.joint_grads is not None
            d_ea, d_eb = out.joint_grads
        else:
            lse_e, ml_e = e.impl.forward(ep, tau)
            assert q.impl.fused is not None  # takes() checked it
            out = q.impl.fused(qp, tau, HeadInputs(q.kind, pos, q.pos_mask, lse_e.detach(), weights))
            d_qa, d_qb, g_dot_ml_q, rows, d_pos = out.sweep_outputs()
            # e's share of each row: d loss / d lse_e = w * exp(lse_e - r), r = logaddexp(lse_q, lse_e)
            g_e = block_grad(weights, torch.logaddexp(out.lse, lse_e), lse_e)
            d_ea, d_eb = e.impl.backward(ep, tau, lse_e, g_e)
            g_dot = g_dot_ml_q + (g_e * ml_e).sum()
        pos = out.pos_logits if in_sweep else pos
        assert pos is not None
        d_tau = None
        if ctx.needs_input_grad[6]:
            d_tau = _tau_grad(g_dot, d_pos, pos, tau, True).to(tau.dtype)
        keep = _grad_store_dtype(q_anchor.dtype)
        grads = (d_qa, *d_qb, d_ea, *d_eb)
        ctx.save_for_backward(*(g.to(keep) for g in grads), d_tau)
        ctx.dtypes = (q_anchor.dtype, e_anchor.dtype)
        loss_rows = rows if q.dim_weights is None else (rows * q.dim_weights.to(rows.dtype)[:, None]).sum(0)
        return (loss_rows * q.row_weights.to(cd)).sum().to(q_anchor.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: first derivatives only, never a silent None
            with torch.no_grad():
                grads = JointLSE._grads(ctx, grad_out)
            return _first_order_only("joint", grads)
        return JointLSE._grads(ctx, grad_out)

    @staticmethod
    def _grads(ctx, grad_out):
        *grads, d_tau = ctx.saved_tensors
        go = grad_out.to(grads[0].dtype)
        q_dtype, e_dtype = ctx.dtypes
        out = [(g * go).to(q_dtype if k < 3 else e_dtype) for k, g in enumerate(grads)]
        return (*out, None if d_tau is None else d_tau * grad_out.to(d_tau.dtype), None)
