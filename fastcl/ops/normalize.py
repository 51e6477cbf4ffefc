"""Row normalisation with clamped norms, and its backward, shared by the PyTorch paths.

``x_hat = x / max(|x|, eps)`` (``torch.nn.functional.normalize``'s formula). Backward::

    dx = (dx_hat - x_hat * <x_hat, dx_hat>) / |x|     where |x| > eps
    dx = dx_hat / eps                                 where the norm is clamped

Robustness rules (docs/losses.md, "Non-finite inputs"), the same in every backend:

* ``|x|`` never overflows or underflows: it is ``m * |x / m|`` with ``m = max_k |x_k|``
  (a plain sum of squares overflows float32 for |x| ~ 1e19 and gave a wrong, finite loss
  for inputs scaled by 1e30).
* A row marked padding (``keep`` False) is read as zeros, whatever it holds: its
  normalised copy and norm are 0, so it adds nothing to any value or gradient.
* A kept row holding NaN or Inf becomes an all-NaN row (with cosine similarity its norm is
  NaN; with dot similarity it is poisoned explicitly), so every logit that reads it is NaN
  and the non-finite value cannot vanish, e.g. as an ``exp(-inf) = 0`` term.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .contract import compute_dtype


def _max_abs(x: Tensor) -> Tensor:
    """``max_k |x_k|`` per row in the compute dtype (NaN if the row holds a NaN)."""
    return x.abs().amax(dim=-1).to(compute_dtype(x.dtype))


def row_norms(x: Tensor) -> Tensor:
    """``|x|`` over the last dim in the compute dtype, without overflow or underflow.

    NaN for a row holding a NaN or an Inf; 0 for a zero row.
    """
    cd = compute_dtype(x.dtype)
    m = _max_abs(x)
    # a zero row keeps m = 0 (norm 0); NaN/Inf rows give NaN: inf / inf and NaN propagate
    unit = torch.where(m > 0, m, torch.ones_like(m))
    scaled = x.to(cd) / unit.unsqueeze(-1)
    return torch.linalg.vector_norm(scaled, dim=-1) * unit


def poison_nonfinite(x: Tensor) -> Tensor:
    """``[rows]`` 0 for a finite row, NaN for a row holding NaN or Inf (compute dtype)."""
    return _max_abs(x) * 0


def normalize_rows(x: Tensor, eps: float, cosine: bool, keep: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Compute-dtype copy of ``x`` normalised per row (or just upcast when not ``cosine``).

    ``keep`` (``[rows]`` bool, optional): rows where it is False are read as zeros.
    Returns ``(x_hat, norm)``; ``norm`` (unclamped) is None for dot-product similarity.
    """
    cd = compute_dtype(x.dtype)
    if keep is not None:
        x = torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    if not cosine:
        return x.to(cd) + poison_nonfinite(x).unsqueeze(-1), None
    norm = row_norms(x)
    return x.to(cd) / norm.clamp_min(eps).unsqueeze(-1), norm


def normalize_backward(x_hat: Tensor, norm: Tensor | None, d_hat: Tensor, eps: float) -> Tensor:
    """Gradient w.r.t. the raw rows from the gradient w.r.t. the normalised rows."""
    if norm is None:
        return d_hat
    unclamped = (norm > eps).to(d_hat.dtype).unsqueeze(-1)
    radial = torch.linalg.vecdot(x_hat, d_hat).unsqueeze(-1) * unclamped
    return torch.addcmul(d_hat, x_hat, radial, value=-1).div_(norm.clamp_min(eps).unsqueeze(-1))
