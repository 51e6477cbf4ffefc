"""Supervised contrastive losses (Khosla et al. 2020, L_out): three ways to say who is positive.

* structured, ``supcon_loss(anchor, positives, negatives)``: each anchor's own positives and
  negatives, laid out as SupMPN's; the own positives stay in the denominator (Liao's SCL,
  her eq. 2, with ``similarity="dot", temperature=1.0``);
* labels, ``supcon_labels_loss(features, labels)`` (or ``supcon_loss(features, labels=y)``):
  SupContrast's / pytorch-metric-learning's form, positives = the other features with the
  same label (``supcon_labels.py``: how it stays fused);
* pool, ``supcon_pool_loss(anchor, candidates, pos_index)``: positives are indices into a
  shared candidate pool (Liao's in-batch "allpalln").

Formulas: docs/losses.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks, distributed
from .. import matryoshka as _matryoshka
from ..ops.contract import EPS, compute_dtype, empty_block, pool_tags
from ..ops.positive_logits import positive_logits
from ._shared import (
    LSE_OPTIONS,
    FusedCall,
    Options,
    TemperatureLoss,
    check_matrix,
    check_options,
    check_positives,
    document,
    fused_loss,
    no_autocast,
    structured_call,
    without_unused_anchors,
)
from .supcon_labels import LABELS_TEMPERATURE, supcon_labels_loss

__all__ = ["supcon_loss", "supcon_labels_loss", "supcon_pool_loss", "SupConLoss", "LABELS_TEMPERATURE"]

# the structured and pool forms' default, as every fastcl loss
TEMPERATURE = 0.05


@distributed.agree_on_errors
@document("pos_mask", "neg_mask", *LSE_OPTIONS)
def supcon_loss(
    anchor: Tensor,
    positives: Tensor | None = None,
    negatives: Tensor | None = None,
    *,
    pos_mask: Tensor | None = None,
    neg_mask: Tensor | None = None,
    temperature: float | Tensor | None = None,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims=None,
    matryoshka_weights=None,
    cross_device: str = "gather",
    labels: Tensor | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020, L_out; Liao 2021, eq. 2), structured or from labels.

    Structured form: ``loss_i = mean_k [-l_ik + LSE_{c in C} l_ic]`` over the valid own
    positives ``k`` of anchor ``i``, ``C`` every valid candidate of the batch, own positives
    included (Liao's SCL: ``similarity="dot", temperature=1.0``; a shared pool of
    candidates: :func:`supcon_pool_loss`). Labels form ``supcon_loss(features, labels=y)``:
    :func:`supcon_labels_loss`. As in SupContrast and pytorch-metric-learning the labels may
    come second, positionally (``supcon_loss(features, y)``): a 1-D tensor there, which can
    never be structured positives ``[B, P, d]``, is read as labels (and must be integer).

    Args:
        anchor: ``[B, d]`` float16, bfloat16, float32 or float64 raw embeddings (labels form:
            the features, ``[N, d]`` or ``[B, V, d]``).
        positives: ``[B, P, d]`` own positives (structured form), or labels (see above).
        negatives: ``[B, Q, d]`` hard negatives, or None.
        {shared}
        labels: ``[N]`` (or ``[B]``) integer class ids: the labels form.
        ref_emb: ``[M, d]`` reference embeddings (labels form only; with ``ref_labels``).
        ref_labels: ``[M]`` integer class ids of ``ref_emb``.

    ``temperature`` defaults to the form's: 0.05 (structured, as every fastcl loss) or 0.1
    (labels: pytorch-metric-learning's default, :data:`LABELS_TEMPERATURE`).

    Returns:
        {returns}

    Example:
        >>> import torch
        >>> from fastcl.losses import supcon_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> a, p, n = (torch.randn(8, *s, 32, generator=g) for s in ((), (3,), (3,)))
        >>> supcon_loss(a, p, n).shape
        torch.Size([])
        >>> x, y = torch.randn(16, 2, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        >>> torch.equal(supcon_loss(x, y), supcon_loss(x, labels=y, temperature=0.1))
        True
    """
    if labels is None and isinstance(positives, Tensor) and positives.dim() == 1:
        # loss(features, labels), as PML / SupContrast take it: 1-D is never structured positives
        # (and non-integer labels are refused by the labels check)
        labels, positives = positives, None
    if temperature is None:
        temperature = LABELS_TEMPERATURE if labels is not None else TEMPERATURE
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
    if labels is not None:
        if positives is not None or negatives is not None or pos_mask is not None or neg_mask is not None:
            raise ValueError("supcon_loss: give labels= or positives/negatives (and their masks), not both")
        return supcon_labels_loss(anchor, labels, ref_emb=ref_emb, ref_labels=ref_labels, **opts.kwargs())
    if positives is None:
        raise TypeError("supcon_loss needs positives (structured form) or labels= (labels form)")
    if ref_emb is not None or ref_labels is not None:
        raise ValueError("supcon_loss: ref_emb/ref_labels belong to the labels form (give labels=)")
    call = structured_call("cross_entropy", anchor, positives, negatives, pos_mask, neg_mask, opts, exclude_own=False)
    return fused_loss(call, opts)


