"""False-negative filters: GISTEmbed's guided loss and the self-margin filter (Solatorio 2024;
Qwen3-Embedding's masked InfoNCE), on the fused primitive's filter (``contract.Filter``).

The larger the in-batch pool, the more of its "negatives" are paraphrases of the positive.
GIST drops every candidate that a guide model scores above the anchor's own positive (less a
margin); the self-margin filter drops candidates the model itself scores above the positive
plus a margin. Both decisions are made tile by tile inside the kernels from a per-row
threshold, so neither the ``[B, N]`` similarities nor a mask is ever stored.

``gist_loss`` is sentence-transformers 6.2's ``GISTEmbedLoss`` on given embeddings: per anchor
``i`` the row ``[a_i.P | a_i.A | p_i.P | a_i.N] / temperature`` (anchor–positive, anchor–anchor,
positive–positive, anchor–negative blocks; the middle two optional), cross-entropy with the
own positive as the target, where a candidate ``c`` of block ``X`` is left out when
``guide_sim(x_i, c) > guide_sim(a_i, p_i) - margin`` (``"absolute"``) or ``> g - |g| * margin``
(``"relative"``, ``g = guide_sim(a_i, p_i)``), the own positive never.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks, distributed
from .. import matryoshka as _matryoshka
from ..ops import joint
from ..ops.contract import EPS, TAG_ALL, Filter, OwnPositives, compute_dtype, empty_block
from ..ops.contrastive import ContrastiveLSE, LossSpec, contrastive_loss
from ..ops.joint import JointLSE, JointSpec
from ..ops.positive_logits import own_positive_similarities, positive_logits
from ..ops.ring import ring_contrastive_loss
from ._shared import (
    LSE_OPTIONS,
    TemperatureLoss,
    check_matrix,
    check_options,
    document,
    no_autocast,
    row_weights,
)

MARGIN_STRATEGIES = ("absolute", "relative")

GIST_DOCS = {
    "guide": "``(guide_anchor [B, g], guide_positive [B, g])`` or ``(..., guide_negatives)`` with "
    "``guide_negatives`` shaped like ``negatives`` (``[B, g]`` or ``[B, Q, g]``): the guide model's "
    "embeddings of the same texts (any width ``g`` and float dtype, on the embeddings' device, no "
    "gradient: compute them under ``torch.no_grad()``).",
    "margin_strategy": '``"absolute"`` (drop ``c`` when ``guide_sim(c) > g - margin``) or ``"relative"`` '
    "(``> g - |g| * margin``), ``g`` the guide's similarity of the anchor and its positive "
    "(sentence-transformers 6.2's rule).",
    "margin": 'finite; ``"relative"`` needs ``margin >= 0``.',
    "contrast_anchors": "include the anchor–anchor block (the other anchors as candidates, this rank's only).",
    "contrast_positives": "include the positive–positive block (``p_i`` against every positive, in the same row).",
    "false_negative_margin": "None (off), or a finite ``m >= 0``: leave out of anchor ``i``'s row every "
    "candidate whose similarity exceeds the positive's by more than ``m`` (``s_ic > s_i,pos + m``, the "
    "model's own cosine, per Matryoshka prefix; the positive itself stays).",
}


def check_margin(strategy: str, margin) -> float:
    _checks.check_choice("margin_strategy", strategy, MARGIN_STRATEGIES)
    if not _checks.is_real_number(margin) or not math.isfinite(float(margin)):
        raise ValueError(f"margin must be a finite number, got {margin!r}")
    if strategy == "relative" and margin < 0:
        raise ValueError(f"margin_strategy='relative' needs margin >= 0 (a fraction of |guide_sim|), got {margin!r}")
    return float(margin)


def check_false_negative_margin(margin) -> float | None:
    if margin is None:
        return None
    if not _checks.is_real_number(margin) or not math.isfinite(float(margin)) or margin < 0:
        raise ValueError(f"false_negative_margin must be None or a finite number >= 0, got {margin!r}")
    return float(margin)


def self_margin_filter(anchor: Tensor, positive: Tensor, margin: float, cosine: bool, dims) -> Filter:
    """The self-margin filter of rows ``anchor`` with own positives ``positive [B, d]``:
    thresholds ``s(a_i, p_i) + margin`` (``[K, B]`` with Matryoshka dims, one per prefix)."""
    prefixes = [anchor.shape[1]] if dims is None else list(dims)
    with torch.no_grad():
        sims = [
            own_positive_similarities(anchor[:, :m], positive[:, None, :m], cosine, EPS)[:, 0] + margin
            for m in prefixes
        ]
    return Filter(sims[0] if dims is None else torch.stack(sims))


def _check_guide(guide, B: int, Q: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor | None]:
    if not isinstance(guide, (tuple, list)) or len(guide) not in (2, 3):
        raise TypeError("guide must be a tuple (guide_anchor, guide_positive[, guide_negatives])")
    names = ("guide_anchor", "guide_positive", "guide_negatives")
    ga, gp = guide[0], guide[1]
    gn = guide[2] if len(guide) == 3 else None
    if (gn is None) != (Q == 0):
        raise ValueError("guide must hold guide_negatives exactly when negatives are given")
    width = None
    for name, t in zip(names, (ga, gp, gn)):
        if t is None:
            continue
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {type(t).__name__}")
        if t.requires_grad:
            raise ValueError(f"{name} requires grad: the guide gets no gradient (compute it under torch.no_grad())")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the embeddings are on {device}")
        rows = B * Q if name == "guide_negatives" else B
        flat = t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t
        if t.dim() not in (2, 3) or flat.shape[0] != rows or (name != "guide_negatives" and t.dim() != 2):
            want = "[B, Q, g] or [B, g]" if name == "guide_negatives" else "[B, g]"
            raise ValueError(f"{name} must be {want} with B={B} rows like the embeddings, got {tuple(t.shape)}")
        if width is not None and t.shape[-1] != width:
            raise ValueError(f"the guide embeddings must share one width, got {width} and {t.shape[-1]} ({name})")
        width = t.shape[-1]
    flat_gn = None if gn is None else gn.reshape(B * Q, -1)
    return ga, gp, flat_gn


def gist_threshold(guide_anchor: Tensor, guide_positive: Tensor, strategy: str, margin: float) -> Tensor:
    """``[B]`` thresholds (float32, float64 for a float64 guide) from the guide's similarity of
    each anchor and its positive, by sentence-transformers 6.2's rule."""
    cd = compute_dtype(guide_anchor.dtype)
    g = torch.nn.functional.cosine_similarity(guide_anchor.to(cd), guide_positive.to(cd), dim=-1)
    return g - margin if strategy == "absolute" else g - g.abs() * margin


