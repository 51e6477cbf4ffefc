"""Row normalisation with clamped norms, ``x_hat = x / max(|x|, eps)``, and its backward.

Shared by the PyTorch paths. The rules for huge, padded and non-finite rows, the same in
every backend, and the backward formula: docs/losses.md ("Gradients", "Non-finite inputs").
"""

from __future__ import annotations

import torch
from torch import Tensor

from .contract import compute_dtype


def _max_abs(x: Tensor) -> Tensor:
    """``max_k |x_k|`` per row in the compute dtype (NaN if the row holds a NaN)."""
    return x.abs().amax(dim=-1).to(compute_dtype(x.dtype))


def row_norms(x: Tensor) -> Tensor:
    """``|x|`` over the last dim in the compute dtype as ``m * |x / m|``, ``m = max_k |x_k|``:
    no overflow or underflow. NaN for a row holding a NaN or an Inf; 0 for a zero row."""
    cd = compute_dtype(x.dtype)
    m = _max_abs(x)
    # a zero row keeps m = 0 (norm 0); NaN/Inf rows give NaN: inf / inf and NaN propagate
    unit = torch.where(m > 0, m, torch.ones_like(m))
    scaled = x.to(cd) / unit.unsqueeze(-1)
    return torch.linalg.vector_norm(scaled, dim=-1) * unit


def normalize_rows(x: Tensor, eps: float, cosine: bool, keep: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``(x_hat, norm)``: a compute-dtype copy of ``x`` normalised per row (just upcast, and
    ``norm`` None, when not ``cosine``; ``norm`` is unclamped); rows where ``keep`` is False
    are read as zeros."""
    cd = compute_dtype(x.dtype)
    if keep is not None:
        x = torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    if not cosine:
        # max |x| * 0 is NaN for a row holding NaN or Inf: that row comes out all NaN
        return x.to(cd) + (_max_abs(x) * 0).unsqueeze(-1), None
    norm = row_norms(x)
    return x.to(cd) / norm.clamp_min(eps).unsqueeze(-1), norm


def normalize_backward(x_hat: Tensor, norm: Tensor | None, d_hat: Tensor, eps: float) -> Tensor:
    """Gradient w.r.t. the raw rows from the gradient w.r.t. the normalised rows."""
    if norm is None:
        return d_hat
    unclamped = (norm > eps).to(d_hat.dtype).unsqueeze(-1)
    radial = torch.linalg.vecdot(x_hat, d_hat).unsqueeze(-1) * unclamped
    return torch.addcmul(d_hat, x_hat, radial, value=-1).div_(norm.clamp_min(eps).unsqueeze(-1))
