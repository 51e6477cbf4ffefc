"""The rows of MNRL with sentence-transformers 6's ``directions``, ``partition_mode`` and hardness
(used by :func:`fastcl.losses.mnrl.mnrl_directions_loss`, which validates and reduces them).

Queries ``q_i`` (``anchor``), their positive documents ``d_i`` (``positive``), optional hard
negatives ``n_iq`` (``negatives``); ``D`` = every document of the batch (positives, then
negatives). Logits ``l = s / tau``; per query ``i`` the rows of the selected directions are

==================  ==============================================================
``query_to_doc``    ``l(q_i, x)`` for every ``x`` in ``D`` (always; holds the positive)
``query_to_query``  ``l(q_i, q_j)``, ``j != i``
``doc_to_query``    ``l(q_j, d_i)`` for every ``j`` (``d_i`` as anchor against the queries)
``doc_to_doc``      ``l(x, d_i)`` for every ``x`` in ``D`` not belonging to query ``i``
==================  ==============================================================

``partition_mode="joint"``: ``loss_i = LSE(all selected terms) - l(q_i, d_i)``;
``"per_direction"`` (only ``query_to_doc`` / ``doc_to_query``): the mean over directions of
``LSE(direction's terms) - l(q_i, d_i)``. Hardness (``hardness_strength`` alpha, on
``query_to_doc`` only): ``scale * s + alpha * stopgrad(s)`` on in-batch negatives
(``"in_batch_negatives"``: documents of other queries), on the query's own hard negatives
(``"hard_negatives"``) or on both (``"all_negatives"``); the positive is never penalised.
Exactly sentence-transformers 6.2's ``MultipleNegativesRankingLoss`` (docs/losses.md, "Directions,
partition, hardness"; docs/contracts.md).

How it stays fused, on every backend and with no kernel change:

* every direction is a *row* of fastcl's masked-LSE primitive: the rows of ``q_i`` (anchor
  ``q``) against the documents and, for ``query_to_query``, the queries tagged ``j`` (left
  out of their own row); the rows of ``d_i`` (anchor ``d``) against the queries and, for
  ``doc_to_doc``, the documents tagged with their owner (a query's own documents leave its
  row). ``joint`` combines the two row LSEs with ``logaddexp``: no ``B x N`` buffer.
* hardness is *not* a per-candidate additive log-weight: the added ``alpha * s_ic`` depends
  on the pair, and only ``scale * s`` carries gradient. It is a per-(row, candidate) scale
  of the logit, ``(1/tau + alpha) * s``, on a structural subset of the candidates. So the
  hardened candidates form their own primitive call at temperature
  ``tau_h = tau / (1 + alpha * tau)`` whose inputs pass through :class:`_ScaleGrad`
  (identity forward, gradient times ``1 / (1 + alpha * tau)``): the value has the hardened
  logits, the embedding gradient is exactly that of ``scale * s`` and the temperature
  gradient (through ``tau_h``) that of ``s / tau``. The unhardened candidates of the row
  (the query's own documents: a ``[B, 1 + Q]`` gather, or the rest of the batch) are a
  second piece; the pieces combine with ``logaddexp``. No backend needs to change.

Every piece is returned as ``LSE - l(q_i, d_i)`` (per row, from the fused head in float32),
so combining pieces never subtracts two large numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks, distributed
from ..ops.contract import EPS, TAG_ALL, OwnPositives, compute_dtype, empty_block
from ..ops.contrastive import LossSpec, contrastive_loss
from ..ops.positive_logits import positive_logits
from ..ops.ring import ring_contrastive_loss

DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
PARTITION_MODES = ("joint", "per_direction")
HARDNESS_MODES = (None, "in_batch_negatives", "hard_negatives", "all_negatives")
DEFAULT_DIRECTIONS = ("query_to_doc",)


def check_mnrl_options(directions, partition_mode, hardness_mode, hardness_strength) -> tuple[str, ...]:
    """sentence-transformers 6.2's validation; returns the directions as a tuple."""
    if isinstance(directions, str):
        raise TypeError(f"directions must be a tuple of names, got the string {directions!r}")
    directions = tuple(directions)
    if not directions:
        raise ValueError("at least one direction must be specified")
    unknown = set(directions) - set(DIRECTIONS)
    if unknown:
        raise ValueError(f"invalid directions {sorted(unknown)}; valid: {DIRECTIONS}")
    if "query_to_doc" not in directions:
        raise ValueError("'query_to_doc' direction is required (it holds the positive pair)")
    _checks.check_choice("partition_mode", partition_mode, PARTITION_MODES)
    if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
        raise ValueError(
            "partition_mode='per_direction' needs every direction's candidates to include the positive pair; "
            "'query_to_query' and 'doc_to_doc' never do. Use partition_mode='joint'."
        )
    _checks.check_choice("hardness_mode", hardness_mode, HARDNESS_MODES)
    if not _checks.is_real_number(hardness_strength) or not (0 <= hardness_strength < float("inf")):
        raise ValueError(f"hardness_strength must be a finite number >= 0, got {hardness_strength!r}")
    return directions


