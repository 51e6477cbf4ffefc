"""Supervised contrastive losses (Khosla et al. 2020, L_out): three ways to say who is positive.

* structured, ``supcon_loss(anchor, positives, negatives)``: each anchor's own positives and
  negatives, laid out as SupMPN's; the own positives stay in the denominator (Liao's SCL,
  her eq. 2, with ``similarity="dot", temperature=1.0``);
* labels, ``supcon_labels_loss(features, labels)`` (or ``supcon_loss(features, labels=y)``):
  SupContrast's / pytorch-metric-learning's form, positives = the other features with the
  same label;
* pool, ``supcon_pool_loss(anchor, candidates, pos_index)``: positives are indices into a
  shared candidate pool (Liao's in-batch "allpalln").

How the labels form stays fused without a ``N x N`` mask, on every backend: the
denominator is the primitive with the anchors as their own candidate block and the
self-exclusion tag ``i`` on candidate ``i`` (with a reference set: ``TAG_ALL``, nothing is
"self"); the mean positive logit is linear in the candidates, so with ``S_y`` the sum of
the normalised candidates of label ``y`` (an ``index_add`` into ``[num_labels, d]``)::

    mean_{p in P(i)} l_ip = <a_i, S_{y_i} - [self] c_i> / (tau * |P(i)|)

which autograd differentiates at O((B + N) * d) cost, and which enters the primitive's head
as a precomputed, differentiable one-column positive logit. Formulas and where
pytorch-metric-learning differs: docs/losses.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks, distributed
from .. import matryoshka as _matryoshka
from ..ops.contract import EPS, TAG_ALL, compute_dtype, empty_block, pool_tags
from ..ops.contrastive import contrastive_loss
from ..ops.normalize import normalize_rows
from ..ops.positive_logits import positive_logits
from ..ops.ring_labels import supcon_labels_ring
from ._shared import (
    LSE_OPTIONS,
    Options,
    TemperatureLoss,
    check_matrix,
    check_options,
    check_positives,
    document,
    fused_loss,
    no_autocast,
    row_weights,
    structured_loss,
    without_unused_anchors,
)

__all__ = ["supcon_loss", "supcon_labels_loss", "supcon_pool_loss", "SupConLoss", "LABELS_TEMPERATURE"]

# the labels form's default temperature: pytorch-metric-learning's SupConLoss default
LABELS_TEMPERATURE = 0.1
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
    return structured_loss("cross_entropy", anchor, positives, negatives, pos_mask, neg_mask, opts, exclude_own=False)


# --------------------------------------------------------------------------- labels form


def _check_labels(name: str, labels, n: int, device: torch.device) -> Tensor:
    if not isinstance(labels, Tensor):
        raise TypeError(f"{name} must be an integer tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (class ids), got {labels.dtype}")
    if labels.dim() != 1 or labels.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}], got {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"{name} is on {labels.device} but the embeddings are on {device}")
    return labels.to(torch.int64)


def _flatten_views(features: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, V, d]`` -> ``[V*B, d]`` view-major (all first views, then all second views), as
    SupContrast's ``torch.cat(torch.unbind(features, dim=1))``; labels repeat per view."""
    B, V, d = features.shape
    return features.transpose(0, 1).reshape(V * B, d), labels.repeat(V)