def _gather(x: Tensor, group, grad: bool) -> Tensor:
    if grad:
        return distributed.all_gather_with_grad(x.contiguous(), group)
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    distributed.all_gather_into(out, x.contiguous(), group)
    return out


def _rows(anchor, blocks, tags, tau, *, positives, pos_logits, filt, ring_group, **common) -> Tensor:
    """``[B]`` (``[K, B]``) rows ``LSE(filtered candidates) - l(a_i, p_i)`` of one primitive call;
    ``common``: the call's ``LossSpec`` fields (cosine, backend, strategy, dims)."""
    cd = compute_dtype(anchor.dtype)
    weights = torch.ones(anchor.shape[0], dtype=cd, device=anchor.device)
    spec = LossSpec("cross_entropy", tags, "none", weights, positives=positives, filter=filt, **common)
    if ring_group is not None:
        return ring_contrastive_loss(anchor, blocks, tau, spec, pos_logits, group=ring_group, handshake=False).to(cd)
    return contrastive_loss(anchor, blocks, tau, spec, pos_logits).to(cd)


def _spec(anchor, blocks, positives, filt, weights, reduction, matryoshka, **common) -> LossSpec:
    """The ``LossSpec`` of one GIST problem (all candidates valid: no padding tags), its backend chosen."""
    tags = tuple(torch.full((b.shape[0],), TAG_ALL, dtype=torch.int32, device=anchor.device) for b in blocks)
    spec = LossSpec(
        "cross_entropy", (tags[0], tags[1]), reduction, weights, positives=positives,
        dim_weights=_matryoshka.weight_tensor(matryoshka, anchor), padded=False, filter=filt, **common,
    )  # fmt: skip
    return spec.choose(spec.problem(anchor, *blocks))