def is_plain(directions, partition_mode, hardness_mode, hardness_strength) -> bool:
    """Options that are plain MNRL (:func:`fastcl.losses.mnrl_loss`'s structured fast path)."""
    return set(directions) == {"query_to_doc"} and (hardness_mode is None or hardness_strength == 0)


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the incoming gradient by ``factor`` (a 0-d tensor)."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: Tensor) -> Tensor:
        ctx.save_for_backward(factor)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (factor,) = ctx.saved_tensors
        return (grad * factor.to(grad.dtype)).to(grad.dtype), None


class _Batch:
    """The tensors and tags of one call, built once.

    ``q``, ``d`` (and ``negs``) are this rank's; ``cand_q``, ``cand_d``, ``cand_n`` are the
    candidate queries, documents and flattened negatives: the same tensors in one process,
    every rank's (all-gathered with gradient, rank-major) with a process group. Tags are
    relative to this rank's anchors: candidate ``g`` of query/document ``offset + i`` is
    tagged ``i`` (``own_b``, ``own_n``: left out of that row), or ``TAG_ALL`` (``all_b``,
    ``all_n``: in every row).
    """

    def __init__(
        self,
        q: Tensor,
        d: Tensor,
        negs: Tensor | None,
        tau: Tensor,
        cosine: bool,
        backend: str,
        strategy: str = "auto",
        group=None,
        dims=None,
        ring: bool = False,
    ):
        self.q, self.d, self.tau, self.cosine, self.backend, self.strategy = q, d, tau, cosine, backend, strategy
        self.dims = dims  # Matryoshka: every row is [K, B], one per prefix
        B, dim = q.shape
        dev = q.device
        self.B = B
        self.Q = 0 if negs is None else negs.shape[1]
        self.negs = negs
        negs_flat = negs.reshape(B * self.Q, dim) if negs is not None and self.Q else q.new_empty((0, dim))
        self.group = group if ring else None  # set: every primitive call goes round the ring
        if group is None or ring:  # the ring: this rank's candidates, tags for its own anchors
            world, self.offset = 1, 0
            self.cand_q, self.cand_d, self.cand_n = q, d, negs_flat
        else:
            world, self.offset = dist.get_world_size(group), dist.get_rank(group) * B
            self.cand_q, self.cand_d = (
                distributed.all_gather_with_grad(q, group),
                distributed.all_gather_with_grad(d, group),
            )
            self.cand_n = distributed.all_gather_with_grad(negs_flat, group) if self.Q else negs_flat
        owner = torch.arange(world * B, dtype=torch.int64, device=dev) - self.offset  # local anchor index
        local = (owner >= 0) & (owner < B)
        own = torch.where(local, owner, torch.full_like(owner, TAG_ALL)).to(torch.int32)
        self.own_b = own  # q_j / d_j left out of row j (this rank's j only)
        self.own_n = own.repeat_interleave(self.Q)  # n_jq left out of row j
        self.all_b = torch.full((world * B,), TAG_ALL, dtype=torch.int32, device=dev)
        self.all_n = torch.full((world * B * self.Q,), TAG_ALL, dtype=torch.int32, device=dev)
        self._pos: Tensor | None = None
        self.world = world if group is None or not ring else dist.get_world_size(group)

    def pair_logits(self, x: Tensor, ys: Tensor) -> Tensor:
        """``[B, P]`` differentiable logits ``l(x_i, ys_ip)`` (``[K, B, P]`` with dims)."""
        if self.dims is None:
            return positive_logits(x, ys, self.tau, cosine=self.cosine, eps=EPS)
        return torch.stack(
            [positive_logits(x[:, :m], ys[..., :m], self.tau, cosine=self.cosine, eps=EPS) for m in self.dims]
        )

    def own_negative_logits(self, x: Tensor) -> Tensor:
        """``[B, Q]`` (``[K, B, Q]``) logits of each row's own hard negatives, a gather."""
        assert self.negs is not None  # callers check Q > 0
        return self.pair_logits(x, self.negs)

    def pos(self) -> Tensor:
        """``[B]`` (``[K, B]``) differentiable positive logits ``l(q_i, d_i)`` (float32/64)."""
        if self._pos is None:
            self._pos = self.pair_logits(self.q, self.d[:, None, :])[..., 0]
        return self._pos

    def rows(self, anchor, block0, tags0, block1=None, tags1=None, *, fold=False, tau=None) -> Tensor:
        """``[B]`` (``[K, B]`` with dims): per row, ``LSE over the tagged candidates - l(q_i, d_i)``.

        ``fold``: the positive is row ``offset + i`` of ``block0`` (``cand_d`` for query rows,
        ``cand_q`` for document rows) and the backend folds its gradient; else it comes from
        :meth:`pos`.
        """
        if block1 is None:
            block1, tags1 = empty_block(anchor)
        tau = self.tau if tau is None else tau
        cd = compute_dtype(anchor.dtype)
        spec = LossSpec(
            "cross_entropy", (tags0, tags1), "none", torch.ones(self.B, dtype=cd, device=anchor.device),
            cosine=self.cosine, positives=OwnPositives(self.offset, 1) if fold else None, strategy=self.strategy,
            dims=self.dims,  # no dim_weights: the prefixes' rows, combined per prefix below
            backend=self.backend,
        )  # fmt: skip
        pos_logits = None if fold else self.pos()[..., None]
        if self.group is not None:  # sizes were checked once per loss call
            return ring_contrastive_loss(
                anchor, (block0, block1), tau, spec, pos_logits, group=self.group, handshake=False
            ).to(cd)
        return contrastive_loss(anchor, (block0, block1), tau, spec, pos_logits).to(cd)


