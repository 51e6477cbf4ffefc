"""The autograd Function of the fused LSE losses, and the entry point that picks a backend.

    fastcl.losses.*  ->  contrastive_loss()  ->  ContrastiveLSE.apply  ->  backend impl  ->  kernel

``ContrastiveLSE`` turns the primitive (``contract.py``) plus the loss head (``head.py``)
into a reduced loss. Its differentiable inputs are ``anchor``, the two candidate blocks,
the own-positive logits (computed outside by ``positive_logits``) and ``tau``; the
structural mask and head settings travel in a :class:`LossSpec`.

Strategy: with ``mean``/``sum`` reduction and a backend that implements ``fused``, the
gradient is formed in the forward pass (three GEMM passes) and backward only scales it by
the upstream scalar; otherwise forward keeps ``lse`` and backward recomputes.
``FASTCL_STRATEGY=recompute|fused`` overrides the choice (for benchmarking).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from . import dispatch
from .contract import LSEProblem
from .head import HeadInputs, head_rows
from .normalize import compute_dtype

STRATEGY_ENV = "FASTCL_STRATEGY"
STRATEGIES = ("auto", "fused", "recompute")


@dataclass(frozen=True)
class LossSpec:
    """Everything about a fused loss call that is not a differentiable tensor."""

    impl: object  # backend implementation of the "lse" op
    tags: tuple[Tensor, Tensor]
    cosine: bool
    eps: float
    kind: str  # head: "supcon" | "supmpn"
    pos_mask: Tensor | None
    log_extra: Tensor | None
    weights: Tensor  # [B] float32 reduction weights
    reduction: str


def _strategy(impl, reduction: str) -> str:
    wanted = os.environ.get(STRATEGY_ENV, "auto") or "auto"
    if wanted not in STRATEGIES:
        raise ValueError(f"{STRATEGY_ENV}={wanted!r}; expected one of {STRATEGIES}")
    can_fuse = hasattr(impl, "fused") and reduction != "none"
    if wanted == "fused" and not can_fuse:
        raise ValueError(
            f"{STRATEGY_ENV}=fused needs reduction 'mean' or 'sum' and a backend with a fused "
            f"path; got reduction={reduction!r}, backend={impl.name!r}"
        )
    if wanted == "recompute":
        return "recompute"
    return "fused" if can_fuse else "recompute"


def _grad_store_dtype(dtype: torch.dtype) -> torch.dtype:
    # Gradients formed in forward are kept until backward multiplies them by the upstream
    # gradient, which under fp16 GradScaler is a large scale: keep fp16 ones in float32 so
    # small values do not underflow before scaling. bf16 has float32's range.
    return torch.float32 if dtype == torch.float16 else dtype


class ContrastiveLSE(torch.autograd.Function):
    """Reduced LSE loss: ``sum_i w_i * mean_k phi(lse_i - l_ik)`` (or per-row for ``none``)."""

    @staticmethod
    def forward(ctx, anchor, block0, block1, pos_logits, tau, spec: LossSpec):
        problem = LSEProblem(anchor, (block0, block1), spec.tags, spec.cosine, spec.eps)
        needs_grad = any(ctx.needs_input_grad[:5])
        cd = compute_dtype(anchor.dtype)
        ctx.spec, ctx.dtype = spec, anchor.dtype
        ctx.mode = _strategy(spec.impl, spec.reduction) if needs_grad else "none"

        if ctx.mode == "fused":
            head = HeadInputs(spec.kind, pos_logits.detach(), spec.pos_mask, spec.log_extra, spec.weights)
            out = spec.impl.fused(problem, tau, head)
            keep = _grad_store_dtype(anchor.dtype)
            d_tau = (-out.g_dot_mean_logit / tau.to(cd)).to(tau.dtype)
            ctx.save_for_backward(
                out.d_anchor.to(keep), out.d_blocks[0].to(keep), out.d_blocks[1].to(keep), out.d_pos, d_tau
            )
            loss_rows = out.loss_rows
        else:
            lse, mean_logit = spec.impl.forward(problem, tau)
            loss_rows, dlse, dpos = head_rows(lse, pos_logits.to(cd), spec.pos_mask, spec.kind, spec.log_extra)
            if needs_grad:
                ctx.save_for_backward(anchor, block0, block1, tau, lse, mean_logit, dlse, dpos)

        if spec.reduction == "none":
            out_loss = loss_rows
        else:
            out_loss = (loss_rows * spec.weights.to(cd)).sum()
        return out_loss.to(anchor.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        spec = ctx.spec
        go = grad_out.to(compute_dtype(ctx.dtype))
        if ctx.mode == "fused":
            d_anchor, d_b0, d_b1, d_pos, d_tau = ctx.saved_tensors
            return (
                (d_anchor * go).to(ctx.dtype),
                (d_b0 * go).to(ctx.dtype),
                (d_b1 * go).to(ctx.dtype),
                d_pos * go,
                d_tau * go,
                None,
            )

        anchor, block0, block1, tau, lse, mean_logit, dlse, dpos = ctx.saved_tensors
        row_w = go * spec.weights.to(go.dtype) if spec.reduction != "none" else go  # [B]
        g = dlse * row_w
        problem = LSEProblem(anchor, (block0, block1), spec.tags, spec.cosine, spec.eps)
        d_anchor, (d_b0, d_b1) = spec.impl.backward(problem, tau, lse, g)
        d_tau = None
        if ctx.needs_input_grad[4]:
            d_tau = (-(g * mean_logit).sum() / tau.to(g.dtype)).to(tau.dtype)
        return d_anchor.to(ctx.dtype), d_b0.to(ctx.dtype), d_b1.to(ctx.dtype), dpos * row_w[:, None], d_tau, None


def contrastive_loss(
    anchor: Tensor,
    blocks: tuple[Tensor, Tensor],
    tags: tuple[Tensor, Tensor],
    pos_logits: Tensor,
    tau: Tensor,
    *,
    kind: str,
    pos_mask: Tensor | None,
    weights: Tensor,
    reduction: str,
    cosine: bool,
    eps: float,
    log_extra: Tensor | None = None,
    backend: str | None = "auto",
) -> Tensor:
    """Run one LSE loss on the chosen backend (validated inputs; see ``fastcl.losses``)."""
    anchor = anchor.contiguous()
    blocks = (blocks[0].contiguous(), blocks[1].contiguous())
    problem = LSEProblem(anchor, blocks, tags, cosine, eps)
    impl = dispatch.choose("lse", anchor.device, problem, backend=backend)
    if impl.autograd:  # the reference: differentiate through materialised logits
        lse = impl.lse(problem, tau)
        loss_rows = head_rows(lse, pos_logits.to(lse.dtype), pos_mask, kind, log_extra)[0]
        out = loss_rows if reduction == "none" else (loss_rows * weights.to(lse.dtype)).sum()
        return out.to(anchor.dtype)
    spec = LossSpec(impl, tags, cosine, eps, kind, pos_mask, log_extra, weights, reduction)
    return ContrastiveLSE.apply(anchor, blocks[0], blocks[1], pos_logits, tau, spec)