@distributed.agree_on_errors
@document("guide", "margin_strategy", "margin", "contrast_anchors", "contrast_positives", *LSE_OPTIONS, extra=GIST_DOCS)
def gist_loss(
    anchor: Tensor,
    positive: Tensor,
    negatives: Tensor | None = None,
    *,
    guide,
    margin_strategy: str = "absolute",
    margin: float = 0.0,
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
    temperature: float | Tensor = 0.01,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims=None,
    matryoshka_weights=None,
    cross_device: str = "gather",
) -> Tensor:
    """GISTEmbed's guided in-batch loss (Solatorio 2024; sentence-transformers 6.2's ``GISTEmbedLoss``).

    Row ``i``: ``-l(a_i, p_i) + LSE`` over the candidates the guide keeps, of the blocks
    anchor–positive (every positive), anchor–anchor (``contrast_anchors``), positive–positive
    (``p_i`` against every positive, ``contrast_positives``) and anchor–negative; a candidate
    leaves when the guide finds it more similar than the positive (less the margin). The
    filter runs inside the fused kernels: no ``[B, N]`` similarities or mask are stored.

    Args:
        anchor: ``[B, d]`` float16, bfloat16, float32 or float64 raw embeddings.
        positive: ``[B, d]``, each anchor's positive.
        negatives: ``[B, d]`` (one hard negative each), ``[B, Q, d]``, or None.
        {shared}

    With a ``process_group`` every rank's positives and negatives (and their guide
    embeddings) join every row; anchors stay this rank's (sentence-transformers'
    ``gather_across_devices=True``).

    Returns:
        {returns}

    Example:
        >>> import torch
        >>> from fastcl.losses import gist_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> a, p = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
        >>> ga, gp = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        >>> gist_loss(a, p, guide=(ga, gp), margin=0.1).shape
        torch.Size([])
    """
    check_options(reduction, similarity, strategy, cross_device)
    margin = check_margin(margin_strategy, margin)
    _checks.check_embeddings(anchor=anchor, positive=positive, negatives=negatives)
    B, d = check_matrix("anchor", anchor)
    if tuple(positive.shape) != (B, d):
        raise ValueError(f"positive must have shape [B={B}, d={d}], got {tuple(positive.shape)}")
    if negatives is not None and negatives.dim() == 2:
        negatives = negatives.unsqueeze(1)
    Q = 0
    if negatives is not None:
        _checks.check_rank("negatives", negatives, 3, "[B, Q, d]")
        if negatives.shape[0] != B or negatives.shape[2] != d:
            raise ValueError(f"negatives must have shape [B={B}, Q, d={d}], got {tuple(negatives.shape)}")
        Q = negatives.shape[1]
    ga, gp, gn = _check_guide(guide, B, Q, anchor.device)
    matryoshka = _matryoshka.check(matryoshka_dims, matryoshka_weights, d, compute_dtype(anchor.dtype))
    dims = None if matryoshka is None else matryoshka[0]
    tau = _checks.as_temperature(temperature, anchor)
    cosine = similarity == "cos"
    group, world, offset, ring = process_group, 1, 0, cross_device == "ring" and process_group is not None
    if group is not None:
        distributed.check_group(group)
        distributed.check_same_sizes(group, {"gist_B": B, "Q": Q, "d": d, "g": ga.shape[1]}, anchor.dtype)
        world = dist.get_world_size(group)

    with no_autocast(anchor):
        anchor, positive = anchor.contiguous(), positive.contiguous()
        thr = gist_threshold(ga, gp, margin_strategy, margin)
        negs = anchor.new_empty((0, d)) if Q == 0 else negatives.reshape(B * Q, d)  # type: ignore[union-attr]
        gnegs = ga.new_empty((0, ga.shape[1])) if gn is None else gn
        if group is not None and not ring:  # every rank's positives and negatives, with gradient
            offset = dist.get_rank(group) * B
            cand_p, cand_n = _gather(positive, group, True), _gather(negs, group, True) if Q else negs
            cand_gp, cand_gn = _gather(gp, group, False), _gather(gnegs, group, False) if Q else gnegs
        else:
            cand_p, cand_n, cand_gp, cand_gn = positive, negs, gp, gnegs
        tags = lambda n: torch.full((n,), TAG_ALL, dtype=torch.int32, device=anchor.device)  # noqa: E731
        common: dict[str, Any] = dict(cosine=cosine, backend=backend, strategy=strategy, dims=dims)
        # the pair logits l(a_i, p_i), differentiable, for the pieces that do not fold them
        pos = None

        def pair() -> Tensor:
            nonlocal pos
            if pos is None:
                prefixes = [d] if dims is None else list(dims)
                logits = [
                    positive_logits(anchor[:, :m], positive[:, None, :m], tau, cosine=cosine, eps=EPS) for m in prefixes
                ]
                pos = logits[0] if dims is None else torch.stack(logits)
            return pos

        # anchor rows: every positive (the own one folded, never dropped) and negative; the
        # other anchors join them unless the ring moves the blocks (anchors stay home)
        local_aa = contrast_anchors and ring
        blocks, gblocks = (cand_p, cand_n), (cand_gp, cand_gn)
        if not ring:  # one block [P; A; N], own positives first: one copy (a joint sweep takes it as is)
            parts = [cand_p, *([anchor] if contrast_anchors else []), *([cand_n] if Q else [])]
            gparts = [cand_gp, *([ga] if contrast_anchors else []), *([cand_gn] if Q else [])]
            one = lambda xs: torch.cat(xs) if len(xs) > 1 else xs[0]  # noqa: E731
            blocks, gblocks = (one(parts), empty_block(anchor)[0]), (one(gparts), ga.new_empty((0, ga.shape[1])))
        every = torch.ones(B, dtype=torch.bool, device=anchor.device)
        if not ring and reduction != "none":  # gradient in forward: one sweep per problem
            valid = torch.tensor(world * B, dtype=compute_dtype(anchor.dtype), device=anchor.device)
            weights = row_weights(every, reduction, valid.dtype, world=world, valid_anchors=valid)
            q = _spec(
                anchor, blocks, OwnPositives(offset, 1), Filter(thr, ga, gblocks), weights, reduction, matryoshka,
                **common,
            )  # fmt: skip
            if not contrast_positives:
                return ContrastiveLSE.apply(anchor, *blocks, None, tau, q)
            empty, empty_g = empty_block(positive)[0], gp.new_empty((0, gp.shape[1]))
            e = _spec(
                positive, (cand_p, empty), None, Filter(thr, gp, (cand_gp, empty_g)), weights, reduction, matryoshka,
                **common,
            )  # fmt: skip
            if joint.takes(q) and e.impl.name == q.impl.name:
                return JointLSE.apply(anchor, *blocks, positive, cand_p, empty, tau, JointSpec(q, e))
        rows = _rows(
            anchor, blocks, (tags(blocks[0].shape[0]), tags(blocks[1].shape[0])), tau,
            positives=OwnPositives(offset, 1), pos_logits=None, filt=Filter(thr, ga, gblocks),
            ring_group=group if ring else None, **common,
        )  # fmt: skip
        pieces = [rows]
        if local_aa:
            empty, empty_g = empty_block(anchor)[0], ga.new_empty((0, ga.shape[1]))
            pieces.append(
                _rows(
                    anchor,
                    (anchor, empty),
                    (tags(B), tags(0)),
                    tau,
                    positives=None,
                    pos_logits=pair(),
                    filt=Filter(thr, ga, (ga, empty_g)),
                    ring_group=None,
                    **common,
                )  # fmt: skip
            )
        if contrast_positives:  # p_i against every positive, in row i
            empty, empty_g = empty_block(positive)[0], gp.new_empty((0, gp.shape[1]))
            pieces.append(
                _rows(
                    positive,
                    (cand_p, empty),
                    (tags(cand_p.shape[0]), tags(0)),
                    tau,
                    positives=None,
                    pos_logits=pair(),
                    filt=Filter(thr, gp, (cand_gp, empty_g)),
                    ring_group=group if ring else None,
                    **common,
                )  # fmt: skip
            )
        rows = pieces[0] if len(pieces) == 1 else torch.logsumexp(torch.stack(pieces), dim=0)
        if matryoshka is not None:  # [K, B] -> sum_k w_k rows_k
            w = torch.tensor(matryoshka[1], dtype=rows.dtype, device=rows.device)
            rows = (w[:, None] * rows).sum(0)
        if reduction == "none":
            return rows.to(anchor.dtype)
        valid = torch.tensor(world * B, dtype=rows.dtype, device=anchor.device)
        weights = row_weights(every, reduction, rows.dtype, world=world, valid_anchors=valid)
        return (rows * weights).sum().to(anchor.dtype)


