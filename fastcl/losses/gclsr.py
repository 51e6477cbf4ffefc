"""GCLSR grouped cosine (Wang et al. 2023, eqs. 6-7): SimSiam-style negative cosine per feature group.

No exponentials and no candidates: O(B * D) elementwise work, one PyTorch computation in
float32 (float64 for float64) on every backend. Formulas: docs/losses.md, "GCLSR".
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _checks
from ..ops.contract import EPS
from ..ops.dispatch import NAMES as BACKENDS
from ..ops.normalize import normalize_backward, normalize_rows
from ._shared import check_matrix, document, no_autocast

__all__ = ["grouped_cosine_loss", "gclsr_loss", "GroupedCosineLoss", "GCLSRLoss"]

# reduction and backend mean less here than for the LSE losses: documented once for this family
GROUP_DOCS = {
    "reduction": '``"mean"`` (over samples), ``"sum"``, or ``"none"`` (``[B]``, each sample\'s mean over groups).',
    "backend": '``"auto"`` or a fastcl backend, checked by name: every backend runs the same PyTorch computation.',
}


class _GroupedCosine(torch.autograd.Function):
    """``[B, G]`` cosines of ``h, z [B, G, g]`` groups in the compute dtype; no gradient to ``z``.
    The backward is ``ops.normalize``'s clamped-norm formula (exactly 0 where the true gradient
    is, e.g. ``g = 1``) in plain ops on the saved inputs: differentiable, extra memory O(B * D).
    """

    @staticmethod
    def forward(ctx, h: Tensor, z: Tensor) -> Tensor:
        ctx.save_for_backward(h, z)
        return torch.linalg.vecdot(normalize_rows(h, EPS, True)[0], normalize_rows(z, EPS, True)[0])

    @staticmethod
    def backward(ctx, d_cos: Tensor):
        h, z = ctx.saved_tensors
        h_hat, h_norm = normalize_rows(h, EPS, True)
        z_hat = normalize_rows(z, EPS, True)[0]
        d_h = normalize_backward(h_hat, h_norm, z_hat * d_cos.to(z_hat.dtype).unsqueeze(-1), EPS)
        return d_h.to(h.dtype), None


@document("reduction", "backend", extra=GROUP_DOCS)
def grouped_cosine_loss(
    h: Tensor, z: Tensor, *, group_size: int, reduction: str = "mean", backend: str = "auto"
) -> Tensor:
    """GCLSR grouped cosine (Wang et al. 2023, eq. 6): ``-mean_{i,g} cos(h_ig, stopgrad(z_ig))``.

    Args:
        h: ``[B, D]`` predictor output, float16, bfloat16, float32 or float64.
        z: ``[B, D]`` projector output (same dtype and device; no gradient flows into it).
        group_size: features per group ``g``, dividing ``D`` (``D / g`` contiguous groups);
            ``group_size=D`` is plain SimSiam, 16 GCLSR's setting.
        {shared}

    Returns:
        0-d loss (``[B]`` with ``reduction="none"``) in ``h``'s dtype, computed in float32
        (float64 for float64).

    Example:
        >>> import torch
        >>> from fastcl.losses import grouped_cosine_loss
        >>> h = torch.randn(8, 64)
        >>> round(grouped_cosine_loss(h, h, group_size=16).item(), 4)
        -1.0
    """
    _checks.check_choice("reduction", reduction, _checks.REDUCTIONS)
    _checks.check_embeddings(h=h, z=z)
    B, D = check_matrix("h", h, "[B, D]")
    if tuple(z.shape) != tuple(h.shape):
        raise ValueError(f"h and z must have the same shape, got {tuple(h.shape)} and {tuple(z.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise TypeError(f"group_size must be a positive int, got {group_size!r}")
    if D % group_size:
        raise ValueError(f"group_size={group_size} does not divide the feature dimension D={D}")
    _checks.check_choice("backend", backend, ("auto", *BACKENDS))
    with no_autocast(h):
        groups = (B, D // group_size, group_size)
        loss = -_GroupedCosine.apply(h.reshape(groups), z.detach().reshape(groups)).mean(1)  # [B]
        if reduction != "none":
            loss = loss.sum() if reduction == "sum" else loss.mean()
        return loss.to(h.dtype)


@document("reduction", "backend", extra=GROUP_DOCS)
def gclsr_loss(
    h1: Tensor,
    z1: Tensor,
    h2: Tensor,
    z2: Tensor,
    *,
    group_size: int = 16,
    reduction: str = "mean",
    backend: str = "auto",
) -> Tensor:
    """GCLSR symmetric loss (Wang et al. 2023, eq. 7, SimSiam style): ``0.5 * (L(h1, z2) + L(h2, z1))``.

    ``L`` is :func:`grouped_cosine_loss`; the stop-gradient is on the projector outputs.

    Args:
        h1: ``[B, D]`` predictor output of view 1 (float16, bfloat16, float32 or float64).
        z1: ``[B, D]`` projector output of view 1.
        h2: ``[B, D]`` predictor output of view 2.
        z2: ``[B, D]`` projector output of view 2.
        group_size: features per group, dividing ``D`` (GCLSR: 16).
        {shared}

    Returns:
        0-d loss (``[B]`` with ``reduction="none"``) in the inputs' dtype.

    Example:
        >>> import torch
        >>> from fastcl.losses import gclsr_loss
        >>> h1, z1, h2, z2 = (torch.randn(8, 64) for _ in range(4))
        >>> gclsr_loss(h1, z1, h2, z2, group_size=16).shape
        torch.Size([])
    """
    one = grouped_cosine_loss(h1, z2, group_size=group_size, reduction=reduction, backend=backend)
    other = grouped_cosine_loss(h2, z1, group_size=group_size, reduction=reduction, backend=backend)
    return 0.5 * (one + other)


@document("reduction", "backend", extra=GROUP_DOCS)
class GroupedCosineLoss(nn.Module):
    """Module form of :func:`grouped_cosine_loss`: ``forward(h [B, D], z [B, D])``.

    Args:
        group_size: features per group, dividing ``D``.
        {shared}
    """

    def __init__(self, group_size: int, *, reduction: str = "mean", backend: str = "auto"):
        super().__init__()
        self.group_size, self.reduction, self.backend = group_size, reduction, backend

    def forward(self, h, z) -> Tensor:
        return grouped_cosine_loss(h, z, group_size=self.group_size, reduction=self.reduction, backend=self.backend)


@document("reduction", "backend", extra=GROUP_DOCS)
class GCLSRLoss(nn.Module):
    """Module form of :func:`gclsr_loss`: ``forward(h1, z1, h2, z2)``, each ``[B, D]``.

    Args:
        group_size: features per group, dividing ``D`` (GCLSR: 16).
        {shared}
    """

    def __init__(self, group_size: int = 16, *, reduction: str = "mean", backend: str = "auto"):
        super().__init__()
        self.group_size, self.reduction, self.backend = group_size, reduction, backend

    def forward(self, h1, z1, h2, z2) -> Tensor:
        return gclsr_loss(h1, z1, h2, z2, group_size=self.group_size, reduction=self.reduction, backend=self.backend)
