"""Supervised contrastive loss from class labels (SupContrast's L_out; pytorch-metric-learning's
``SupConLoss``): ``supcon_labels_loss(features, labels)``, also reached as
``supcon_loss(features, labels=y)``.

How it stays fused without a ``N x N`` mask, on every backend: the denominator is the
primitive with the anchors as their own candidate block and the self-exclusion tag ``i`` on
candidate ``i`` (with a reference set: ``TAG_ALL``, nothing is "self"); the mean positive
logit is linear in the candidates, so with ``S_y`` the sum of the normalised candidates of
label ``y`` (an ``index_add`` into ``[num_labels, d]``)::

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
from ..ops.contract import EPS, TAG_ALL, compute_dtype, empty_block
from ..ops.contrastive import LossSpec, contrastive_loss
from ..ops.normalize import normalize_rows
from ..ops.ring_labels import supcon_labels_ring
from ._shared import LSE_OPTIONS, check_options, document, no_autocast, row_weights

__all__ = ["supcon_labels_loss", "LABELS_TEMPERATURE"]

# the labels form's default temperature: pytorch-metric-learning's SupConLoss default
LABELS_TEMPERATURE = 0.1


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
        spec = LossSpec(
            "cross_entropy", (tags, empty_tags), reduction, weights, cosine=cosine, pos_mask=has_pos[:, None],
            dims=None if matryoshka is None else matryoshka[0],
            dim_weights=_matryoshka.weight_tensor(matryoshka, features), strategy=strategy, backend=backend,
        )  # fmt: skip
        return contrastive_loss(features, (cands, empty), tau, spec, pos_logits)
