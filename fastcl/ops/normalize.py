"""Row normalisation with clamped norms, and its backward, shared by the PyTorch paths.

``x_hat = x / max(|x|, eps)`` (exactly ``torch.nn.functional.normalize``). Backward::

    dx = (dx_hat - x_hat * <x_hat, dx_hat>) / |x|     where |x| > eps
    dx = dx_hat / eps                                 where the norm is clamped
"""

from __future__ import annotations

import torch
from torch import Tensor

from .contract import compute_dtype


def row_norms(x: Tensor) -> Tensor:
    """``|x|`` over the last dim, in the compute dtype (without a full upcast copy)."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=compute_dtype(x.dtype))


def normalize_rows(x: Tensor, eps: float, cosine: bool) -> tuple[Tensor, Tensor | None]:
    """Compute-dtype copy of ``x`` normalised per row (or just upcast when not ``cosine``).

    Returns ``(x_hat, norm)``; ``norm`` (unclamped) is None for dot-product similarity.
    """
    cd = compute_dtype(x.dtype)
    if not cosine:
        return x.to(cd), None
    norm = row_norms(x)
    return x.to(cd) / norm.clamp_min(eps).unsqueeze(-1), norm


def normalize_backward(x_hat: Tensor, norm: Tensor | None, d_hat: Tensor, eps: float) -> Tensor:
    """Gradient w.r.t. the raw rows from the gradient w.r.t. the normalised rows."""
    if norm is None:
        return d_hat
    unclamped = (norm > eps).to(d_hat.dtype).unsqueeze(-1)
    radial = torch.linalg.vecdot(x_hat, d_hat).unsqueeze(-1) * unclamped
    return torch.addcmul(d_hat, x_hat, radial, value=-1).div_(norm.clamp_min(eps).unsqueeze(-1))
