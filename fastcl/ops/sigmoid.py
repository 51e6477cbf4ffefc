"""The autograd Function of the sigmoid losses (SigLIP: ``LSEProblem.sigmoid`` on any backend)
and ``sigmoid_loss``, which picks the backend (docs/design.md, "Sigmoid reduction").

A row's loss is the primitive's row value itself, ``v_i = sum_c softplus(-z_ic (l_ic + b))``,
so the head is the identity and the gradient-in-forward sweep needs only the row weights:
with ``mean``/``sum`` the backend's ``fused`` sweep forms every gradient in the forward
(three GEMM passes), otherwise ``forward`` keeps the row statistics and ``backward``
recomputes the logits. The temperature's and the bias's gradients are weighted sums of the
row statistics ``(sum_c sigma_ic l_ic, sum_c sigma_ic)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .contract import Sigmoid, compute_dtype
from .contrastive import LossSpec, _first_order_only, _grad_store_dtype, _strategy
from .head import SIGMOID_HEAD, HeadInputs


def value_grads(spec: LossSpec, go: Tensor) -> Tensor:
    """``dLoss/dvalue`` of a sigmoid call (``spec.kind == "sigmoid"``): ``[B]``, or ``[K, B]``
    with dims, for the upstream ``go``."""
    return spec.head_weights(go * spec.row_weights.to(go.dtype) if spec.reduction != "none" else go)


def _scalar_grads(stats: Tensor, g: Tensor, tau: Tensor) -> tuple[Tensor, Tensor]:
    """``(d tau, d bias)`` from the row statistics ``[2, ...]`` and ``dLoss/dvalue`` ``g``:
    ``l = s / tau`` gives ``-sum g sigma l / tau``; the bias ``sum g sigma``."""
    return -(g * stats[0]).sum() / tau.to(g.dtype), (g * stats[1]).sum()


class SigmoidPairs(torch.autograd.Function):
    """Reduced sigmoid loss ``sum_i w_i v_i`` (rows ``[B]`` for ``none``) of ``anchor``, the two
    candidate blocks, ``tau`` and ``bias`` (0-d tensors)."""

    @staticmethod
    def forward(ctx, anchor, block0, block1, tau, bias, spec: LossSpec):
        cd = compute_dtype(anchor.dtype)
        problem = spec.problem(anchor, block0, block1, Sigmoid(bias.detach().to(cd)))
        needs_grad = any(ctx.needs_input_grad[:5])
        ctx.spec, ctx.dtype, ctx.tau_dtype, ctx.bias_dtype = spec, anchor.dtype, tau.dtype, bias.dtype
        ctx.mode = _strategy(spec) if needs_grad else "none"
        if ctx.mode == "fused":
            assert spec.impl.fused is not None
            w = value_grads(spec, torch.ones((), dtype=cd, device=anchor.device))
            out = spec.impl.fused(problem, tau, HeadInputs(SIGMOID_HEAD, None, None, None, w))
            assert out.d_anchor is not None and out.d_blocks is not None
            value = out.lse
            d_tau, d_bias = _scalar_grads(out.mean_logit, w, tau)
            keep = _grad_store_dtype(anchor.dtype)
            ctx.save_for_backward(out.d_anchor.to(keep), *(d.to(keep) for d in out.d_blocks), d_tau, d_bias)
        else:
            value, stats = spec.impl.forward(problem, tau)
            if needs_grad:
                ctx.save_for_backward(anchor, block0, block1, tau, bias, value, stats)
        rows = spec.combine(value)
        out_loss = rows if spec.reduction == "none" else (rows * spec.row_weights.to(cd)).sum()
        return out_loss.to(anchor.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        spec = ctx.spec
        if torch.is_grad_enabled() and spec.impl.double_backward and ctx.mode != "fused":
            return SigmoidPairs._second_order(ctx, grad_out)
        if torch.is_grad_enabled():  # create_graph=True on a first-order backend: mark, never None
            with torch.no_grad():
                grads = SigmoidPairs._grads(ctx, grad_out)
            return _first_order_only(spec.impl.name, grads)
        return SigmoidPairs._grads(ctx, grad_out)

    @staticmethod
    def _grads(ctx, grad_out):
        spec, cd = ctx.spec, compute_dtype(ctx.dtype)
        go = grad_out.to(cd)
        if ctx.mode == "fused":
            d_anchor, d_b0, d_b1, d_tau, d_bias = ctx.saved_tensors
            grads = [(t * go).to(ctx.dtype) for t in (d_anchor, d_b0, d_b1)]
            return (*grads, (d_tau * go).to(ctx.tau_dtype), (d_bias * go).to(ctx.bias_dtype), None)
        anchor, block0, block1, tau, bias, value, stats = ctx.saved_tensors
        g = value_grads(spec, go)
        problem = spec.problem(anchor, block0, block1, Sigmoid(bias.detach().to(cd)))
        d_anchor, (d_b0, d_b1) = spec.impl.backward(problem, tau, value, g)
        d_tau, d_bias = _scalar_grads(stats, g, tau)
        grads = [t.to(ctx.dtype) for t in (d_anchor, d_b0, d_b1)]
        return (*grads, d_tau.to(tau.dtype), d_bias.to(bias.dtype), None)

    @staticmethod
    def _second_order(ctx, grad_out):
        """A differentiable gradient: the backend's forward (plain torch ops) under autograd."""
        spec = ctx.spec
        anchor, block0, block1, tau, bias, _, _ = ctx.saved_tensors
        inputs = (anchor, block0, block1, tau, bias)
        with torch.enable_grad():
            cd = compute_dtype(anchor.dtype)
            problem = spec.problem(anchor, block0, block1, Sigmoid(bias.to(cd)))
            value, _ = spec.impl.forward(problem, tau)
            rows = spec.combine(value)
            loss = rows if spec.reduction == "none" else (rows * spec.row_weights.to(cd)).sum()
            wanted = [x for x, need in zip(inputs, ctx.needs_input_grad[:5]) if need]
            got = torch.autograd.grad(loss.to(ctx.dtype), wanted, grad_out, create_graph=True, allow_unused=True)
        by_input = iter(torch.zeros_like(x) if g is None else g for g, x in zip(got, wanted))
        return (*(next(by_input) if need else None for need in ctx.needs_input_grad[:5]), None)


def sigmoid_loss(anchor: Tensor, blocks: tuple[Tensor, Tensor], tau: Tensor, bias: Tensor, spec: LossSpec) -> Tensor:
    """Run the sigmoid reduction's loss, described by ``spec`` (``kind="sigmoid"``, its
    ``weights`` set; ``positives``: the pairs), on the backend it names or the one dispatch
    chooses (validated inputs; see ``fastcl.losses.siglip_loss``): ``sum_i weights_i v_i``
    (rows for ``"none"``), ``v_i`` of ``contract.Sigmoid``. ``tau`` and ``bias``: 0-d
    compute-dtype tensors (differentiable). ``dims``/``dim_weights``: Matryoshka prefixes."""
    anchor = anchor.contiguous()
    blocks = (blocks[0].contiguous(), blocks[1].contiguous())
    sigmoid = Sigmoid(bias.detach().to(compute_dtype(anchor.dtype)))
    spec = spec.choose(spec.problem(anchor, *blocks, sigmoid))
    return SigmoidPairs.apply(anchor, blocks[0], blocks[1], tau, bias, spec)
