"""``conv1d`` whose weight gradient is one GEMM over the unfolded input (CPU speed only).

The TextCNN's wide regions (15 and 20 words of 300-384 features) make oneDNN's 1-D
convolution weight gradient slow on the CPU: in our measurements it took 2-3.5x the
forward time, while the same gradient written as ``grad_outputᵀ @ im2col(x)`` (one
GEMM) costs about as much as the forward. The forward pass is the ordinary
``F.conv1d`` (which saves only ``x``); the backward rebuilds the unfolded input
transiently, so memory stays that of a plain convolution. Values are those of
``F.conv1d``'s autograd up to float rounding (the sums run in another order);
``tests/train/test_gclsr_model.py`` checks it against autograd in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _unfold(x: Tensor, k: int) -> Tensor:
    """``x [B, d, L]`` -> windows ``[B * (L - k + 1), d * k]`` (row = one window, laid out like
    ``weight[f]`` of shape ``[d, k]``)."""
    B, d, L = x.shape
    return x.unfold(2, k, 1).permute(0, 2, 1, 3).reshape(B * (L - k + 1), d * k)


class _Conv1dGemmGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.conv1d(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.nn.grad.conv1d_input(x.shape, weight, grad)
        if ctx.needs_input_grad[1]:
            Fo, d, k = weight.shape
            g = grad.transpose(1, 2).reshape(-1, Fo)  # [B * L', F], rows in _unfold's order
            grad_w = (g.t() @ _unfold(x, k)).view(Fo, d, k)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum((0, 2))
        return grad_x, grad_w, grad_b


def conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.conv1d(x, weight, bias)`` (stride 1, no padding) with a GEMM weight gradient."""
    if not torch.is_grad_enabled() or not (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return F.conv1d(x, weight, bias)
    return _Conv1dGemmGrad.apply(x, weight, bias)
