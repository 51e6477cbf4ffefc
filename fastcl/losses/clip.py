"""Image–text losses: CLIP's symmetric InfoNCE and SigLIP's pairwise sigmoid loss (Radford et al.
2021; Zhai et al. 2023), with open_clip's conventions: ``logit_scale`` is the exponentiated
scale ``t`` (``logit = t * similarity + logit_bias``).

==============  ===========================================================================
``clip_loss``   ``(CE(image -> text) + CE(text -> image)) / 2`` over the ``[B, N]`` logits,
                diagonal targets: the LSE primitive in both directions (never the logits)
``siglip_loss`` ``-(1/B) sum_i sum_j log sigmoid(z_ij (t <x_i, y_j> + b))``, ``z_ii = +1``,
                ``-1`` otherwise: the primitive's sigmoid reduction (``contract.Sigmoid``)
==============  ===========================================================================

With a ``process_group`` each rank's images meet every rank's texts (and, for CLIP, each
rank's texts every rank's images); per-rank values are open_clip's with ``local_loss=True``
and ``gather_with_grad=True`` (``fastcl.integrations.open_clip`` gives its other modes), and
DDP's averaging yields the gradient of the global batch's loss. ``cross_device="ring"``
passes the candidates rank to rank: per-rank memory constant in the world size.
"""

from __future__ import annotations

import numbers
from dataclasses import replace

import torch
from torch import Tensor, nn

from .. import _checks, distributed
from .. import matryoshka as _matryoshka
from ..ops import symmetric as _symmetric
from ..ops.contract import EPS, TAG_ALL, TAG_PADDING, OwnPositives, compute_dtype, empty_block
from ..ops.head import SIGMOID_HEAD
from ..ops.ring_sigmoid import ring_sigmoid_loss
from ..ops.sigmoid import sigmoid_loss
from ._shared import (
    Options,
    check_matrix,
    check_options,
    document,
    fused_loss,
    no_autocast,
    row_weights,
    structured_call,
    uses_ring,
)

CLIP_OPTIONS = (
    "mask",
    "reduction",
    "backend",
    "strategy",
    "process_group",
    "cross_device",
    "similarity",
    "matryoshka_dims",
    "matryoshka_weights",
)
CLIP_DOCS = {
    "mask": "``[B]`` bool or None: ``False`` marks a padded pair, whose image and text take part in "
    "nothing (no row, no column, exactly zero gradient). None: every pair is valid.",
    "logit_scale": "``t > 0``: a float or a 0-d floating tensor (open_clip's ``logit_scale.exp()``), "
    "finite with a finite ``1/t`` in the compute dtype; a tensor that requires grad receives its gradient.",
    "logit_bias": "None (no bias) or a finite float or 0-d floating tensor ``b`` added to every logit; "
    "a tensor that requires grad receives its gradient.",
    "reduction": '``"mean"`` (over the valid pairs: open_clip\'s ``/ B``), ``"sum"``, or ``"none"`` '
    "(one row per image, 0 for a padded pair).",
    "similarity": '``"cos"`` (default: raw features, normalised inside) or ``"dot"`` (features that arrive '
    "normalised, as open_clip's; then the values and gradients are open_clip's exactly).",
}
CLIP_RETURNS = (
    '0-d loss (``[B]`` rows with ``reduction="none"``) in the features\' dtype, accumulated in float32 '
    "(float64 for float64 features)."
)


