"""The loss *head*: per-anchor loss ``mean_k phi(lse_i - l_ik)`` from the primitive's ``lse``
and the own-positive logits; the one definition of that math for PyTorch code (docs/design.md,
"The loss head").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

HEADS = ("cross_entropy", "softplus")  # phi(x) = x (SupCon, MNRL, InfoNCE) | softplus(x) (SupMPN)
# The sigmoid reduction's head (``LSEProblem.sigmoid``): a row's loss is its value itself, so a
# gradient-in-forward sweep needs only the row weights (``HeadInputs.weights``).
SIGMOID_HEAD = "sigmoid"


@dataclass(frozen=True)
class HeadInputs:
    """What a gradient-in-forward backend needs to form ``dLoss/dlse`` block by block:
    ``pos_logits [B, P]`` (detached; None: the backend forms them, ``Backend.forms_own_logits``),
    ``pos_mask [B, P]`` or None, ``log_extra [B]`` or None and ``weights [B]``, the reduction's
    weight of each row (``1/n_valid`` for mean, 1 for sum). With Matryoshka dims
    (``Backend.fused_takes_dims``): ``pos_logits [K, B, P]`` and ``weights [K, B]``, row ``k``
    the reduction's weights times prefix ``k``'s weight, and ``log_extra`` ``[B]`` (shared)
    or ``[K, B]`` (one per prefix: the ring's other blocks' ``lse``)."""

    kind: str
    pos_logits: Tensor | None
    pos_mask: Tensor | None
    log_extra: Tensor | None
    weights: Tensor

    def rows(self, r0: int, r1: int, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``head_rows`` on rows ``r0:r1``, derivatives already multiplied by the weights."""

        def part(t):
            return None if t is None else t[r0:r1]

        # a backend that forms the logits itself (forms_own_logits) has its own head loop
        assert self.pos_logits is not None, "HeadInputs.rows needs pos_logits"
        loss, dlse, dpos = head_rows(lse, self.pos_logits[r0:r1], part(self.pos_mask), self.kind, part(self.log_extra))
        w = self.weights[r0:r1]
        return loss, dlse * w, dpos * w[:, None]


def head_rows(
    lse: Tensor, pos_logits: Tensor, pos_mask: Tensor | None, kind: str, log_extra: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``loss [B]``, ``dloss/dlse [B]`` and ``dloss/dpos_logits [B, P]`` of head ``kind`` from
    ``lse [B]`` (``-inf`` for an empty row), the own-positive logits ``[B, P]``, their mask and
    ``log_extra [B]`` (log of extra denominator mass, or None). All zero for anchors without
    a valid positive; differentiable (the second-order path uses autograd here).
    """
    if kind not in HEADS:
        raise ValueError(f"unknown head {kind!r}; expected one of {HEADS}")
    count = torch.full_like(lse, float(pos_logits.shape[1])) if pos_mask is None else pos_mask.sum(1).to(lse.dtype)
    inv_count = 1.0 / count.clamp_min(1.0)

    r = lse if log_extra is None else torch.logaddexp(lse, log_extra)
    x = r[:, None] - pos_logits
    if kind == "cross_entropy":
        phi, dphi = x, torch.ones_like(x)
    else:
        # softplus(x) = logaddexp(x, 0), exact for every x (F.softplus returns x itself above
        # its threshold 20, an error of exp(-x) ~ 1e-9 that float64 can see)
        phi, dphi = torch.logaddexp(x, torch.zeros_like(x)), torch.sigmoid(x)
    if pos_mask is not None:
        phi = torch.where(pos_mask, phi, torch.zeros_like(phi))
        dphi = torch.where(pos_mask, dphi, torch.zeros_like(dphi))
    loss = phi.sum(1) * inv_count
    dr = dphi.sum(1) * inv_count
    if log_extra is None:
        dlse = dr
    else:  # d logaddexp(lse, c) / d lse = exp(lse - r): none for an empty row (r = lse = -inf); NaN stays NaN
        share = torch.where(r == float("-inf"), torch.zeros_like(r), torch.exp(lse - r))
        dlse = dr * share
    dpos = -dphi * inv_count[:, None]
    return loss, dlse, dpos


def reduction_weights(
    has_pos: Tensor,
    reduction: str,
    dtype: torch.dtype = torch.float32,
    denominator: Tensor | None = None,
    maybe_empty: bool = True,
) -> Tensor:
    """``[B]`` weight of each anchor's loss in the reduced loss (no host sync): 0 without a
    positive; ``mean`` divides by the number of anchors with one (or by ``denominator``, the
    distributed layer's global count); ``sum`` and ``none`` weigh 1. When no anchor has a
    positive (``maybe_empty``: the caller cannot rule it out) the loss is undefined and every
    weight of ``mean`` and ``sum`` is NaN, so the loss is NaN, never a finite 0."""
    w = has_pos.to(dtype)
    if reduction == "mean":
        n = w.sum() if denominator is None else denominator
        w = w / n  # 0 / 0: NaN when no anchor has a positive
    elif reduction == "sum" and maybe_empty and denominator is None:
        w = torch.where(w.sum() > 0, w, float("nan"))
    return w