@document(
    "margin_strategy",
    "margin",
    "contrast_anchors",
    "contrast_positives",
    "learn_temperature",
    *LSE_OPTIONS,
    extra=GIST_DOCS,
)
class GISTLoss(TemperatureLoss):
    """Module form of :func:`gist_loss`: ``forward(anchor [B, d], positive [B, d], negatives=None,
    *, guide)``; ``temperature`` defaults to 0.01 (sentence-transformers' GIST default).

    Args:
        {shared}
    """

    def __init__(
        self,
        temperature: float | Tensor = 0.01,
        *,
        margin_strategy: str = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        **kw,
    ):
        super().__init__(temperature, **kw)
        self.gist = dict(
            margin_strategy=margin_strategy,
            margin=check_margin(margin_strategy, margin),
            contrast_anchors=contrast_anchors,
            contrast_positives=contrast_positives,
        )

    def forward(self, anchor, positive, negatives=None, *, guide) -> Tensor:
        return gist_loss(anchor, positive, negatives, guide=guide, **self.gist, **self._kw())

    def extra_repr(self) -> str:
        return super().extra_repr() + ", " + ", ".join(f"{k}={v!r}" for k, v in self.gist.items())


__all__ = ["gist_loss", "GISTLoss", "self_margin_filter", "check_false_negative_margin"]