def _cat(*pairs):
    blocks = [b for b, _ in pairs if b.shape[0]]
    tags = [t for b, t in pairs if b.shape[0]]
    if not blocks:
        return pairs[0][0], pairs[0][1]
    if len(blocks) == 1:
        return blocks[0], tags[0]
    return torch.cat(blocks), torch.cat(tags)


def _query_rows(bt: _Batch, with_q2q: bool, hardness_mode, alpha: float) -> Tensor:
    """``[B]``: ``log Z_i - l(q_i, d_i)`` over ``query_to_doc`` (hardened) and ``query_to_query``."""
    q = bt.q
    q2q = (bt.cand_q, bt.own_b) if with_q2q else (bt.cand_q[:0], bt.own_b[:0])
    if hardness_mode == "hard_negatives" and bt.Q == 0:
        hardness_mode = None  # nothing to harden (ST: no effect without explicit negatives)
    if hardness_mode is None or alpha == 0:
        b1, t1 = _cat((bt.cand_n, bt.all_n), q2q)
        return bt.rows(q, bt.cand_d, bt.all_b, b1, t1, fold=True)

    tau = bt.tau
    pieces = []
    if hardness_mode == "hard_negatives":
        # hardened: the query's own negatives, a [B, Q] gather (only row i holds them)
        own = bt.own_negative_logits(q)  # [B, Q]
        hard = own + alpha * (own * tau.to(own.dtype)).detach()
        pieces.append(torch.logsumexp(hard - bt.pos()[..., None], dim=-1))
        # unhardened: every other document and the queries
        b1, t1 = _cat((bt.cand_n, bt.own_n), q2q)
        pieces.append(bt.rows(q, bt.cand_d, bt.all_b, b1, t1, fold=True))
    else:
        # hardened candidates: one primitive call at tau_h with gradients scaled back to 1/tau
        factor = (1.0 / (1.0 + alpha * tau)).detach()
        tau_h = tau / (1.0 + alpha * tau)
        qs, ds = _ScaleGrad.apply(q, factor), _ScaleGrad.apply(bt.cand_d, factor)
        ns = _ScaleGrad.apply(bt.cand_n, factor) if bt.Q else bt.cand_n
        neg_tags = bt.own_n if hardness_mode == "in_batch_negatives" else bt.all_n
        # the folded positive (left out by its tag) comes back as s/tau_h: add alpha*stopgrad(s)
        s_pos = (bt.pos() * tau.to(bt.pos().dtype)).detach()
        pieces.append(bt.rows(qs, ds, bt.own_b, ns, neg_tags, fold=True, tau=tau_h) + alpha * s_pos)
        # unhardened: the positive itself (0 = l_pos - l_pos), the own negatives for
        # in_batch_negatives (a [B, Q] gather), the queries for query_to_query
        pieces.append(torch.zeros_like(s_pos))
        if hardness_mode == "in_batch_negatives" and bt.Q:
            own = bt.own_negative_logits(q)
            pieces.append(torch.logsumexp(own - bt.pos()[..., None], dim=-1))
        if with_q2q:
            pieces.append(bt.rows(q, bt.cand_q, bt.own_b))
    return torch.logsumexp(torch.stack(pieces), dim=0)