# --------------------------------------------------------------------------- pool form


@distributed.agree_on_errors
@document(*LSE_OPTIONS)
def supcon_pool_loss(
    anchor: Tensor,
    candidates: Tensor,
    pos_index: Tensor,
    *,
    pos_mask: Tensor | None = None,
    cand_mask: Tensor | None = None,
    temperature: float | Tensor = TEMPERATURE,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims=None,
    matryoshka_weights=None,
    cross_device: str = "gather",
) -> Tensor:
    """Supervised contrastive loss against a shared candidate pool (Liao 2021, in-batch "allpalln").

    ``loss_i = mean_k [-l_{i, pos_index[i, k]} + LSE_{c valid} l_ic]``: every anchor sees every
    valid candidate once, and a candidate may be a positive of several anchors.

    Args:
        anchor: ``[B, d]`` float16, bfloat16, float32 or float64 raw embeddings.
        candidates: ``[N, d]``, the shared pool (same dtype and device).
        pos_index: ``[B, P]`` int32 or int64 indices into ``candidates``: anchor ``i``'s
            positives. A slot that ``pos_mask`` marks as padding is not read.
        pos_mask: ``[B, P]`` bool or None: ``False`` marks a padded positive slot.
        cand_mask: ``[N]`` bool or None: ``False`` marks a padded candidate (in no denominator,
            and no positive: a positive index that points at it is padding too).
        {shared}

    Returns:
        {returns}

    Example:
        >>> import torch
        >>> from fastcl.losses import supcon_pool_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> a, c = torch.randn(4, 32, generator=g), torch.randn(10, 32, generator=g)
        >>> supcon_pool_loss(a, c, torch.tensor([[0, 1], [2, 3], [4, 5], [6, 6]])).shape
        torch.Size([])
    """
    check_options(reduction, similarity, strategy, cross_device)
    _checks.check_embeddings(anchor=anchor, candidates=candidates)
    opts = Options(temperature, reduction, backend, strategy, process_group, similarity, cross_device=cross_device)
    if not isinstance(pos_index, Tensor):
        raise TypeError(f"pos_index must be a torch.Tensor of int64 indices [B, P], got {type(pos_index).__name__}")
    B, d = check_matrix("anchor", anchor)
    _checks.check_rank("candidates", candidates, 2, "[N, d]")
    _checks.check_rank("pos_index", pos_index, 2, "[B, P]")
    N = candidates.shape[0]
    matryoshka = _matryoshka.check(matryoshka_dims, matryoshka_weights, d, compute_dtype(anchor.dtype))
    if candidates.shape[1] != d or pos_index.shape[0] != B or N == 0 or pos_index.shape[1] == 0:
        raise ValueError(
            f"expected anchor [B, d], candidates [N>0, d], pos_index [B, P>0]; got "
            f"{tuple(anchor.shape)}, {tuple(candidates.shape)}, {tuple(pos_index.shape)}"
        )
    if pos_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pos_index must be an integer tensor, got {pos_index.dtype}")
    P = pos_index.shape[1]
    _checks.check_mask("pos_mask", pos_mask, (B, P), anchor.device)
    _checks.check_mask("cand_mask", cand_mask, (N,), anchor.device)
    if pos_index.device.type == "cpu":  # (on a GPU this check would be a host sync per call)
        read = pos_index if pos_mask is None else pos_index[pos_mask.cpu()]  # padded slots are not read
        if read.numel() and (read.min() < 0 or read.max() >= N):
            raise ValueError(
                f"pos_index must be in [0, {N}) where pos_mask is True, got values in "
                f"[{int(read.min())}, {int(read.max())}]"
            )
    pos_index = pos_index.to(device=anchor.device, dtype=torch.int64)
    if pos_mask is not None:  # a padded slot (often -1) points at row 0, read as zeros
        pos_index = pos_index.masked_fill(~pos_mask, 0)
    if cand_mask is not None:  # a positive that is not a valid candidate is no positive
        valid = cand_mask[pos_index]
        pos_mask = valid if pos_mask is None else pos_mask & valid
    tau = check_positives(anchor, pos_mask, process_group, temperature)
    cosine = similarity == "cos"
    with no_autocast(anchor):
        anchor = without_unused_anchors(anchor, pos_mask)
        pos = candidates[pos_index]
        prefixes = (d,) if matryoshka is None else matryoshka[0]  # [K, B, P] logits with dims
        per_prefix = [
            positive_logits(anchor[:, :m], pos[..., :m], tau, cosine=cosine, eps=EPS, pos_mask=pos_mask)
            for m in prefixes
        ]
        pos_logits = per_prefix[0] if matryoshka is None else torch.stack(per_prefix)
        empty, empty_tags = empty_block(anchor)
        blocks, tags = (candidates, empty), (pool_tags(N, cand_mask, device=anchor.device), empty_tags)
        spec = opts.spec("cross_entropy", tags, anchor, matryoshka, pos_mask=pos_mask)
        return fused_loss(FusedCall(anchor, blocks, tau, spec, {"B": B, "N": N, "d": d}, pos_logits), opts)


