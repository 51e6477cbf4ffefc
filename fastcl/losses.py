"""fastcl's public losses: plain functions and ``nn.Module`` wrappers (formulas: docs/losses.md).

Every LSE loss is a thin composition over one fused primitive (docs/design.md) whose fused
backends never build the ``[B, N]`` logits. Embeddings are raw (fp16, bf16, fp32 or fp64,
one dtype; cosine similarity normalises inside and the gradient flows to the raw tensors);
masks are bool with ``False`` marking padding. The loss comes back in the input dtype,
accumulated in float32 (float64 for float64 inputs).

Common keyword arguments:
    temperature: float or 0-d tensor > 0 (``logit = similarity / temperature``, finite in
        the compute dtype); a tensor that requires grad receives its gradient.
        sentence-transformers' ``scale`` is ``1 / temperature``.
    reduction: ``"mean"`` (over anchors with a valid positive), ``"sum"``, or ``"none"``
        (``[B]``, zeros for anchors without a positive).
    backend: ``"auto"`` (``FASTCL_BACKEND`` or the best available), ``"reference"``,
        ``"torch"``, ``"cpp"``, ``"triton"``, ``"cuda"``. An explicit backend that cannot
        take the inputs raises ``BackendUnavailableError`` saying why.
    process_group: ``torch.distributed`` group: every rank's candidates join every
        anchor's denominator, and DDP's gradient averaging gives exactly the global-batch
        loss's gradient; all ranks pass the same shapes. See ``fastcl.distributed``.
    similarity: ``"cos"`` (default) or ``"dot"`` (raw dot products, Liao's released code).
    matryoshka_dims: None, or distinct ints in ``1..d`` (e.g. ``(768, 512, 256, 128, 64)``):
        the loss is ``sum_k w_k * loss(embeddings[..., :dims[k]])``, sentence-transformers'
        ``MatryoshkaLoss`` (each prefix normalised by its own norm with ``"cos"``), in one
        fused pass over ``d`` (:mod:`fastcl.matryoshka`). The shape of the result is unchanged.
    matryoshka_weights: None (all 1) or one finite float ``w_k`` per dim.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from . import _checks, distributed
from . import matryoshka as _matryoshka
from .losses_mnrl import check_options as _check_mnrl_options
from .losses_mnrl import is_default as _mnrl_is_default
from .losses_mnrl import mnrl_directions_loss
from .losses_supcon import LABELS_TEMPERATURE, supcon_labels_loss
from .ops.contract import EPS, OwnPositives, compute_dtype, empty_block, pool_tags, structured_tags
from .ops.contrastive import contrastive_loss
from .ops.dispatch import NAMES as BACKENDS
from .ops.head import reduction_weights
from .ops.normalize import normalize_backward, normalize_rows
from .ops.positive_logits import positive_logits

__all__ = [
    "supmpn_loss",
    "supcon_loss",
    "supcon_labels_loss",
    "mnrl_directions_loss",
    "mnrl_loss",
    "infonce_loss",
    "edacse_loss",
    "supcon_pool_loss",
    "grouped_cosine_loss",
    "gclsr_loss",
    "SupMPNLoss",
    "SupConLoss",
    "MNRLoss",
    "InfoNCELoss",
    "EdaCSELoss",
    "GroupedCosineLoss",
    "GCLSRLoss",
]

OWN_POSITIVES = ("exclude", "zero_logit")


def _no_autocast(t: Tensor):
    # The fused ops choose their own precision (float32 accumulation); autocast must not
    # silently re-cast the matrix products inside them.
    if torch.is_autocast_enabled(t.device.type):
        return torch.autocast(device_type=t.device.type, enabled=False)
    return nullcontext()


def _options(temperature, reduction, backend, process_group, similarity, dims=None, weights=None) -> dict:
    """The keyword arguments every LSE loss passes on unchanged."""
    return dict(
        temperature=temperature,
        reduction=reduction,
        backend=backend,
        process_group=process_group,
        similarity=similarity,
        matryoshka_dims=dims,
        matryoshka_weights=weights,
    )


def _check_options(reduction: str, similarity: str) -> None:
    _checks.check_choice("reduction", reduction, _checks.REDUCTIONS)
    _checks.check_choice("similarity", similarity, _checks.SIMILARITIES)
    _checks.requested_strategy()


def _check_positives(anchor: Tensor, pos_mask: Tensor | None, process_group, temperature) -> Tensor:
    """Some anchor has a valid positive (with a group the check is global: a rank may have
    none); returns the temperature as a tensor."""
    if process_group is None:
        _checks.check_some_positive(pos_mask)
    else:
        distributed.check_group(process_group)
    return _checks.as_temperature(temperature, anchor)


def _without_unused_anchors(anchor: Tensor, pos_mask: Tensor | None) -> Tensor:
    """``anchor`` with the rows of anchors that have no valid positive read as zeros: like a
    padded slot, whatever they hold (NaN, Inf) reaches no value and no gradient (docs/losses.md)."""
    if pos_mask is None:
        return anchor
    return torch.where(pos_mask.any(1, keepdim=True), anchor, anchor.new_zeros(()))


def _fused_loss(
    kind, anchor, blocks, tags, tau, *, sizes, pos_mask, own_count=None, pos_logits=None, log_extra=None, padded=True,
    **opts,
):  # fmt: skip
    """Gather the candidate set (this rank's, or every rank's: ``fastcl.distributed``) and run
    the fused loss. Own positives are ``own_count`` rows per anchor in block 0 (from where this
    rank's candidates start) or the given ``pos_logits``; ``opts``: :func:`_options` less the
    temperature, optionally ``matryoshka`` (checked dims, weights)."""
    reduction, process_group, matryoshka = opts["reduction"], opts["process_group"], opts.get("matryoshka")
    dev, cd = anchor.device, compute_dtype(anchor.dtype)
    has_pos = torch.ones(anchor.shape[0], dtype=torch.bool, device=dev) if pos_mask is None else pos_mask.any(1)
    if process_group is None:
        weights, offset = reduction_weights(has_pos, reduction, cd), 0
    else:
        g = distributed.gather_candidates(
            blocks,
            tags,
            has_pos,
            sizes=sizes,
            reduction=reduction,
            weight_dtype=cd,
            check_positive=pos_mask is not None,
            group=process_group,
        )
        blocks, tags, weights, offset = g.blocks, g.tags, g.weights, g.offset
    own = None if own_count is None else OwnPositives(offset, own_count)
    return contrastive_loss(
        anchor,
        blocks,
        tags,
        tau,
        kind=kind,
        positives=own,
        pos_logits=pos_logits,
        pos_mask=pos_mask,
        weights=weights,
        reduction=reduction,
        cosine=opts["similarity"] == "cos",
        eps=EPS,
        log_extra=log_extra,
        backend=opts["backend"],
        dims=None if matryoshka is None else matryoshka[0],
        dim_weights=_matryoshka.weight_tensor(matryoshka, anchor),
        padded=padded or process_group is not None,  # other ranks' candidates may carry padding
    )


def _matrix(name: str, t: Tensor, layout: str = "[B, d]") -> tuple[int, int]:
    """The shape of ``t``, checked to be a non-empty matrix."""
    _checks.check_rank(name, t, 2, layout)
    if 0 in t.shape:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(t.shape)}")
    return tuple(t.shape)


def _slots(name: str, t: Tensor, slot: str, B: int, d: int) -> int:
    """The slot count of ``t``, checked to be ``[B, slots, d]``."""
    _checks.check_rank(name, t, 3, f"[B, {slot}, d]")
    if t.shape[0] != B or t.shape[2] != d:
        raise ValueError(f"{name} must have shape [B={B}, {slot}, d={d}], got {tuple(t.shape)}")
    return t.shape[1]


def _lse_loss(kind, anchor, positives, negatives, pos_mask, neg_mask, *, exclude_own, zero_logit_own=False, **opts):
    """The structured layout shared by SupMPN, SupCon, MNRL and InfoNCE (``opts``: :func:`_options`)."""
    _check_options(opts["reduction"], opts["similarity"])
    _checks.check_embeddings(anchor=anchor, positives=positives, negatives=negatives)
    B, d = _matrix("anchor", anchor)
    matryoshka = _matryoshka.check(opts.pop("matryoshka_dims"), opts.pop("matryoshka_weights"), d)
    P = _slots("positives", positives, "P", B, d)
    if P == 0:
        raise ValueError("positives has P = 0: every anchor needs at least one positive slot")
    if negatives is None and neg_mask is not None:
        raise ValueError("neg_mask given without negatives")
    Q = 0 if negatives is None else _slots("negatives", negatives, "Q", B, d)
    _checks.check_mask("pos_mask", pos_mask, (B, P), anchor.device)
    _checks.check_mask("neg_mask", neg_mask, (B, Q), anchor.device)
    tau = _check_positives(anchor, pos_mask, opts["process_group"], opts.pop("temperature"))
    dev = anchor.device

    with _no_autocast(anchor):
        anchor = _without_unused_anchors(anchor, pos_mask)
        pos_tags = structured_tags(B, P, pos_mask, device=dev, exclude_owner=exclude_own)
        if Q:
            neg_block = negatives.reshape(B * Q, d)
            neg_tags = structured_tags(B, Q, neg_mask, device=dev, exclude_owner=False)
        else:
            neg_block, neg_tags = empty_block(anchor)
        log_extra = None
        if zero_logit_own:
            count = torch.full((B,), P, device=dev) if pos_mask is None else pos_mask.sum(1)
            log_extra = (count - 1).clamp_min(0).to(compute_dtype(anchor.dtype)).log()
        blocks, tags = (positives.reshape(B * P, d), neg_block), (pos_tags, neg_tags)
        sizes = {"B": B, "P": P, "Q": Q, "d": d}
        own = dict(own_count=P, log_extra=log_extra, matryoshka=matryoshka)
        padded = pos_mask is not None or neg_mask is not None  # no mask: no padding tag anywhere
        return _fused_loss(
            kind, anchor, blocks, tags, tau, sizes=sizes, pos_mask=pos_mask, padded=padded, **own, **opts
        )


# --------------------------------------------------------------------------- functions


@distributed.agree_on_errors
def supmpn_loss(
    anchor: Tensor,
    positives: Tensor,
    negatives: Tensor | None = None,
    *,
    pos_mask: Tensor | None = None,
    neg_mask: Tensor | None = None,
    temperature: float | Tensor = 0.05,
    reduction: str = "mean",
    backend: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims: tuple[int, ...] | None = None,
    matryoshka_weights: tuple[float, ...] | None = None,
    own_positives: str = "exclude",
) -> Tensor:
    """SupMPN (Dehghan & Amasyali 2022, eq. 7): several positives and hard negatives per anchor.

    ``loss_i = mean_k [-l_ik + log(exp(l_ik) + R_i)]`` over valid own positives ``k``, where
    ``R_i`` sums ``exp(l_ic)`` over every valid candidate except i's own positives.
    ``own_positives="zero_logit"`` reproduces the authors' released code, which keeps the
    anchor's *other* own positives in ``R_i`` with logit 0 (adding ``P_i - 1``).

    Args:
        anchor: ``[B, d]``. positives: ``[B, P, d]``. negatives: ``[B, Q, d]`` or None.
        pos_mask, neg_mask: ``[B, P]`` / ``[B, Q]`` bool, ``False`` = padding.
        The other arguments: module docstring. Returns a 0-d loss (``[B]`` for ``"none"``).

    Example::

        >>> a, p, n = torch.randn(8, 32), torch.randn(8, 5, 32), torch.randn(8, 5, 32)
        >>> supmpn_loss(a, p, n, temperature=0.05)
    """
    _checks.check_choice("own_positives", own_positives, OWN_POSITIVES)
    opts = _options(temperature, reduction, backend, process_group, similarity, matryoshka_dims, matryoshka_weights)
    zero_logit = own_positives == "zero_logit"
    return _lse_loss(
        "supmpn", anchor, positives, negatives, pos_mask, neg_mask, exclude_own=True, zero_logit_own=zero_logit, **opts
    )


def _are_labels(t) -> bool:
    """A 1-D integer tensor: class labels, never structured positives ``[B, P, d]``."""
    return isinstance(t, Tensor) and t.dim() == 1 and not t.is_floating_point() and not t.is_complex()


@distributed.agree_on_errors
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
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims: tuple[int, ...] | None = None,
    matryoshka_weights: tuple[float, ...] | None = None,
    labels: Tensor | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020, L_out; Liao's SCL).

    Structured form (args as :func:`supmpn_loss`): ``loss_i = mean_k [ -l_ik + LSE_{c in C}
    l_ic ]`` over valid own positives ``k``, ``C`` every valid candidate, own positives
    included (Liao: ``similarity="dot", temperature=1.0``; shared pool: :func:`supcon_pool_loss`).
    Labels form ``supcon_loss(features, labels=y, ref_emb=None, ref_labels=None)``, features
    ``[N, d]`` or ``[B, V, d]`` and positives = same label (SupContrast / pytorch-metric-learning):
    :func:`fastcl.losses_supcon.supcon_labels_loss`. As in those libraries the labels may come
    second, positionally (``supcon_loss(features, y)``): a 1-D integer tensor there, which can
    never be structured positives ``[B, P, d]``, is read as labels.

    ``temperature`` defaults to the form's: 0.05 (structured, as every fastcl loss) or 0.1
    (labels, pytorch-metric-learning's default and :func:`~fastcl.losses_supcon.supcon_labels_loss`'s).

    Example::

        >>> supcon_loss(torch.randn(8, 32), torch.randn(8, 3, 32), torch.randn(8, 3, 32))
    """
    if labels is None and _are_labels(positives):  # loss(features, labels), as PML / SupContrast take it
        labels, positives = positives, None
    if temperature is None:
        temperature = LABELS_TEMPERATURE if labels is not None else 0.05
    opts = _options(temperature, reduction, backend, process_group, similarity, matryoshka_dims, matryoshka_weights)
    if labels is not None:
        if positives is not None or negatives is not None or pos_mask is not None or neg_mask is not None:
            raise ValueError("supcon_loss: give labels= or positives/negatives (and their masks), not both")
        return supcon_labels_loss(anchor, labels, ref_emb=ref_emb, ref_labels=ref_labels, **opts)
    if positives is None:
        raise TypeError("supcon_loss needs positives (structured form) or labels= (labels form)")
    if ref_emb is not None or ref_labels is not None:
        raise ValueError("supcon_loss: ref_emb/ref_labels belong to the labels form (give labels=)")
    return _lse_loss("supcon", anchor, positives, negatives, pos_mask, neg_mask, exclude_own=False, **opts)


@distributed.agree_on_errors
def mnrl_loss(
    anchor: Tensor,
    positive: Tensor,
    negatives: Tensor | None = None,
    *,
    neg_mask: Tensor | None = None,
    temperature: float | Tensor = 0.05,
    reduction: str = "mean",
    backend: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims: tuple[int, ...] | None = None,
    matryoshka_weights: tuple[float, ...] | None = None,
    directions=("query_to_doc",),
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
) -> Tensor:
    """Multiple negatives ranking loss = SimCSE supervised (Gao et al. 2021; SBERT's MNRL).

    ``loss_i = -l_{i,i} + LSE_c l_ic`` over every positive and every valid negative of the
    batch; SimCSE supervised is ``Q = 1`` with the contradiction as hard negative.
    ``directions``, ``partition_mode``, ``hardness_mode`` and ``hardness_strength`` are
    sentence-transformers 6's, same semantics (docs/losses.md); they do not take ``neg_mask`` yet.

    Args:
        anchor: ``[B, d]``. positive: ``[B, d]``. negatives: ``[B, d]`` (one hard negative
        each) or ``[B, Q, d]``, or None (in-batch negatives only). neg_mask: ``[B, Q]`` bool.

    Example::

        >>> mnrl_loss(torch.randn(8, 32), torch.randn(8, 32), torch.randn(8, 32))
    """
    opts = _options(temperature, reduction, backend, process_group, similarity, matryoshka_dims, matryoshka_weights)
    directions = _check_mnrl_options(directions, partition_mode, hardness_mode, hardness_strength)
    if not _mnrl_is_default(directions, partition_mode, hardness_mode, hardness_strength):
        if neg_mask is not None:
            raise ValueError("mnrl_loss: directions/hardness options do not take neg_mask yet")
        mnrl = dict(partition_mode=partition_mode, hardness_mode=hardness_mode, hardness_strength=hardness_strength)
        return mnrl_directions_loss(anchor, positive, negatives, directions=directions, **mnrl, **opts)
    _checks.check_embeddings(anchor=anchor, positive=positive, negatives=negatives)
    _checks.check_rank("positive", positive, 2, "[B, d]")
    if negatives is not None and negatives.dim() == 2:
        negatives = negatives.unsqueeze(1)
    return _lse_loss("supcon", anchor, positive.unsqueeze(1), negatives, None, neg_mask, exclude_own=False, **opts)


@distributed.agree_on_errors
def infonce_loss(
    anchor: Tensor,
    positive: Tensor,
    *,
    temperature: float | Tensor = 0.05,
    symmetric: bool = False,
    reduction: str = "mean",
    backend: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims: tuple[int, ...] | None = None,
    matryoshka_weights: tuple[float, ...] | None = None,
) -> Tensor:
    """InfoNCE / SimCSE unsupervised: row ``i`` of ``anchor x positive`` logits, target ``i``.

    ``loss_i = -l_ii + LSE_j l_ij``; ``positive`` (``[B, d]`` like ``anchor``) is a second
    (dropout) view of the anchor. ``symmetric=True`` averages this with the column direction.

    Example::

        >>> infonce_loss(torch.randn(64, 768), torch.randn(64, 768), temperature=0.05)
    """
    _checks.check_embeddings(anchor=anchor, positive=positive)
    _checks.check_rank("positive", positive, 2, "[B, d]")
    opts = _options(temperature, reduction, backend, process_group, similarity, matryoshka_dims, matryoshka_weights)
    rows = mnrl_loss(anchor, positive, **opts)
    if not symmetric:
        return rows
    return 0.5 * (rows + mnrl_loss(positive, anchor, **opts))


@distributed.agree_on_errors
def edacse_loss(
    anchor: Tensor,
    dropout_view: Tensor,
    augmented_view: Tensor,
    *,
    lam: float = 0.6,
    temperature: float | Tensor = 0.05,
    reduction: str = "mean",
    backend: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims: tuple[int, ...] | None = None,
    matryoshka_weights: tuple[float, ...] | None = None,
) -> Tensor:
    """EdaCSE (Liu et al. 2023, eq. 2): ``InfoNCE(a, a') + lam * InfoNCE(a, a_aug)``.

    ``a'`` is the dropout view, ``a_aug`` the embedding of the sentence with 1..k random
    punctuation marks inserted (bert-base: ``k = 3, lam = 0.6``); all three ``[B, d]``.
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
    opts = _options(temperature, reduction, backend, process_group, similarity, matryoshka_dims, matryoshka_weights)
    return infonce_loss(anchor, dropout_view, **opts) + lam * infonce_loss(anchor, augmented_view, **opts)


@distributed.agree_on_errors
def supcon_pool_loss(
    anchor: Tensor,
    candidates: Tensor,
    pos_index: Tensor,
    *,
    pos_mask: Tensor | None = None,
    cand_mask: Tensor | None = None,
    temperature: float | Tensor = 0.05,
    reduction: str = "mean",
    backend: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims: tuple[int, ...] | None = None,
    matryoshka_weights: tuple[float, ...] | None = None,
) -> Tensor:
    """Supervised contrastive loss against a shared candidate pool (Liao's in-batch "allpalln").

    ``loss_i = mean_k [ -l_{i, pos_index[i,k]} + LSE_{c valid} l_ic ]``: every anchor sees
    every valid candidate once (a candidate may be a positive of several anchors).

    Args:
        anchor: ``[B, d]``. candidates: ``[N, d]``.
        pos_index: ``[B, P]`` int64 indices into ``candidates``.
        pos_mask: ``[B, P]`` bool, ``False`` = padding. cand_mask: ``[N]`` bool.
    """
    _check_options(reduction, similarity)
    _checks.check_embeddings(anchor=anchor, candidates=candidates)
    opts = dict(reduction=reduction, backend=backend, process_group=process_group, similarity=similarity)
    if not isinstance(pos_index, Tensor):
        raise TypeError(f"pos_index must be a torch.Tensor of int64 indices [B, P], got {type(pos_index).__name__}")
    B, d = _matrix("anchor", anchor)
    _checks.check_rank("candidates", candidates, 2, "[N, d]")
    _checks.check_rank("pos_index", pos_index, 2, "[B, P]")
    N = candidates.shape[0]
    matryoshka = _matryoshka.check(matryoshka_dims, matryoshka_weights, d)
    if candidates.shape[1] != d or pos_index.shape[0] != B or N == 0 or pos_index.shape[1] == 0:
        raise ValueError(
            f"expected anchor [B, d], candidates [N>0, d], pos_index [B, P>0]; got "
            f"{tuple(anchor.shape)}, {tuple(candidates.shape)}, {tuple(pos_index.shape)}"
        )
    if pos_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pos_index must be an integer tensor, got {pos_index.dtype}")
    if pos_index.device.type == "cpu" and pos_index.numel() and (pos_index.min() < 0 or pos_index.max() >= N):
        raise ValueError(
            f"pos_index must be in [0, {N}), got values in [{int(pos_index.min())}, {int(pos_index.max())}]"
        )
    P = pos_index.shape[1]
    _checks.check_mask("pos_mask", pos_mask, (B, P), anchor.device)
    _checks.check_mask("cand_mask", cand_mask, (N,), anchor.device)
    pos_index = pos_index.to(device=anchor.device, dtype=torch.int64)
    if cand_mask is not None:  # a positive that is not a valid candidate is no positive
        valid = cand_mask[pos_index]
        pos_mask = valid if pos_mask is None else pos_mask & valid
    tau = _check_positives(anchor, pos_mask, process_group, temperature)
    cosine = similarity == "cos"
    with _no_autocast(anchor):
        anchor = _without_unused_anchors(anchor, pos_mask)
        pos = candidates[pos_index]
        prefixes = (d,) if matryoshka is None else matryoshka[0]  # [K, B, P] logits with dims
        pos_logits = [
            positive_logits(anchor[:, :m], pos[..., :m], tau, cosine=cosine, eps=EPS, pos_mask=pos_mask)
            for m in prefixes
        ]
        pos_logits = pos_logits[0] if matryoshka is None else torch.stack(pos_logits)
        empty, empty_tags = empty_block(anchor)
        blocks, tags = (candidates, empty), (pool_tags(N, cand_mask, device=anchor.device), empty_tags)
        sizes = {"B": B, "N": N, "d": d}
        shared = dict(pos_logits=pos_logits, matryoshka=matryoshka)
        return _fused_loss("supcon", anchor, blocks, tags, tau, sizes=sizes, pos_mask=pos_mask, **shared, **opts)


class _GroupedCosine(torch.autograd.Function):
    """``[B, G]`` cosines of ``h, z [B, G, g]`` groups in the compute dtype; no gradient to ``z``.
    The backward is ``ops.normalize``'s clamped-norm formula (exactly 0 where the true gradient
    is, e.g. ``g = 1``) in plain ops on the saved inputs: differentiable, extra memory O(B * D).
    """

    @staticmethod
    def forward(ctx, h: Tensor, z: Tensor) -> Tensor:
        ctx.save_for_backward(h, z)
        return torch.linalg.vecdot(normalize_rows(h, EPS, True)[0], normalize_rows(z, EPS, True)[0])

    @staticmethod
    def backward(ctx, d_cos: Tensor):
        h, z = ctx.saved_tensors
        h_hat, h_norm = normalize_rows(h, EPS, True)
        z_hat = normalize_rows(z, EPS, True)[0]
        d_h = normalize_backward(h_hat, h_norm, z_hat * d_cos.to(z_hat.dtype).unsqueeze(-1), EPS)
        return d_h.to(h.dtype), None


def grouped_cosine_loss(
    h: Tensor, z: Tensor, *, group_size: int, reduction: str = "mean", backend: str = "auto"
) -> Tensor:
    """GCLSR grouped cosine (Wang et al. 2023, eq. 6): ``-mean_{i,g} cos(h_ig, stopgrad(z_ig))``.

    ``h`` (predictor output) and ``z`` (projector output), both ``[B, D]``, are split into
    contiguous groups of ``group_size`` features (``group_size=D``: SimSiam);
    ``reduction="none"`` returns ``[B]``. One PyTorch computation in float32 (float64 for
    float64) on every ``backend`` (checked by name).

    Example::

        >>> grouped_cosine_loss(torch.randn(8, 64), torch.randn(8, 64), group_size=16)
    """
    _checks.check_choice("reduction", reduction, _checks.REDUCTIONS)
    _checks.check_embeddings(h=h, z=z)
    B, D = _matrix("h", h, "[B, D]")
    if tuple(z.shape) != tuple(h.shape):
        raise ValueError(f"h and z must have the same shape, got {tuple(h.shape)} and {tuple(z.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise TypeError(f"group_size must be a positive int, got {group_size!r}")
    if D % group_size:
        raise ValueError(f"group_size={group_size} does not divide the feature dimension D={D}")
    _checks.check_choice("backend", backend, ("auto", *BACKENDS))
    with _no_autocast(h):
        groups = (B, D // group_size, group_size)
        loss = -_GroupedCosine.apply(h.reshape(groups), z.detach().reshape(groups)).mean(1)  # [B]
        if reduction != "none":
            loss = loss.sum() if reduction == "sum" else loss.mean()
        return loss.to(h.dtype)


def gclsr_loss(
    h1: Tensor,
    z1: Tensor,
    h2: Tensor,
    z2: Tensor,
    *,
    group_size: int = 16,
    reduction: str = "mean",
    backend: str = "auto",
) -> Tensor:
    """GCLSR symmetric loss (eq. 7, SimSiam style): ``0.5 * (L(h1, z2) + L(h2, z1))`` of the two
    views' predictor (``h*``) and projector (``z*``) outputs, ``L`` = :func:`grouped_cosine_loss`."""
    kw = dict(group_size=group_size, reduction=reduction, backend=backend)
    return 0.5 * (grouped_cosine_loss(h1, z2, **kw) + grouped_cosine_loss(h2, z1, **kw))


# --------------------------------------------------------------------------- modules


class _TemperatureLoss(nn.Module):
    """Shared state of the LSE loss modules: a fixed or learnable temperature and options.

    A tensor ``temperature`` that requires grad is used as given (the caller trains it);
    ``learn_temperature=True`` keeps ``log(temperature)`` as a parameter (so it stays > 0).
    """

    def __init__(
        self,
        temperature=0.05,
        *,
        learn_temperature=False,
        reduction="mean",
        backend="auto",
        process_group=None,
        similarity="cos",
        matryoshka_dims=None,
        matryoshka_weights=None,
    ):
        super().__init__()
        # the losses' rule (fastcl._checks.check_temperature) in float32, the loose end:
        # a float64 call checks again in float64
        _checks.check_temperature(temperature)
        _checks.check_choice("reduction", reduction, _checks.REDUCTIONS)
        _checks.check_choice("similarity", similarity, _checks.SIMILARITIES)
        if isinstance(temperature, Tensor) and (learn_temperature or not temperature.requires_grad):
            temperature = float(temperature.detach())  # a value to start from / a constant
        elif not isinstance(temperature, Tensor):
            temperature = float(temperature)  # a NumPy scalar too
        if learn_temperature:
            self.log_temperature = nn.Parameter(torch.tensor(math.log(temperature)))
        else:
            # a float, or a tensor that requires grad: a temperature the caller trains
            self._fixed_temperature = temperature
        self.learn_temperature = learn_temperature
        self.options = dict(reduction=reduction, backend=backend, process_group=process_group, similarity=similarity)
        if _matryoshka.check(matryoshka_dims, matryoshka_weights) is not None:  # d is checked per call
            self.options.update(matryoshka_dims=tuple(matryoshka_dims), matryoshka_weights=matryoshka_weights)

    @property
    def temperature(self) -> float | Tensor:
        return self.log_temperature.exp() if self.learn_temperature else self._fixed_temperature

    def _kw(self) -> dict:
        """The loss function's keyword arguments: the temperature and the options."""
        return dict(temperature=self.temperature, **self.options)

    def _temperature_repr(self) -> str:
        return "learnable" if self.learn_temperature else str(self._fixed_temperature)

    def extra_repr(self) -> str:
        t = self._temperature_repr()
        return f"temperature={t}, reduction={self.options['reduction']!r}, backend={self.options['backend']!r}"


class SupMPNLoss(_TemperatureLoss):
    """Module form of :func:`supmpn_loss`; ``forward(anchor, positives, negatives=None, pos_mask=None, neg_mask=None)``."""

    def __init__(self, temperature=0.05, *, own_positives="exclude", **kw):
        super().__init__(temperature, **kw)
        _checks.check_choice("own_positives", own_positives, OWN_POSITIVES)
        self.own_positives = own_positives

    def forward(self, anchor, positives, negatives=None, pos_mask=None, neg_mask=None):
        kw = self._kw()
        return supmpn_loss(
            anchor, positives, negatives, pos_mask=pos_mask, neg_mask=neg_mask, own_positives=self.own_positives, **kw
        )


class SupConLoss(_TemperatureLoss):
    """Module form of :func:`supcon_loss`: ``forward(anchor, positives, negatives=None, pos_mask=None,
    neg_mask=None)`` or, labels form, ``forward(features, labels=y, ref_emb=None, ref_labels=None)``
    (also ``forward(features, y)``, as pytorch-metric-learning's and SupContrast's modules).
    Without a ``temperature`` each call takes its form's default, as :func:`supcon_loss`: 0.05
    structured, 0.1 labels (pytorch-metric-learning's ``SupConLoss()``)."""

    def __init__(self, temperature=None, **kw):
        if temperature is None and kw.get("learn_temperature"):
            raise ValueError(
                "SupConLoss(learn_temperature=True) needs a starting temperature: the default depends on the "
                "form of the call (0.05 structured, 0.1 labels)"
            )
        super().__init__(0.05 if temperature is None else temperature, **kw)  # 0.05: checks a value
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
    ):
        labels_form = dict(labels=labels, ref_emb=ref_emb, ref_labels=ref_labels)
        return supcon_loss(
            anchor, positives, negatives, pos_mask=pos_mask, neg_mask=neg_mask, **labels_form, **self._kw()
        )


