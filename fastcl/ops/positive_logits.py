"""Own-positive logits ``l_ik = s(a_i, p_ik) / tau`` ``[B, P]``, in blocks of rows so that no
float32 copy of ``positives`` outlives a block (values, and a differentiable Function for
shared positives: docs/design.md, "Own-positive logits").
"""

from __future__ import annotations

import torch
from torch import Tensor

from .contract import compute_dtype, new_output
from .normalize import normalize_backward, normalize_rows

BLOCK_ELEMENTS = 1 << 22


def _rows_per_block(num_pos: int, dim: int, batch: int) -> int:
    return max(1, min(batch, BLOCK_ELEMENTS // max(num_pos * dim, 1)))


def _keep(pos_mask: Tensor | None, sl: slice) -> Tensor | None:
    return None if pos_mask is None else pos_mask[sl]


def own_positive_similarities(
    anchor: Tensor, positives: Tensor, cosine: bool, eps: float, pos_mask: Tensor | None = None
) -> Tensor:
    """``[B, P]`` similarities ``s(a_i, p_ik)`` in the compute dtype (no autograd). Padded
    positives are read as zeros: no NaN/Inf they hold reaches a value or a gradient."""
    B, P, d = positives.shape
    sim = new_output((B, P), dtype=compute_dtype(anchor.dtype), device=anchor.device)
    step = _rows_per_block(P, d, B)
    for r0 in range(0, B, step):
        a_hat, _ = normalize_rows(anchor[r0 : r0 + step], eps, cosine)
        p_hat, _ = normalize_rows(positives[r0 : r0 + step], eps, cosine, _keep(pos_mask, slice(r0, r0 + step)))
        sim[r0 : r0 + step] = torch.linalg.vecdot(p_hat, a_hat[:, None, :])
    return sim


class PositiveLogits(torch.autograd.Function):
    """``anchor [B, d]``, ``positives [B, P, d]``, ``tau`` (0-d) -> logits ``[B, P]``."""

    @staticmethod
    def forward(
        ctx, anchor: Tensor, positives: Tensor, tau: Tensor, cosine: bool, eps: float, pos_mask: Tensor | None
    ) -> Tensor:
        B, P, d = positives.shape
        sim = own_positive_similarities(anchor, positives, cosine, eps, pos_mask)
        ctx.save_for_backward(anchor, positives, tau, sim)
        ctx.pos_mask = pos_mask
        ctx.cosine, ctx.eps, ctx.step = cosine, eps, _rows_per_block(P, d, B)
        return sim / tau.to(sim.dtype)

    @staticmethod
    def backward(ctx, d_logits: Tensor):
        anchor, positives, tau, sim = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a gradient that is itself differentiable
            return (*_differentiable_grads(ctx, anchor, positives, tau, d_logits), None, None, None)
        cd = sim.dtype
        d_sim = d_logits.to(cd) / tau.to(cd)
        d_anchor = d_pos = d_tau = None
        if ctx.needs_input_grad[2]:
            # l = s / tau  ->  dl/dtau = -l / tau
            d_tau = -(d_sim * sim).sum().div(tau.to(cd)).to(tau.dtype)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            d_anchor = new_output(anchor.shape, dtype=anchor.dtype, device=anchor.device)
            d_pos = new_output(positives.shape, dtype=positives.dtype, device=positives.device)
            for r0 in range(0, anchor.shape[0], ctx.step):
                sl = slice(r0, r0 + ctx.step)
                a_hat, a_norm = normalize_rows(anchor[sl], ctx.eps, ctx.cosine)
                p_hat, p_norm = normalize_rows(positives[sl], ctx.eps, ctx.cosine, _keep(ctx.pos_mask, sl))
                g = d_sim[sl].unsqueeze(-1)  # [R, P, 1]
                d_a_hat = (g * p_hat).sum(1)
                d_p_hat = g * a_hat[:, None, :]
                d_anchor[sl] = normalize_backward(a_hat, a_norm, d_a_hat, ctx.eps)
                d_pos[sl] = normalize_backward(p_hat, p_norm, d_p_hat, ctx.eps)
        return d_anchor, d_pos, d_tau, None, None, None


def _differentiable_grads(ctx, anchor: Tensor, positives: Tensor, tau: Tensor, d_logits: Tensor) -> list:
    """The same gradients by autograd through the plain formula (materialises ``[B, P, d]``)."""
    wanted = [x for x, need in zip((anchor, positives, tau), ctx.needs_input_grad[:3]) if need]
    a_hat, _ = normalize_rows(anchor, ctx.eps, ctx.cosine)
    p_hat, _ = normalize_rows(positives, ctx.eps, ctx.cosine, ctx.pos_mask)
    logits = torch.linalg.vecdot(p_hat, a_hat[:, None, :]) / tau.to(a_hat.dtype)
    grads = iter(torch.autograd.grad(logits, wanted, d_logits, create_graph=True))
    return [next(grads) if need else None for need in ctx.needs_input_grad[:3]]


def positive_logits(
    anchor: Tensor, positives: Tensor, tau: Tensor, *, cosine: bool, eps: float, pos_mask: Tensor | None = None
) -> Tensor:
    """``[B, P]`` float32 (float64) own-positive logits; differentiable in all three inputs.
    Padded positives (``pos_mask`` False) are read as zeros (logit 0, gradient exactly 0)."""
    return PositiveLogits.apply(anchor, positives, tau, cosine, eps, pos_mask)
