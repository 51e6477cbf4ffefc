"""CLIP's symmetric loss in one recompute step on the primitive's column statistics.

``loss = sum_i w_i [ (lse_row_i - l_ii) + (lse_col_i - l_ii) ] / 2`` over the square logits
``l_ij = s(x_i, y_j) / tau`` of ``B`` pairs: image ``i``'s row and text ``i``'s column, the pair
on the diagonal. Two directional calls of the fused LSE (``clip_loss``'s general path) run
the ``B x B`` GEMMs six times (three gradient-in-forward passes each); here the forward's one
pass gives the rows' and the columns' LSEs together (``LSEProblem.columns``: the columns'
merge online over the row blocks), and one recompute backward forms both softmaxes'
weights ``g_i p_row_ij + h_j p_col_ij`` on each tile for the two gradient products: four
GEMM passes, the fewest a logit-free symmetric step can do (docs/clip.md, "Speed").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import dispatch
from .backend import Backend
from .contract import TAG_ALL, LSEProblem, OwnPositives, compute_dtype, empty_block
from .contrastive import _first_order_only
from .positive_logits import own_positive_similarities


@dataclass(frozen=True)
class SymmetricSpec:
    impl: Backend
    cosine: bool
    eps: float
    weights: Tensor  # [B] each pair's weight (both directions)
    reduction: str

    def problem(self, image: Tensor, text: Tensor) -> LSEProblem:
        empty, empty_tags = empty_block(text)
        tags = torch.full((text.shape[0],), TAG_ALL, dtype=torch.int32, device=text.device)
        return LSEProblem(
            image, (text, empty), (tags, empty_tags), self.cosine, self.eps, OwnPositives(0, 1), padded=False,
            columns=True,
        )  # fmt: skip


class SymmetricLSE(torch.autograd.Function):
    """``(image [B, d], text [B, d], tau)`` -> CLIP's loss (rows ``[B]`` for ``reduction="none"``)."""

    @staticmethod
    def forward(ctx, image, text, tau, spec: SymmetricSpec):
        cd = compute_dtype(image.dtype)
        B = image.shape[0]
        problem = spec.problem(image, text)
        lse, mean_logit = spec.impl.forward(problem, tau)  # [2B]: rows, then columns
        pos = own_positive_similarities(image, text[:, None], spec.cosine, spec.eps)[:, 0] / tau.to(cd)
        rows = 0.5 * (lse[:B] - pos) + 0.5 * (lse[B:] - pos)
        ctx.spec, ctx.dtype = spec, image.dtype
        ctx.save_for_backward(image, text, tau, lse, mean_logit, pos)
        out = rows if spec.reduction == "none" else (rows * spec.weights.to(cd)).sum()
        return out.to(image.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: first derivatives only, never a silent None
            with torch.no_grad():
                grads = SymmetricLSE._grads(ctx, grad_out)
            return _first_order_only(ctx.spec.impl.name, grads)
        return SymmetricLSE._grads(ctx, grad_out)

    @staticmethod
    def _grads(ctx, grad_out):
        spec = ctx.spec
        image, text, tau, lse, mean_logit, pos = ctx.saved_tensors
        go = grad_out.to(lse.dtype)
        w = 0.5 * (go * spec.weights.to(go.dtype) if spec.reduction != "none" else go)  # [B], each direction
        g = torch.cat([w, w])  # dLoss/dlse: rows, columns
        d_pos = -(2 * w)[:, None]  # the pair's logit appears in both directions
        d_image, (d_text, _) = spec.impl.backward(spec.problem(image, text), tau, lse, g, d_pos)
        d_tau = None
        if ctx.needs_input_grad[2]:  # l = s / tau: dl/dtau = -l / tau
            d_tau = (-((g * mean_logit).sum() + (d_pos[:, 0] * pos).sum()) / tau.to(g.dtype)).to(tau.dtype)
        return d_image.to(ctx.dtype), d_text.to(ctx.dtype), d_tau, None


def takes(backend: str, image: Tensor, text: Tensor, cosine: bool, eps: float) -> str | None:
    """The backend that runs the symmetric step here, or None: the one the directional path
    would use (``backend``, or the automatic choice for the plain problem), if it computes
    column statistics; the step never moves a call to a slower backend."""
    probe = SymmetricSpec(dispatch.get("reference"), cosine, eps, image.new_empty(0), "mean").problem(image, text)
    plain = LSEProblem(probe.anchor, probe.blocks, probe.tags, cosine, eps, probe.positives, padded=False)
    try:
        name = dispatch.choose(plain, backend=backend).name
    except dispatch.BackendUnavailableError:
        return None  # the directional path raises with the reasons
    return None if dispatch.reasons(name, probe) else name


def symmetric_loss(
    image: Tensor, text: Tensor, tau: Tensor, *, weights: Tensor, reduction: str, cosine: bool, eps: float, backend
) -> Tensor:
    """CLIP's loss of ``B`` pairs on the chosen backend (validated inputs; see ``clip_loss``)."""
    image, text = image.contiguous(), text.contiguous()
    probe = SymmetricSpec(dispatch.get("reference"), cosine, eps, weights, reduction).problem(image, text)
    impl = dispatch.choose(probe, backend=backend)
    return SymmetricLSE.apply(image, text, tau, SymmetricSpec(impl, cosine, eps, weights, reduction))