class MNRLoss(_TemperatureLoss):
    """Module form of :func:`mnrl_loss`; ``forward(anchor, positive, negatives=None, neg_mask=None)``.

    Takes sentence-transformers 6's ``directions``, ``partition_mode``, ``hardness_mode`` and
    ``hardness_strength`` at construction."""

    def __init__(
        self,
        temperature=0.05,
        *,
        directions=("query_to_doc",),
        partition_mode="joint",
        hardness_mode=None,
        hardness_strength=0.0,
        **kw,
    ):
        super().__init__(temperature, **kw)
        self.directions = _check_mnrl_options(directions, partition_mode, hardness_mode, hardness_strength)
        self.mnrl_options = dict(
            directions=self.directions,
            partition_mode=partition_mode,
            hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
        )

    def forward(self, anchor, positive, negatives=None, neg_mask=None):
        return mnrl_loss(anchor, positive, negatives, neg_mask=neg_mask, **self.mnrl_options, **self._kw())


class InfoNCELoss(_TemperatureLoss):
    """Module form of :func:`infonce_loss`; ``forward(anchor, positive)``."""

    def __init__(self, temperature=0.05, *, symmetric=False, **kw):
        super().__init__(temperature, **kw)
        self.symmetric = symmetric

    def forward(self, anchor, positive):
        return infonce_loss(anchor, positive, symmetric=self.symmetric, **self._kw())