# --------------------------------------------------------------------------- module


@document("learn_temperature", *LSE_OPTIONS)
class SupConLoss(TemperatureLoss):
    """Module form of :func:`supcon_loss`.

    ``forward(anchor [B, d], positives [B, P, d], negatives=None [B, Q, d], pos_mask=None,
    neg_mask=None)`` or, labels form, ``forward(features, labels=y, ref_emb=None,
    ref_labels=None)`` (also ``forward(features, y)``, as pytorch-metric-learning's and
    SupContrast's modules). Without a ``temperature`` each call takes its form's default, as
    :func:`supcon_loss`: 0.05 structured, 0.1 labels (pytorch-metric-learning's ``SupConLoss()``).

    Args:
        {shared}
    """

    def __init__(self, temperature: float | Tensor | None = None, **kw):
        if temperature is None and kw.get("learn_temperature"):
            raise ValueError(
                "SupConLoss(learn_temperature=True) needs a starting temperature: the default depends on the "
                "form of the call (0.05 structured, 0.1 labels)"
            )
        super().__init__(TEMPERATURE if temperature is None else temperature, **kw)  # checks a value
        if temperature is None:
            self._fixed_temperature = None  # each call takes its form's default (supcon_loss)

    def _temperature_repr(self) -> str:
        if not self.learn_temperature and self._fixed_temperature is None:
            return "None (0.05 structured, 0.1 labels)"
        return super()._temperature_repr()

    def forward(
        self,
        anchor,
        positives=None,
        negatives=None,
        pos_mask=None,
        neg_mask=None,
        *,
        labels=None,
        ref_emb=None,
        ref_labels=None,
    ) -> Tensor:
        labels_form = dict(labels=labels, ref_emb=ref_emb, ref_labels=ref_labels)
        return supcon_loss(
            anchor, positives, negatives, pos_mask=pos_mask, neg_mask=neg_mask, **labels_form, **self._kw()
        )
