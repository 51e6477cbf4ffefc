"""GCLSR's grouped cosine as an autograd Function, and the entry point that picks a backend.

    fastcl.losses.grouped_cosine_loss -> grouped_cosine() -> GroupedCosine.apply -> backend impl

A backend implementation (op ``"grouped_cosine"``) provides
``forward(h, z, group_size, eps) -> cos [B, G]`` (float32; float64 for float64) and
``backward(h, z, group_size, eps, d_cos [B, G]) -> d_h`` (``z`` is stop-gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch
from .contract import EPS


class GroupedCosine(torch.autograd.Function):
    """``h, z [B, D]`` -> per-group cosines ``[B, D // group_size]``; gradient to ``h`` only."""

    @staticmethod
    def forward(ctx, h: Tensor, z: Tensor, group_size: int, eps: float, impl) -> Tensor:
        ctx.save_for_backward(h, z)
        ctx.group_size, ctx.eps, ctx.impl = group_size, eps, impl
        return impl.forward(h, z, group_size, eps)

    @staticmethod
    def backward(ctx, d_cos: Tensor):
        h, z = ctx.saved_tensors
        d_h = ctx.impl.backward(h, z, ctx.group_size, ctx.eps, d_cos) if ctx.needs_input_grad[0] else None
        return d_h, None, None, None, None


def grouped_cosine(h: Tensor, z: Tensor, group_size: int, *, eps: float = EPS, backend: str | None = "auto") -> Tensor:
    """Per-group cosine similarities ``[B, D // group_size]`` of validated inputs."""
    h, z = h.contiguous(), z.detach().contiguous()
    impl = dispatch.choose("grouped_cosine", h.device, h, z, group_size, backend=backend)
    if impl.autograd:
        return impl.cos(h, z, group_size, eps)
    return GroupedCosine.apply(h, z, group_size, eps, impl)
