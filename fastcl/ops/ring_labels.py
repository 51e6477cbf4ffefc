"""Labels-SupCon (``supcon_labels_loss``) with ``cross_device="ring"``.

The labels form needs, besides the masked LSE (``ring.ring_contrastive_loss`` with the
features as their own candidate block and each anchor left out of its own row), every
anchor's *mean positive logit* over the global batch,
``<a_i, S_{y_i} - c_i> / (tau * |P(i)|)``, where ``S_y`` sums the (normalised) candidates of
label ``y`` over every rank. :class:`RingLabelSums` forms ``S_{y_i}`` and the global label
counts with a ring of its own (``ring_comm``): each rank's labels and normalised features
visit every rank, which adds the sums of the labels its anchors carry
(an ``index_add`` over the labels present: O((N + M) * d), never ``N x N``); in backward the
labels go round again with an accumulator of the gradient of each candidate, formed the same
way from the anchors' ``dS``. Autograd normalises before and differentiates the rest, as the
gather mode does, so the two modes compute the same thing.

Traffic: the features travel as normalised prefixes in the compute dtype (``sum_k m_k``
values per row; ``d`` without Matryoshka dims), and so does the accumulator; the labels ring
is a second tour besides the LSE ring's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import distributed
from .contract import EPS, compute_dtype, empty_block
from .contrastive import LossSpec
from .normalize import normalize_rows
from .ring import ring_contrastive_loss
from .ring_comm import RingComm, circulate, circulate_grads

NO_POSITIVE = "no anchor of any rank has a positive (no label repeats in the global batch)"


def _ids(mine: Tensor, theirs: Tensor) -> tuple[Tensor, Tensor, int]:
    """Dense ids of two label vectors in one numbering: ``(ids of mine, ids of theirs, count)``."""
    uniq, ids = torch.unique(torch.cat([mine, theirs]), return_inverse=True)
    return ids[: mine.shape[0]], ids[mine.shape[0] :], uniq.shape[0]


@dataclass(frozen=True)
class _Spec:
    comm: RingComm


class RingLabelSums(torch.autograd.Function):
    """``labels [N]`` (int64) and normalised prefixes ``c_k [N, m_k]`` of this rank's features ->
    ``S_k [N, m_k]``: for each of this rank's rows, the sum of ``c_k`` over every rank's rows
    with its label (itself included), and ``count [N]``, how many rows carry its label
    (int64, itself included, not differentiable)."""

    @staticmethod
    def forward(ctx, labels: Tensor, spec: _Spec, *prefixes: Tensor):
        sums = [torch.zeros_like(c) for c in prefixes]
        count = torch.zeros_like(labels)

        def visit(source: int, piece: int | None, payload: list[Tensor]) -> None:
            mine, theirs, n = _ids(labels, payload[0])
            count.add_(torch.bincount(theirs, minlength=n)[mine])
            for s, c in zip(sums, payload[1:], strict=True):
                s.add_(torch.zeros((n, c.shape[1]), dtype=c.dtype, device=c.device).index_add_(0, theirs, c)[mine])

        failure = circulate(spec.comm, [labels, *(c.contiguous() for c in prefixes)], visit)
        spec.comm.agree_on_status(failure, "forward (label sums)")
        ctx.spec, ctx.shapes = spec, [(c.shape, c.dtype) for c in prefixes]
        ctx.save_for_backward(labels)
        ctx.mark_non_differentiable(count)
        return (*sums, count)

    @staticmethod
    def backward(ctx, *grads):
        (labels,) = ctx.saved_tensors
        d_sums = [
            torch.zeros(shape, dtype=dtype, device=labels.device) if g is None else g
            for g, (shape, dtype) in zip(grads[:-1], ctx.shapes, strict=True)
        ]

        def contribute(source: int, piece: int | None, payload: list[Tensor]) -> list[Tensor]:
            # d c_k of the visiting rows: the dS_k of this rank's rows with the same label
            mine, theirs, n = _ids(labels, payload[0])
            return [
                torch.zeros((n, g.shape[1]), dtype=g.dtype, device=g.device).index_add_(0, mine, g)[theirs]
                for g in d_sums
            ]

        def zeros() -> list[Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=labels.device) for shape, dtype in ctx.shapes]

        d_prefixes, failure = circulate_grads(ctx.spec.comm, [labels], contribute, zeros)
        ctx.spec.comm.agree_on_status(failure, "backward (label sums)")
        return (None, None, *d_prefixes)


def label_positive_logits(
    features: Tensor, labels: Tensor, tau: Tensor, prefixes: tuple[int, ...], *, cosine: bool, group
) -> tuple[Tensor, Tensor]:
    """``(mean positive logits [K, N], has_pos [N])`` of this rank's rows over the global batch
    (``K`` = number of ``prefixes``); differentiable in ``features`` and ``tau``."""
    cd = compute_dtype(features.dtype)
    # scale-free norms (m * |x / m|), differentiated by autograd: the gather mode's normalisation
    hats = [normalize_rows(features[:, :m], EPS, True)[0] if cosine else features[:, :m].to(cd) for m in prefixes]
    *sums, count = RingLabelSums.apply(labels, _Spec(RingComm(group)), *hats)
    num_pos = count - 1
    has_pos = num_pos > 0
    means = []
    for c, s in zip(hats, sums, strict=True):
        mean = torch.linalg.vecdot(c, s - c) / (num_pos.clamp_min(1).to(cd) * tau.to(cd))
        means.append(torch.where(has_pos, mean, torch.zeros_like(mean)))
    return torch.stack(means), has_pos


def supcon_labels_ring(
    features: Tensor,
    labels: Tensor,
    tau: Tensor,
    *,
    reduction: str,
    backend: str,
    cosine: bool,
    dims: tuple[int, ...] | None,
    dim_weights: Tensor | None,
    group,
    strategy: str = "auto",
) -> Tensor:
    """``supcon_labels_loss`` (self set, no reference set) of this rank's ``features [N, d]`` and
    ``labels [N]`` against every rank's, by the ring; scaled as the gather mode."""
    N, d = features.shape
    distributed.check_same_sizes(group, {"N": N, "d": d}, features.dtype)
    prefixes = (d,) if dims is None else dims
    means, has_pos = label_positive_logits(features, labels, tau, prefixes, cosine=cosine, group=group)
    pos_logits = means[0][:, None] if dims is None else means[..., None]
    tags = torch.arange(N, dtype=torch.int32, device=features.device)  # row i leaves itself out
    empty, empty_tags = empty_block(features)
    spec = LossSpec(
        "cross_entropy", (tags, empty_tags), reduction, cosine=cosine, pos_mask=has_pos[:, None], dims=dims,
        dim_weights=dim_weights, strategy=strategy, backend=backend,
    )  # fmt: skip
    return ring_contrastive_loss(
        features, (features, empty), tau, spec, pos_logits, group=group, has_pos=has_pos, check_positive=True,
        no_positive=NO_POSITIVE, handshake=False,
    )  # fmt: skip