@distributed.agree_on_errors
@document(*LSE_OPTIONS)
def supcon_labels_loss(
    features: Tensor,
    labels: Tensor,
    *,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    temperature: float | Tensor = LABELS_TEMPERATURE,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    similarity: str = "cos",
    process_group=None,
    matryoshka_dims=None,
    matryoshka_weights=None,
    cross_device: str = "gather",
) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020, L_out) with positives from class labels.

    Every feature is an anchor; its candidates are all *other* features (or the reference
    set), its positives ``P(i)`` the candidates with the same label (SupContrast /
    pytorch-metric-learning): ``loss_i = LSE_{c != i} l_ic - mean_{p in P(i)} l_ip``. An
    anchor without a positive (its label seen once) contributes nothing and is left out of
    the mean (pytorch-metric-learning's reducer); no positive at all raises ``ValueError``.
    SupContrast's ``SupConLoss(temperature=t, base_temperature=t)`` on normalised features is
    ``similarity="dot", temperature=t`` (or ``"cos"`` on raw features).

    Args:
        features: ``[N, d]``, or ``[B, V, d]`` (V views per sample, flattened view-major as
            SupContrast does: row ``v * B + b`` is view ``v`` of sample ``b``); float16,
            bfloat16, float32 or float64.
        labels: ``[N]`` (or ``[B]``) integer class ids.
        ref_emb: optional reference set ``[M, d]`` (pytorch-metric-learning's): the candidates
            are then the reference set and nothing is excluded as "self". Not with a
            ``process_group`` yet.
        ref_labels: ``[M]`` integer class ids of ``ref_emb`` (give both or neither).
        {shared}

    ``reduction="none"`` returns ``[N]`` (``[V*B]`` in the flattened order). Memory
    O((N + M) * d) beyond the inputs on the fused backends; no ``N x N`` mask or logits.

    Returns:
        {returns}

    Example:
        >>> import torch
        >>> from fastcl.losses import supcon_labels_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> x, y = torch.randn(16, 2, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        >>> supcon_labels_loss(x, y, temperature=0.1).shape
        torch.Size([])
        >>> supcon_labels_loss(x, y, reduction="none").shape
        torch.Size([32])
    """
    check_options(reduction, similarity, strategy, cross_device)
    _checks.check_embeddings(features=features, ref_emb=ref_emb)
    if features.dim() not in (2, 3):
        raise ValueError(f"features must have shape [N, d] or [B, V, d], got {tuple(features.shape)}")
    if features.numel() == 0:
        raise ValueError(f"features must be non-empty, got shape {tuple(features.shape)}")
    labels = _check_labels("labels", labels, features.shape[0], features.device)
    if features.dim() == 3:
        features, labels = _flatten_views(features, labels)
    N, d = features.shape
    matryoshka = _matryoshka.check(matryoshka_dims, matryoshka_weights, d, compute_dtype(features.dtype))
    if (ref_emb is None) != (ref_labels is None):
        raise ValueError("give ref_emb and ref_labels together (or neither)")
    self_set = ref_emb is None
    if ref_emb is None:
        cands, cand_labels = features, labels
    else:
        _checks.check_rank("ref_emb", ref_emb, 2, "[M, d]")
        if ref_emb.shape[0] == 0 or ref_emb.shape[1] != d:
            raise ValueError(f"ref_emb must have shape [M > 0, d={d}], got {tuple(ref_emb.shape)}")
        cands = ref_emb
        cand_labels = _check_labels("ref_labels", ref_labels, ref_emb.shape[0], features.device)
    tau = _checks.as_temperature(temperature, features)
    cosine = similarity == "cos"
    cd = compute_dtype(features.dtype)
    dev = features.device
    world, offset = 1, 0
    if process_group is not None:
        if not self_set:
            raise NotImplementedError("supcon_labels_loss: ref_emb with process_group is not supported yet")
        distributed.check_group(process_group)
        if cross_device == "ring":  # fastcl.ops.ring_labels: label sums and the LSE by rings
            with no_autocast(features):
                return supcon_labels_ring(
                    features,
                    labels,
                    tau,
                    reduction=reduction,
                    backend=backend,
                    cosine=cosine,
                    dims=None if matryoshka is None else matryoshka[0],
                    dim_weights=_matryoshka.weight_tensor(matryoshka, features),
                    group=process_group,
                    strategy=strategy,
                )
        distributed.check_same_sizes(process_group, {"N": N, "d": d}, features.dtype)
        world, offset = dist.get_world_size(process_group), dist.get_rank(process_group) * N
        cands = distributed.all_gather_with_grad(features, process_group)  # [W*N, d], rank-major
        gathered = [torch.empty_like(labels) for _ in range(world)]
        dist.all_gather(gathered, labels.contiguous(), group=process_group)
        cand_labels = torch.cat(gathered)

    # dense label ids shared by anchors and candidates: S is [num_labels, d], never [N, M]
    if self_set and world == 1:
        uniq, anchor_id = torch.unique(labels, return_inverse=True)
        cand_id = anchor_id
    elif self_set:  # the anchors are rows offset .. offset + N - 1 of the gathered candidates
        uniq, cand_id = torch.unique(cand_labels, return_inverse=True)
        anchor_id = cand_id[offset : offset + N]
    else:
        uniq, ids = torch.unique(torch.cat([labels, cand_labels]), return_inverse=True)
        anchor_id, cand_id = ids[:N], ids[N:]
    num_labels = uniq.shape[0]
    counts = torch.bincount(cand_id, minlength=num_labels)
    num_pos = counts[anchor_id] - (1 if self_set else 0)  # |P(i)|
    has_pos = num_pos > 0
    if world == 1:
        _checks.check_some_positive(has_pos, "no anchor has a positive (no label occurs twice among the candidates)")
        weights = row_weights(has_pos, reduction, cd)
    else:
        # every candidate is some rank's anchor: the global count of anchors with a positive
        # is known here without a collective, and every rank raises (or not) alike
        valid_global = (counts[cand_id] - 1 > 0).sum()
        if not bool(valid_global > 0):
            raise ValueError("no anchor of any rank has a positive (no label repeats in the global batch)")
        weights = row_weights(has_pos, reduction, cd, world=world, valid_anchors=valid_global.to(cd))

    def unit(x: Tensor) -> Tensor:
        """``x`` in the compute dtype, normalised with scale-free norms under ``"cos"``
        (``m * |x / m|``: no sum of squares to overflow), by autograd."""
        return normalize_rows(x, EPS, True)[0] if cosine else x.to(cd)

    def mean_pos(m: int) -> Tensor:
        """``[N]`` mean positive logit on the first ``m`` coordinates, O((N + M) m):
        anchors . (label sum of candidates - self)."""
        a_hat = unit(features[:, :m])
        c_hat = a_hat if self_set and world == 1 else unit(cands[:, :m])
        label_sum = torch.zeros(num_labels, m, dtype=cd, device=dev).index_add(0, cand_id, c_hat)
        pos_sum = label_sum[anchor_id]
        if self_set:
            pos_sum = pos_sum - c_hat[offset : offset + N]
        mean = torch.linalg.vecdot(a_hat, pos_sum) / (num_pos.clamp_min(1).to(cd) * tau.to(cd))
        return torch.where(has_pos, mean, torch.zeros_like(mean))

    with no_autocast(features):
        # one positive column per anchor; [K, N, 1] with matryoshka dims, one per prefix
        pos_logits = (
            mean_pos(d)[:, None] if matryoshka is None else torch.stack([mean_pos(m) for m in matryoshka[0]])[..., None]
        )
        # denominator: the fused masked LSE, each anchor left out of its own row (candidate
        # offset + i is anchor i; other ranks' rows and a reference set: TAG_ALL)
        tags = torch.full((cands.shape[0],), TAG_ALL, dtype=torch.int32, device=dev)
        if self_set:
            tags[offset : offset + N] = torch.arange(N, dtype=torch.int32, device=dev)
        empty, empty_tags = empty_block(features)
        return contrastive_loss(
            features,
            (cands, empty),
            (tags, empty_tags),
            tau,
            kind="cross_entropy",
            positives=None,
            pos_logits=pos_logits,
            pos_mask=has_pos[:, None],
            weights=weights,
            reduction=reduction,
            cosine=cosine,
            eps=EPS,
            backend=backend,
            dims=None if matryoshka is None else matryoshka[0],
            dim_weights=_matryoshka.weight_tensor(matryoshka, features),
            strategy=strategy,
        )


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
        return fused_loss(
            "cross_entropy",
            anchor,
            blocks,
            tags,
            tau,
            opts,
            sizes={"B": B, "N": N, "d": d},
            pos_mask=pos_mask,
            matryoshka=matryoshka,
            pos_logits=pos_logits,
        )


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
