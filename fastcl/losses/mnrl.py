"""Multiple negatives ranking (MNRL / SimCSE supervised); InfoNCE and EdaCSE build on it (``infonce.py``).

All are supervised contrastive with one positive per anchor: ``loss_i = -l_i,pos(i) +
LSE_{c in C} l_ic`` over the batch's candidates ``C``. Plain MNRL runs the structured layout
(``_shared.structured_call``); sentence-transformers 6's ``directions``, ``partition_mode``
and hardness options combine several primitive calls per row (``_mnrl_directions``).
Formulas: docs/losses.md.
"""

from __future__ import annotations

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
    fused_loss,
    no_autocast,
    row_weights,
    structured_call,
)
from .gist import GIST_DOCS, check_false_negative_margin

__all__ = [
    "mnrl_loss",
    "mnrl_directions_loss",
    "MNRLoss",
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
    call = structured_call(
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
    return fused_loss(call, opts)


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
