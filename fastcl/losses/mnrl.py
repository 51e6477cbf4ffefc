"""Multiple negatives ranking (MNRL / SimCSE supervised), InfoNCE (SimCSE unsupervised) and EdaCSE.

All three are supervised contrastive with one positive per anchor: ``loss_i = -l_i,pos(i) +
LSE_{c in C} l_ic`` over the batch's candidates ``C``. Plain MNRL runs the structured layout
(``_shared.structured_loss``); sentence-transformers 6's ``directions``, ``partition_mode``
and hardness options combine several primitive calls per row (``_mnrl_directions``).
Formulas: docs/losses.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _checks, distributed
from .. import matryoshka as _matryoshka
from ..ops.contract import compute_dtype
from . import _mnrl_directions
from ._mnrl_directions import DEFAULT_DIRECTIONS, DIRECTIONS, HARDNESS_MODES, PARTITION_MODES, check_mnrl_options
from ._shared import (
    LSE_OPTIONS,
    Options,
    TemperatureLoss,
    check_matrix,
    check_options,
    document,
    no_autocast,
    row_weights,
    structured_loss,
)
from .gist import GIST_DOCS, check_false_negative_margin

__all__ = [
    "mnrl_loss",
    "mnrl_directions_loss",
    "infonce_loss",
    "edacse_loss",
    "MNRLoss",
    "InfoNCELoss",
    "EdaCSELoss",
    "DIRECTIONS",
    "PARTITION_MODES",
    "HARDNESS_MODES",
    "check_mnrl_options",
]

# sentence-transformers 6's options, documented once for mnrl_loss, mnrl_directions_loss and MNRLoss
ST6_DOCS = {
    "directions": 'sentence-transformers 6\'s: an iterable of ``"query_to_doc"`` (required: it holds the '
    'positive), ``"query_to_query"``, ``"doc_to_query"`` and ``"doc_to_doc"``.',
    "partition_mode": '``"joint"`` (one LSE over every selected term of a row) or ``"per_direction"`` (the '
    "mean of each direction's loss; only ``query_to_doc`` and ``doc_to_query``).",
    "hardness_mode": 'None, ``"in_batch_negatives"``, ``"hard_negatives"`` or ``"all_negatives"``: the '
    "``query_to_doc`` candidates whose logit becomes ``s / temperature + hardness_strength * stopgrad(s)``; "
    "never the positive.",
    "hardness_strength": "finite ``>= 0``, unscaled (added to ``s / temperature``); 0: no hardness.",
}
ST6_OPTIONS = tuple(ST6_DOCS)


def _negatives_3d(negatives: Tensor | None) -> Tensor | None:
    """``[B, d]`` (one hard negative each) -> ``[B, 1, d]``; ``[B, Q, d]`` and None unchanged."""
    return negatives.unsqueeze(1) if negatives is not None and negatives.dim() == 2 else negatives


FILTER_DOCS = {"false_negative_margin": GIST_DOCS["false_negative_margin"]}


@distributed.agree_on_errors
@document(*LSE_OPTIONS, *ST6_OPTIONS, "false_negative_margin", extra={**ST6_DOCS, **FILTER_DOCS})
def mnrl_loss(
    anchor: Tensor,
    positive: Tensor,
    negatives: Tensor | None = None,
    *,
    neg_mask: Tensor | None = None,
    temperature: float | Tensor = 0.05,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims=None,
    matryoshka_weights=None,
    cross_device: str = "gather",
    directions=DEFAULT_DIRECTIONS,
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
    false_negative_margin: float | None = None,
) -> Tensor:
    """Multiple negatives ranking loss = SimCSE supervised (Gao et al. 2021, eq. 5; Henderson et al. 2017).

    ``loss_i = -l_{i,i} + LSE_{c in C} l_ic`` over every anchor's positive and every valid
    hard negative of the batch (``C``), ``l = similarity / temperature``: sentence-transformers'
    ``MultipleNegativesRankingLoss`` with ``scale = 1 / temperature``. SimCSE supervised is
    ``Q = 1`` with the contradiction as the hard negative. With sentence-transformers 6's
    options the rows are :func:`mnrl_directions_loss`'s (not with ``neg_mask`` yet).

    Args:
        anchor: ``[B, d]`` queries, float16, bfloat16, float32 or float64 raw embeddings.
        positive: ``[B, d]``, each query's positive document.
        negatives: ``[B, d]`` (one hard negative each), ``[B, Q, d]``, or None (in-batch
            negatives only).
        neg_mask: ``[B, Q]`` bool or None: ``False`` marks a padded negative slot.
        {shared}

    Returns:
        {returns}

    Example:
        >>> import torch
        >>> from fastcl.losses import mnrl_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> q, d, n = (torch.randn(8, 32, generator=g) for _ in range(3))
        >>> mnrl_loss(q, d, n).shape
        torch.Size([])
        >>> mnrl_loss(q, d, n, directions=("query_to_doc", "doc_to_query"), reduction="none").shape
        torch.Size([8])
    """
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
    directions = check_mnrl_options(directions, partition_mode, hardness_mode, hardness_strength)
    margin = check_false_negative_margin(false_negative_margin)
    if not _mnrl_directions.is_plain(directions, partition_mode, hardness_mode, hardness_strength):
        if neg_mask is not None:
            raise ValueError("mnrl_loss: directions/hardness options do not take neg_mask yet")
        if margin is not None:
            raise ValueError(
                "mnrl_loss: false_negative_margin filters the query_to_doc rows only (no directions/hardness)"
            )
        st6 = dict(partition_mode=partition_mode, hardness_mode=hardness_mode, hardness_strength=hardness_strength)
        return mnrl_directions_loss(anchor, positive, negatives, directions=directions, **st6, **opts.kwargs())
    _checks.check_embeddings(anchor=anchor, positive=positive, negatives=negatives)
    _checks.check_rank("positive", positive, 2, "[B, d]")
    return structured_loss(
        "cross_entropy",
        anchor,
        positive.unsqueeze(1),
        _negatives_3d(negatives),
        None,
        neg_mask,
        opts,
        exclude_own=False,
        false_negative_margin=margin,
    )


@distributed.agree_on_errors
@document(*ST6_OPTIONS, *LSE_OPTIONS, extra=ST6_DOCS)
def mnrl_directions_loss(
    anchor: Tensor,
    positive: Tensor,
    negatives: Tensor | None = None,
    *,
    directions=DEFAULT_DIRECTIONS,
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
    temperature: float | Tensor = 0.05,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    similarity: str = "cos",
    process_group=None,
    matryoshka_dims=None,
    matryoshka_weights=None,
    cross_device: str = "gather",
) -> Tensor:
    """MNRL with sentence-transformers 6.2's ``directions``, ``partition_mode`` and hardness.

    Per query ``i`` (``q_i``, its document ``d_i``, ``D`` every document) the terms of the
    selected directions are ``query_to_doc``: ``l(q_i, x), x in D``; ``query_to_query``:
    ``l(q_i, q_j), j != i``; ``doc_to_query``: ``l(q_j, d_i)`` for every ``j``; ``doc_to_doc``:
    ``l(x, d_i)``, ``x in D`` not a document of query ``i``. ``"joint"``: ``loss_i = LSE(all
    selected terms) - l(q_i, d_i)``; ``"per_direction"``: the mean over directions of
    ``LSE(direction's terms) - l(q_i, d_i)``. Exactly sentence-transformers 6.2's
    ``MultipleNegativesRankingLoss`` (docs/losses.md, "Directions, partition, hardness").

    Args:
        anchor: ``[B, d]`` queries, float16, bfloat16, float32 or float64 raw embeddings.
        positive: ``[B, d]``, their documents.
        negatives: hard negatives ``[B, d]`` or ``[B, Q, d]``, or None.
        {shared}

    With a ``process_group`` every rank's queries, documents and negatives join every
    direction's candidates; rows stay this rank's (sentence-transformers'
    ``gather_across_devices=True``). The rows are combined after the primitive, so its calls
    run the recompute strategy (``strategy="fused"`` raises ``ValueError``).

    Returns:
        {returns}

    Example:
        >>> import torch
        >>> from fastcl.losses import mnrl_directions_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> q, d = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
        >>> gte = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
        >>> mnrl_directions_loss(q, d, directions=gte).shape
        torch.Size([])
    """
    directions = check_mnrl_options(directions, partition_mode, hardness_mode, hardness_strength)
    check_options(reduction, similarity, strategy, cross_device)
    _checks.check_embeddings(anchor=anchor, positive=positive, negatives=negatives)
    B, dim = check_matrix("anchor", anchor)
    _checks.check_rank("positive", positive, 2, "[B, d]")
    if tuple(positive.shape) != (B, dim):
        raise ValueError(f"positive must have shape [B={B}, d={dim}], got {tuple(positive.shape)}")
    matryoshka = _matryoshka.check(matryoshka_dims, matryoshka_weights, dim, compute_dtype(anchor.dtype))
    negatives = _negatives_3d(negatives)
    if negatives is not None:
        _checks.check_rank("negatives", negatives, 3, "[B, Q, d]")
        if negatives.shape[0] != B or negatives.shape[2] != dim:
            raise ValueError(f"negatives must have shape [B={B}, Q, d={dim}], got {tuple(negatives.shape)}")
        if negatives.shape[1] == 0:
            negatives = None
    tau = _checks.as_temperature(temperature, anchor)
    alpha = float(hardness_strength) if hardness_mode is not None else 0.0
    world = 1
    if process_group is not None:
        Q = 0 if negatives is None else negatives.shape[1]
        distributed.check_group(process_group)
        distributed.check_same_sizes(process_group, {"B": B, "Q": Q, "d": dim}, anchor.dtype)
        world = torch.distributed.get_world_size(process_group)

    with no_autocast(anchor):
        rows = _mnrl_directions.loss_rows(
            anchor,
            positive,
            negatives,
            tau,
            directions=directions,
            partition_mode=partition_mode,
            hardness_mode=hardness_mode,
            alpha=alpha,
            cosine=similarity == "cos",
            backend=backend,
            strategy=strategy,
            group=process_group,
            ring=cross_device == "ring",
            dims=None if matryoshka is None else matryoshka[0],
        )
        if matryoshka is not None:  # [K, B] -> sum_k w_k * rows_k
            weights = torch.tensor(matryoshka[1], dtype=rows.dtype, device=rows.device)
            rows = (weights[:, None] * rows).sum(0)
        if reduction == "none":
            return rows.to(anchor.dtype)
        # every query has its positive: every rank's B rows count
        every = torch.ones(B, dtype=torch.bool, device=anchor.device)
        valid = torch.tensor(world * B, dtype=rows.dtype, device=anchor.device)
        weights = row_weights(every, reduction, rows.dtype, world=world, valid_anchors=valid)
        return (rows * weights).sum().to(anchor.dtype)


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


@document("learn_temperature", *LSE_OPTIONS, *ST6_OPTIONS, "false_negative_margin", extra={**ST6_DOCS, **FILTER_DOCS})
class MNRLoss(TemperatureLoss):
    """Module form of :func:`mnrl_loss`: ``forward(anchor [B, d], positive [B, d], negatives=None, neg_mask=None)``.

    Args:
        {shared}
    """

    def __init__(
        self,
        temperature: float | Tensor = 0.05,
        *,
        directions=DEFAULT_DIRECTIONS,
        partition_mode: str = "joint",
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        false_negative_margin: float | None = None,
        **kw,
    ):
        super().__init__(temperature, **kw)
        self.directions = check_mnrl_options(directions, partition_mode, hardness_mode, hardness_strength)
        self.mnrl_options = dict(
            directions=self.directions,
            partition_mode=partition_mode,
            hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
            false_negative_margin=check_false_negative_margin(false_negative_margin),
        )

    def forward(self, anchor, positive, negatives=None, neg_mask=None) -> Tensor:
        return mnrl_loss(anchor, positive, negatives, neg_mask=neg_mask, **self.mnrl_options, **self._kw())


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