def _scalar(name: str, value, like: Tensor, *, positive: bool) -> Tensor:
    """A 0-d compute-dtype tensor on ``like``'s device (differentiable if given one), finite and,
    with ``positive``, > 0 with a finite reciprocal. A tensor's value is read on the CPU only
    (reading a CUDA value would be a host sync per call; a bad one there gives NaN)."""
    cd = compute_dtype(like.dtype)
    if isinstance(value, Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            raise ValueError(f"{name} must be a float or a 0-d floating tensor, got {value.dtype} {tuple(value.shape)}")
        seen = value.detach().to(cd) if value.device.type == "cpu" else None
        out = value.to(device=like.device, dtype=cd)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        seen = torch.tensor(float(value), dtype=cd)
        out = seen.to(like.device)
    else:
        raise TypeError(f"{name} must be a float or a 0-d floating tensor, got {type(value).__name__}")
    if seen is not None:
        ok = bool(torch.isfinite(seen)) and (not positive or (bool(seen > 0) and bool(torch.isfinite(1 / seen))))
        if not ok:
            rule = f"finite and > 0 with a finite 1/{name}" if positive else "finite"
            raise ValueError(f"{name} must be {rule} in {cd}, got {float(seen)!r}")
    return out


def _pairs(image: Tensor, text: Tensor, mask: Tensor | None) -> tuple[int, int]:
    _checks.check_embeddings(image_features=image, text_features=text)
    B, d = check_matrix("image_features", image)
    if tuple(text.shape) != (B, d):
        raise ValueError(
            f"image_features and text_features must both be [B, d]: got {tuple(image.shape)} and {tuple(text.shape)}"
        )
    _checks.check_mask("mask", mask, (B,), image.device)
    return B, d


@distributed.agree_on_errors
@document("logit_scale", "logit_bias", *CLIP_OPTIONS, extra=CLIP_DOCS)
def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: float | Tensor,
    logit_bias: float | Tensor | None = None,
    *,
    mask: Tensor | None = None,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    process_group=None,
    cross_device: str = "gather",
    similarity: str = "cos",
    matryoshka_dims=None,
    matryoshka_weights=None,
) -> Tensor:
    """CLIP's contrastive loss (Radford et al. 2021; open_clip's ``ClipLoss``): the mean of the
    image→text and text→image cross-entropies of ``t * s(x_i, y_j) + b``, pair ``i`` the target.

    ``loss_i = 1/2 [LSE_j l_ij - l_ii] + 1/2 [LSE_j l_ji - l_ii]``: InfoNCE in both directions
    (the bias cancels in both; its gradient is 0). Each direction is one call of the fused
    LSE primitive, so the ``[B, N]`` logits are never stored.

    Args:
        image_features: ``[B, d]`` float16, bfloat16, float32 or float64.
        text_features: ``[B, d]``, pair ``i`` with image ``i``; same dtype and device.
        {shared}

    Returns:
        0-d loss (``[B]`` rows with ``reduction="none"``) in the features' dtype.

    Example:
        >>> import torch
        >>> from fastcl.losses import clip_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> img, txt = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
        >>> clip_loss(img, txt, logit_scale=100.0).shape
        torch.Size([])
    """
    check_options(reduction, similarity, strategy, cross_device)
    B, _ = _pairs(image_features, text_features, mask)
    scale = _scalar("logit_scale", logit_scale, image_features, positive=True)
    opts = Options(
        1.0 / scale, reduction, backend, strategy, process_group, similarity, matryoshka_dims, matryoshka_weights,
        cross_device,
    )  # fmt: skip
    pos_mask = None if mask is None else mask[:, None]
    symmetric = None
    if mask is None and process_group is None and matryoshka_dims is None and strategy != "fused":
        symmetric = _symmetric.takes(backend, image_features, text_features, similarity == "cos", EPS)

    def direction(x: Tensor, y: Tensor) -> Tensor:
        call = structured_call("cross_entropy", x, y.unsqueeze(1), None, pos_mask, None, opts, exclude_own=False)
        return fused_loss(call, opts)

    if symmetric is not None:  # one pass for both directions' LSEs, one recompute backward
        cd = compute_dtype(image_features.dtype)
        tau = _checks.as_temperature(1.0 / scale, image_features)
        weights = row_weights(torch.ones(B, dtype=torch.bool, device=image_features.device), reduction, cd)
        with no_autocast(image_features):
            spec = _symmetric.symmetric_spec(
                text_features, weights=weights, reduction=reduction, cosine=similarity == "cos", eps=EPS,
                backend=symmetric,
            )  # fmt: skip
            loss = _symmetric.symmetric_loss(image_features, text_features, tau, spec)
    else:
        loss = 0.5 * (direction(image_features, text_features) + direction(text_features, image_features))
    if logit_bias is not None:  # shifts every logit of a row alike: no value, a zero gradient
        loss = loss + 0 * _scalar("logit_bias", logit_bias, image_features, positive=False).to(loss.dtype)
    return loss