def _doc_rows(bt: _Batch, with_d2q: bool, with_d2d: bool) -> Tensor:
    """``[B]``: ``LSE - l(q_i, d_i)`` of the rows of ``d_i`` (``doc_to_query`` and/or ``doc_to_doc``)."""
    d = bt.d
    docs = _cat((bt.cand_d, bt.own_b), (bt.cand_n, bt.own_n))  # a query's own documents leave its row
    if with_d2q:  # the positive l(q_i, d_i) is row offset + i of the queries: fold it
        if with_d2d:
            return bt.rows(d, bt.cand_q, bt.all_b, *docs, fold=True)
        return bt.rows(d, bt.cand_q, bt.all_b, fold=True)
    return bt.rows(d, *docs)


def loss_rows(
    anchor: Tensor,
    positive: Tensor,
    negatives: Tensor | None,
    tau: Tensor,
    *,
    directions: tuple[str, ...],
    partition_mode: str,
    hardness_mode: str | None,
    alpha: float,
    cosine: bool,
    backend: str,
    strategy: str = "auto",
    group=None,
    ring: bool = False,
    dims: tuple[int, ...] | None = None,
) -> Tensor:
    """``[B]`` loss rows ``log Z_i - l(q_i, d_i)`` of the selected directions (``[K, B]`` with
    Matryoshka ``dims``, one per prefix) of validated inputs (``negatives [B, Q, d]`` or None).
    ``ring``: the group's candidates go round the ring (``cross_device="ring"``; the caller
    checked that every rank passes the same sizes)."""
    dirs = set(directions)
    bt = _Batch(
        anchor.contiguous(),
        positive.contiguous(),
        negatives,
        tau,
        cosine,
        backend,
        strategy,
        group=group,
        dims=dims,
        ring=ring,
    )
    if partition_mode == "joint":
        rows = _query_rows(bt, "query_to_query" in dirs, hardness_mode, alpha)
        if dirs & {"doc_to_query", "doc_to_doc"}:
            rows = torch.logaddexp(rows, _doc_rows(bt, "doc_to_query" in dirs, "doc_to_doc" in dirs))
        return rows
    # per_direction: query_to_doc and optionally doc_to_query
    rows = _query_rows(bt, False, hardness_mode, alpha)
    if "doc_to_query" in dirs:
        rows = 0.5 * (rows + _doc_rows(bt, True, False))
    return rows
