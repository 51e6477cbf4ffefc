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

import torch
from torch import Tensor

from . import dispatch
from .contract import TAG_ALL, LSEProblem, OwnPositives, compute_dtype, empty_block
from .contrastive import LossSpec, _first_order_only
from .positive_logits import own_positive_similarities


def symmetric_spec(
    text: Tensor, *, weights: Tensor | None, reduction: str, cosine: bool, eps: float, backend: str = "auto"
) -> LossSpec:
    """The description of CLIP's step on ``B`` pairs: every text a candidate of every image (no
    padding), text ``i`` image ``i``'s own positive, column statistics; ``weights [B]`` each
    pair's (both directions)."""
    tags = torch.full((text.shape[0],), TAG_ALL, dtype=torch.int32, device=text.device)
    return LossSpec(
        "cross_entropy", (tags, empty_block(text)[1]), reduction, weights, cosine=cosine, eps=eps,
        positives=OwnPositives(0, 1), padded=False, backend=backend, columns=True,
    )  # fmt: skip


def _problem(spec: LossSpec, image: Tensor, text: Tensor) -> LSEProblem:
    return spec.problem(image, text, empty_block(text)[0])


class SymmetricLSE(torch.autograd.Function):
    """``(image [B, d], text [B, d], tau)`` -> CLIP's loss (rows ``[B]`` for ``reduction="none"``)."""

    @staticmethod
    def forward(ctx, image, text, tau, spec: LossSpec):
        cd = compute_dtype(image.dtype)
        B = image.shape[0]
        problem = _problem(spec, image, text)
        lse, mean_logit = spec.impl.forward(problem, tau)  # [2B]: rows, then columns
        pos = own_positive_similarities(image, text[:, None], spec.cosine, spec.eps)[:, 0] / tau.to(cd)
        rows = 0.5 * (lse[:B] - pos) + 0.5 * (lse[B:] - pos)
        ctx.spec, ctx.dtype = spec, image.dtype
        ctx.save_for_backward(image, text, tau, lse, mean_logit, pos)
        out = rows if spec.reduction == "none" else (rows * spec.row_weights.to(cd)).sum()
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
        w = 0.5 * (go * spec.row_weights.to(go.dtype) if spec.reduction != "none" else go)  # [B], each direction
        g = torch.cat([w, w])  # dLoss/dlse: rows, columns
        d_pos = -(2 * w)[:, None]  # the pair's logit appears in both directions
        d_image, (d_text, _) = spec.impl.backward(_problem(spec, image, text), tau, lse, g, d_pos)
        d_tau = None
        if ctx.needs_input_grad[2]:  # l = s / tau: dl/dtau = -l / tau
            d_tau = (-((g * mean_logit).sum() + (d_pos[:, 0] * pos).sum()) / tau.to(g.dtype)).to(tau.dtype)
        return d_image.to(ctx.dtype), d_text.to(ctx.dtype), d_tau, None


def takes(backend: str, image: Tensor, text: Tensor, cosine: bool, eps: float) -> str | None:
    """The backend that runs the symmetric step here, or None: the one the directional path
    would use (``backend``, or the automatic choice for the plain problem), if it computes
    column statistics; the step never moves a call to a slower backend."""
    probe = _problem(symmetric_spec(text, weights=None, reduction="mean", cosine=cosine, eps=eps), image, text)
    plain = LSEProblem(probe.anchor, probe.blocks, probe.tags, cosine, eps, probe.positives, padded=False)
    try:
        name = dispatch.choose(plain, backend=backend).name
    except dispatch.BackendUnavailableError:
        return None  # the directional path raises with the reasons
    return None if dispatch.reasons(name, probe) else name


def symmetric_loss(image: Tensor, text: Tensor, tau: Tensor, spec: LossSpec) -> Tensor:
    """CLIP's loss of ``B`` pairs (validated inputs; see ``clip_loss``), described by ``spec``
    (:func:`symmetric_spec`), on the backend it names or the one dispatch chooses."""
    image, text = image.contiguous(), text.contiguous()
    return SymmetricLSE.apply(image, text, tau, spec.choose(_problem(spec, image, text)))