@distributed.agree_on_errors
@document("logit_scale", "logit_bias", *CLIP_OPTIONS, extra=CLIP_DOCS)
def siglip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: float | Tensor,
    logit_bias: float | Tensor | None = None,
    *,
    mask: Tensor | None = None,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    process_group=None,
    cross_device: str = "gather",
    similarity: str = "cos",
    matryoshka_dims=None,
    matryoshka_weights=None,
) -> Tensor:
    """SigLIP's sigmoid loss (Zhai et al. 2023; open_clip's ``SigLipLoss``):
    ``loss_i = -sum_j log sigmoid(z_ij (t s(x_i, y_j) + b))``, ``z_ii = +1``, ``z_ij = -1``
    otherwise; the mean over images is open_clip's ``/ B``.

    One pass of the fused primitive's sigmoid reduction forms the loss and, for ``mean`` and
    ``sum``, every gradient (the backward only scales them), without the ``[B, N]`` logits.
    With a ``process_group`` the other ranks' texts are all negatives of this rank's images.

    Args:
        image_features: ``[B, d]`` float16, bfloat16, float32 or float64.
        text_features: ``[B, d]``, pair ``i`` with image ``i``; same dtype and device.
        {shared}

    Returns:
        0-d loss (``[B]`` rows with ``reduction="none"``) in the features' dtype.

    Example:
        >>> import torch
        >>> from fastcl.losses import siglip_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> img, txt = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
        >>> siglip_loss(img, txt, logit_scale=10.0, logit_bias=-10.0).shape
        torch.Size([])
    """
    check_options(reduction, similarity, strategy, cross_device)
    B, d = _pairs(image_features, text_features, mask)
    cd = compute_dtype(image_features.dtype)
    matryoshka = _matryoshka.check(matryoshka_dims, matryoshka_weights, d, cd)
    scale = _scalar("logit_scale", logit_scale, image_features, positive=True)
    bias = (
        torch.zeros((), dtype=cd, device=image_features.device)
        if logit_bias is None
        else _scalar("logit_bias", logit_bias, image_features, positive=False)
    )
    group = process_group
    if group is not None:
        distributed.check_group(group)
    elif mask is not None:
        _checks.check_some_positive(mask[:, None], "no pair is valid (mask is all False)")
    dev = image_features.device
    has_row = torch.ones(B, dtype=torch.bool, device=dev) if mask is None else mask
    tags = torch.full((B,), TAG_ALL, dtype=torch.int32, device=dev)
    if mask is not None:
        tags = torch.where(mask, tags, torch.full_like(tags, TAG_PADDING))
    opts = Options(
        reduction=reduction, backend=backend, strategy=strategy, process_group=group, similarity=similarity,
        cross_device=cross_device,
    )  # fmt: skip
    empty, empty_tags = empty_block(text_features)
    spec = opts.spec(SIGMOID_HEAD, (tags, empty_tags), image_features, matryoshka, positives=OwnPositives(0, 1))
    with no_autocast(image_features):
        image = image_features if mask is None else torch.where(mask[:, None], image_features, 0.0)
        tau = 1.0 / scale
        sizes = {"siglip_B": B, "d": d}
        if uses_ring(opts):
            if strategy == "fused":
                raise ValueError(
                    "siglip_loss with cross_device='ring' recomputes in backward: strategy='fused' is refused"
                )
            return ring_sigmoid_loss(
                image, (text_features, empty), tau, bias, spec, group=group, has_row=has_row,
                check_rows=mask is not None, sizes=sizes,
            )  # fmt: skip
        blocks, offset = (text_features, empty), 0
        if group is None:
            weights = row_weights(has_row, reduction, cd, maybe_empty=mask is not None)
        else:
            g = distributed.gather_candidates(
                blocks, spec.tags, has_row, sizes=sizes, check_positive=mask is not None, group=group
            )
            blocks, offset = g.blocks, g.offset
            weights = row_weights(has_row, reduction, cd, world=g.world, valid_anchors=g.valid_anchors.to(cd))
            spec = replace(spec, tags=g.tags)
        spec = replace(
            spec, weights=weights, positives=OwnPositives(offset, 1), padded=mask is not None or group is not None
        )
        return sigmoid_loss(image, blocks, tau, bias, spec)


class _ImageTextLoss(nn.Module):
    """The options of an image–text loss module; ``forward(image_features, text_features,
    logit_scale, logit_bias=None, mask=None)``."""

    loss = staticmethod(clip_loss)

    def __init__(self, **options):
        super().__init__()
        check_options(
            options.get("reduction", "mean"),
            options.get("similarity", "cos"),
            options.get("strategy", "auto"),
            options.get("cross_device", "gather"),
        )
        self.options = options

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, mask=None) -> Tensor:
        return type(self).loss(image_features, text_features, logit_scale, logit_bias, mask=mask, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


@document(*CLIP_OPTIONS[1:], extra=CLIP_DOCS)
class ClipLoss(_ImageTextLoss):
    """Module form of :func:`clip_loss`: ``forward(image_features [B, d], text_features [B, d],
    logit_scale, logit_bias=None, mask=None)``. (open_clip's own signature:
    :class:`fastcl.integrations.open_clip.ClipLoss`.)

    Args:
        {shared}
    """

    loss = staticmethod(clip_loss)

    def __init__(
        self,
        *,
        reduction: str = "mean",
        backend: str = "auto",
        strategy: str = "auto",
        process_group=None,
        cross_device: str = "gather",
        similarity: str = "cos",
        matryoshka_dims=None,
        matryoshka_weights=None,
    ):
        super().__init__(
            reduction=reduction, backend=backend, strategy=strategy, process_group=process_group,
            cross_device=cross_device, similarity=similarity, matryoshka_dims=matryoshka_dims,
            matryoshka_weights=matryoshka_weights,
        )  # fmt: skip


@document(*CLIP_OPTIONS[1:], extra=CLIP_DOCS)
class SigLipLoss(_ImageTextLoss):
    """Module form of :func:`siglip_loss`: ``forward(image_features [B, d], text_features [B, d],
    logit_scale, logit_bias=None, mask=None)``. (open_clip's own signature:
    :class:`fastcl.integrations.open_clip.SigLipLoss`.)

    Args:
        {shared}
    """

    loss = staticmethod(siglip_loss)

    def __init__(
        self,
        *,
        reduction: str = "mean",
        backend: str = "auto",
        strategy: str = "auto",
        process_group=None,
        cross_device: str = "gather",
        similarity: str = "cos",
        matryoshka_dims=None,
        matryoshka_weights=None,
    ):
        super().__init__(
            reduction=reduction, backend=backend, strategy=strategy, process_group=process_group,
            cross_device=cross_device, similarity=similarity, matryoshka_dims=matryoshka_dims,
            matryoshka_weights=matryoshka_weights,
        )  # fmt: skip
