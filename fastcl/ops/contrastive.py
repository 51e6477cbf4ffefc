"""The autograd Function of the fused LSE losses, and the entry point that picks a backend.

    fastcl.losses.*  ->  contrastive_loss()  ->  ContrastiveLSE.apply  ->  backend impl  ->  kernel

``ContrastiveLSE`` turns the primitive (``contract.py``) plus the loss head (``head.py``)
into a reduced loss. Its differentiable inputs are ``anchor``, the two candidate blocks,
``tau`` and, only where positives cannot be folded (shared positives, or a backend
without ``folds_positives``), the own-positive logits computed outside by
``PositiveLogits``. The structural mask and head settings travel in a :class:`LossSpec`.

Strategy: with ``mean``/``sum`` reduction and a backend that implements ``fused``, the
gradient is formed in the forward pass (three GEMM passes) and backward only scales it by
the upstream scalar; otherwise forward keeps ``lse`` and backward recomputes.
``FASTCL_STRATEGY=recompute|fused`` overrides the choice (for benchmarking).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _checks
from . import dispatch
from .contract import LSEProblem, OwnPositives
from .head import HeadInputs, head_rows
from .normalize import compute_dtype
from .positive_logits import own_positive_similarities, positive_logits

STRATEGY_ENV, STRATEGIES = _checks.STRATEGY_ENV, _checks.STRATEGIES


@dataclass(frozen=True)
class LossSpec:
    """Everything about a fused loss call that is not a differentiable tensor."""

    impl: object  # backend implementation of the "lse" op
    tags: tuple[Tensor, Tensor]
    cosine: bool
    eps: float
    positives: OwnPositives | None  # set: the backend folds d_pos (pos_logits input is None)
    kind: str  # head: "supcon" | "supmpn"
    pos_mask: Tensor | None
    log_extra: Tensor | None
    weights: Tensor  # [B] reduction weights
    reduction: str

    def problem(self, anchor: Tensor, block0: Tensor, block1: Tensor) -> LSEProblem:
        return LSEProblem(anchor, (block0, block1), self.tags, self.cosine, self.eps, self.positives)


def _strategy(impl, reduction: str) -> str:
    wanted = _checks.requested_strategy()
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


def _pos_tau_grad(d_pos: Tensor, pos_logits: Tensor, tau: Tensor) -> Tensor:
    """Temperature gradient through the folded own-positive logits: ``l = s / tau``."""
    return -(d_pos * pos_logits).sum() / tau.to(d_pos.dtype)


class ContrastiveLSE(torch.autograd.Function):
    """Reduced LSE loss: ``sum_i w_i * mean_k phi(lse_i - l_ik)`` (or per-row for ``none``)."""

    @staticmethod
    def forward(ctx, anchor, block0, block1, pos_logits, tau, spec: LossSpec):
        problem = spec.problem(anchor, block0, block1)
        cd = compute_dtype(anchor.dtype)
        folded = pos_logits is None
        if folded:  # values only: their gradient is folded into the backend's accumulators
            P = spec.positives.count
            own = block0[spec.positives.rows(0, anchor.shape[0])].view(anchor.shape[0], P, -1)
            pos_logits = own_positive_similarities(anchor, own, spec.cosine, spec.eps, spec.pos_mask) / tau.to(cd)
        pos_logits = pos_logits.detach().to(cd)
        needs_grad = any(ctx.needs_input_grad[:5])
        ctx.spec, ctx.dtype, ctx.folded = spec, anchor.dtype, folded
        ctx.mode = _strategy(spec.impl, spec.reduction) if needs_grad else "none"

        if ctx.mode == "fused":
            head = HeadInputs(spec.kind, pos_logits, spec.pos_mask, spec.log_extra, spec.weights)
            out = spec.impl.fused(problem, tau, head)
            keep = _grad_store_dtype(anchor.dtype)
            d_tau = -out.g_dot_mean_logit / tau.to(cd)
            if folded:
                d_tau = d_tau + _pos_tau_grad(out.d_pos, pos_logits, tau)
            ctx.save_for_backward(
                out.d_anchor.to(keep), out.d_blocks[0].to(keep), out.d_blocks[1].to(keep), out.d_pos,
                d_tau.to(tau.dtype),
            )
            loss_rows = out.loss_rows
        else:
            lse, mean_logit = spec.impl.forward(problem, tau)
            loss_rows, dlse, dpos = head_rows(lse, pos_logits, spec.pos_mask, spec.kind, spec.log_extra)
            if needs_grad:
                ctx.save_for_backward(anchor, block0, block1, tau, lse, mean_logit, dlse, dpos, pos_logits)

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
                None if ctx.folded else d_pos * go,
                d_tau * go,
                None,
            )

        anchor, block0, block1, tau, lse, mean_logit, dlse, dpos, pos_logits = ctx.saved_tensors
        row_w = go * spec.weights.to(go.dtype) if spec.reduction != "none" else go  # [B]
        g = dlse * row_w
        d_pos = dpos * row_w[:, None]
        problem = spec.problem(anchor, block0, block1)
        if ctx.folded:
            d_anchor, (d_b0, d_b1) = spec.impl.backward(problem, tau, lse, g, d_pos)
        else:
            d_anchor, (d_b0, d_b1) = spec.impl.backward(problem, tau, lse, g)
        d_tau = None
        if ctx.needs_input_grad[4]:
            d_tau = -(g * mean_logit).sum() / tau.to(g.dtype)
            if ctx.folded:
                d_tau = d_tau + _pos_tau_grad(d_pos, pos_logits, tau)
            d_tau = d_tau.to(tau.dtype)
        return (
            d_anchor.to(ctx.dtype), d_b0.to(ctx.dtype), d_b1.to(ctx.dtype),
            None if ctx.folded else d_pos, d_tau, None,
        )


def contrastive_loss(
    anchor: Tensor,
    blocks: tuple[Tensor, Tensor],
    tags: tuple[Tensor, Tensor],
    tau: Tensor,
    *,
    kind: str,
    positives: OwnPositives | None,
    pos_logits: Tensor | None,
    pos_mask: Tensor | None,
    weights: Tensor,
    reduction: str,
    cosine: bool,
    eps: float,
    log_extra: Tensor | None = None,
    backend: str | None = "auto",
) -> Tensor:
    """Run one LSE loss on the chosen backend (validated inputs; see ``fastcl.losses``).

    Own positives come either as a layout in block 0 (``positives``; the losses' usual
    case) or as precomputed differentiable ``pos_logits`` ``[B, P]`` (shared positives).
    """
    anchor = anchor.contiguous()
    blocks = (blocks[0].contiguous(), blocks[1].contiguous())
    problem = LSEProblem(anchor, blocks, tags, cosine, eps, positives)
    impl = dispatch.choose("lse", anchor.device, problem, backend=backend)
    folds = positives is not None and not impl.autograd and getattr(impl, "folds_positives", False)
    if positives is not None and not folds:  # the backend cannot fold: differentiate them outside
        own = blocks[0][positives.rows(0, anchor.shape[0])].view(anchor.shape[0], positives.count, -1)
        pos_logits = positive_logits(anchor, own, tau, cosine=cosine, eps=eps, pos_mask=pos_mask)
    if impl.autograd:  # the reference: differentiate through materialised logits
        lse = impl.lse(problem, tau)
        loss_rows = head_rows(lse, pos_logits.to(lse.dtype), pos_mask, kind, log_extra)[0]
        out = loss_rows if reduction == "none" else (loss_rows * weights.to(lse.dtype)).sum()
        return out.to(anchor.dtype)
    spec = LossSpec(impl, tags, cosine, eps, positives if folds else None, kind, pos_mask, log_extra, weights, reduction)
    return ContrastiveLSE.apply(anchor, blocks[0], blocks[1], None if folds else pos_logits, tau, spec)
