"""InfoNCE (SimCSE unsupervised) and EdaCSE: MNRL with the second view as the positive.

``loss_i = -l_ii' + LSE_j l_ij'`` (``symmetric=True`` averages the column direction in);
EdaCSE adds a second InfoNCE against punctuation-augmented copies. Both run
:func:`fastcl.losses.mnrl_loss`. Formulas: docs/losses.md.
"""

from __future__ import annotations

import math

from torch import Tensor

from .. import _checks, distributed
from ._shared import LSE_OPTIONS, Options, TemperatureLoss, document
from .gist import check_false_negative_margin
from .mnrl import FILTER_DOCS, mnrl_loss

__all__ = ["infonce_loss", "edacse_loss", "InfoNCELoss", "EdaCSELoss"]


@distributed.agree_on_errors
@document(*LSE_OPTIONS, "false_negative_margin", extra=FILTER_DOCS)
def infonce_loss(
    anchor: Tensor,
    positive: Tensor,
    *,
    temperature: float | Tensor = 0.05,
    symmetric: bool = False,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims=None,
    matryoshka_weights=None,
    cross_device: str = "gather",
    false_negative_margin: float | None = None,
) -> Tensor:
    """InfoNCE / SimCSE unsupervised (Gao et al. 2021, eq. 1): row ``i`` of the ``anchor x positive`` logits, target ``i``.

    ``loss_i = -l_ii + LSE_j l_ij``, ``l_ij = s(anchor_i, positive_j) / temperature``; the
    ``positive`` is a second (dropout) view of the anchor.

    Args:
        anchor: ``[B, d]`` float16, bfloat16, float32 or float64 raw embeddings.
        positive: ``[B, d]``, the second views.
        symmetric: also the column direction (``positive`` as anchors against ``anchor``),
            averaged with the row direction.
        {shared}

    Returns:
        {returns}

    Example:
        >>> import torch
        >>> from fastcl.losses import infonce_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> a, a2 = torch.randn(64, 768, generator=g), torch.randn(64, 768, generator=g)
        >>> infonce_loss(a, a2, temperature=0.05).shape
        torch.Size([])
    """
    _checks.check_embeddings(anchor=anchor, positive=positive)
    _checks.check_rank("positive", positive, 2, "[B, d]")
    opts = Options(
        temperature,
        reduction,
        backend,
        strategy,
        process_group,
        similarity,
        matryoshka_dims,
        matryoshka_weights,
        cross_device,
    )
    kw = dict(opts.kwargs(), false_negative_margin=false_negative_margin)
    rows = mnrl_loss(anchor, positive, **kw)
    if not symmetric:
        return rows
    return 0.5 * (rows + mnrl_loss(positive, anchor, **kw))


@distributed.agree_on_errors
@document(*LSE_OPTIONS)
def edacse_loss(
    anchor: Tensor,
    dropout_view: Tensor,
    augmented_view: Tensor,
    *,
    lam: float = 0.6,
    temperature: float | Tensor = 0.05,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims=None,
    matryoshka_weights=None,
    cross_device: str = "gather",
) -> Tensor:
    """EdaCSE (Liu et al. 2023, eq. 2): ``InfoNCE(a, a') + lam * InfoNCE(a, a_aug)``.

    ``a'`` is the dropout view, ``a_aug`` the embedding of the sentence with 1..k random
    punctuation marks from ``. , ! ? ; :`` inserted (bert-base: ``k = 3, lam = 0.6``); the
    second term's candidates are the augmented copies of every sentence of the batch.

    Args:
        anchor: ``[B, d]`` float16, bfloat16, float32 or float64 raw embeddings.
        dropout_view: ``[B, d]``, a second dropout pass of the same sentences.
        augmented_view: ``[B, d]``, the punctuation-augmented sentences.
        lam: finite weight of the augmented term.
        {shared}

    Returns:
        {returns}

    Example:
        >>> import torch
        >>> from fastcl.losses import edacse_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> a, a2, a_aug = (torch.randn(8, 32, generator=g) for _ in range(3))
        >>> edacse_loss(a, a2, a_aug, lam=0.6).shape
        torch.Size([])
    """
    if not _checks.is_real_number(lam) or not math.isfinite(lam):
        raise TypeError(f"lam must be a finite float, got {lam!r}")
    lam = float(lam)
    # Validate all three views before the first term runs (with a process group, a failure
    # in the second term would come after the first term's collectives).
    _checks.check_embeddings(anchor=anchor, dropout_view=dropout_view, augmented_view=augmented_view)
    _checks.check_rank("anchor", anchor, 2, "[B, d]")
    if tuple(dropout_view.shape) != tuple(anchor.shape) or tuple(augmented_view.shape) != tuple(anchor.shape):
        raise ValueError(
            f"anchor, dropout_view and augmented_view must all have shape [B, d]; got {tuple(anchor.shape)}, "
            f"{tuple(dropout_view.shape)}, {tuple(augmented_view.shape)}"
        )
    kw = Options(
        temperature,
        reduction,
        backend,
        strategy,
        process_group,
        similarity,
        matryoshka_dims,
        matryoshka_weights,
        cross_device,
    ).kwargs()
    return infonce_loss(anchor, dropout_view, **kw) + lam * infonce_loss(anchor, augmented_view, **kw)


# --------------------------------------------------------------------------- modules


@document("learn_temperature", *LSE_OPTIONS, "false_negative_margin", extra=FILTER_DOCS)
class InfoNCELoss(TemperatureLoss):
    """Module form of :func:`infonce_loss`: ``forward(anchor [B, d], positive [B, d])``.

    Args:
        {shared}
        symmetric: also the column direction, averaged.
    """

    def __init__(
        self,
        temperature: float | Tensor = 0.05,
        *,
        symmetric: bool = False,
        false_negative_margin: float | None = None,
        **kw,
    ):
        super().__init__(temperature, **kw)
        self.symmetric = symmetric
        self.false_negative_margin = check_false_negative_margin(false_negative_margin)

    def forward(self, anchor, positive) -> Tensor:
        return infonce_loss(
            anchor, positive, symmetric=self.symmetric, false_negative_margin=self.false_negative_margin, **self._kw()
        )


@document("learn_temperature", *LSE_OPTIONS)
class EdaCSELoss(TemperatureLoss):
    """Module form of :func:`edacse_loss`: ``forward(anchor, dropout_view, augmented_view)``, each ``[B, d]``.

    Args:
        {shared}
        lam: weight of the augmented term.
    """

    def __init__(self, temperature: float | Tensor = 0.05, *, lam: float = 0.6, **kw):
        super().__init__(temperature, **kw)
        self.lam = lam

    def forward(self, anchor, dropout_view, augmented_view) -> Tensor:
        return edacse_loss(anchor, dropout_view, augmented_view, lam=self.lam, **self._kw())