class EdaCSELoss(_TemperatureLoss):
    """Module form of :func:`edacse_loss`; ``forward(anchor, dropout_view, augmented_view)``."""

    def __init__(self, temperature=0.05, *, lam=0.6, **kw):
        super().__init__(temperature, **kw)
        self.lam = lam

    def forward(self, anchor, dropout_view, augmented_view):
        return edacse_loss(anchor, dropout_view, augmented_view, lam=self.lam, **self._kw())


class GroupedCosineLoss(nn.Module):
    """Module form of :func:`grouped_cosine_loss`; ``forward(h, z)``."""

    def __init__(self, group_size: int, *, reduction="mean", backend="auto"):
        super().__init__()
        self.group_size, self.reduction, self.backend = group_size, reduction, backend

    def forward(self, h, z):
        return grouped_cosine_loss(h, z, group_size=self.group_size, reduction=self.reduction, backend=self.backend)


class GCLSRLoss(nn.Module):
    """Module form of :func:`gclsr_loss`; ``forward(h1, z1, h2, z2)``."""

    def __init__(self, group_size: int = 16, *, reduction="mean", backend="auto"):
        super().__init__()
        self.group_size, self.reduction, self.backend = group_size, reduction, backend

    def forward(self, h1, z1, h2, z2):
        return gclsr_loss(h1, z1, h2, z2, group_size=self.group_size, reduction=self.reduction, backend=self.backend)
