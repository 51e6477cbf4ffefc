"""``cross_device="ring"``: every anchor sees every rank's candidates, and no rank holds them all.

The gather mode (``fastcl.distributed``) all-gathers the candidates, so each rank holds
``W * N * d`` of them and as many gradients. Here each rank keeps its anchors and its
candidate blocks stay where they are; copies travel around the ring in pieces (row ranges,
``ring_comm``: one local step, then ``pieces`` chained rounds of ``W - 1`` hops):

* forward: each step runs the backend's ``forward`` on what the rank holds, its own blocks
  (whole) or a piece of another rank's (its tags made foreign: another rank's owner tags
  become ``TAG_ALL``, and own positives are folded only from this rank's block 0) while the
  next piece is in flight; the partial ``(lse, mean_logit)`` merge online
  (``blockwise.Merged``, fixed order: reproducible for a world size and piece count); then
  the loss head runs once on the merged ``lse``.
* backward: the pieces go round again; for each, ``backward`` with ``g_t = g * exp(lse_t -
  lse)`` (``blockwise.block_grad``) gives this rank's share of that piece's gradient, added
  to the piece's accumulator, which travels with it and is added at home to the owner's
  share; the anchor gradient stays local. Every other rank's candidates cost 4 GEMM-sized
  passes (forward, then recompute and two products).
* the own blocks, when the backend has a gradient-in-forward sweep (``Backend.fused``: mean
  or sum reduction, with Matryoshka dims only where the sweep takes them, strategy not
  ``"recompute"``): they are visited last,
  once every other piece's ``lse`` is merged, by that sweep with the merged ``lse`` as the
  head's ``log_extra`` (``logaddexp(lse_own, lse_others)`` is the final ``lse``), which gives
  its loss rows and its share of the gradients (for an upstream gradient of 1) in 3 passes;
  they are kept (one block of gradients, compute dtype) and are the start of the own
  gradients in backward. ``W`` ranks' candidates then cost ``4W - 1`` passes instead of ``4W``.

Each rank keeps one partial ``lse`` row per item visited (``[1 + (W-1) * pieces, B]``, with
dims ``[.., K, B]``) between forward and backward, against ``W * N * d`` elements for the
gather. The valid-anchor count travels with piece 0, so the reduction weights are those of
the gather mode (``W / n_valid_global`` for mean, ``W`` for sum; docs/distributed.md) and
DDP's averaging gives exactly the one-process gradient. A rank that fails makes every rank
raise at the end of that pass (``ring_comm``); a second derivative raises.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .. import distributed
from .blockwise import Merged, block_grad, foreign_tags
from .contract import Filter, LSEProblem, compute_dtype
from .contrastive import LossSpec, _first_order_only, _own_logits, _strategy, _tau_grad, head_of
from .head import HeadInputs, reduction_weights
from .ring_comm import RingComm, circulate, circulate_grads

NO_POSITIVE = "no anchor of any rank has a valid positive (pos_mask is all False everywhere): the loss is undefined"
SECOND_ORDER = (
    "fastcl: cross_device='ring' computes first derivatives only, so the gradient of its gradient "
    "(create_graph=True, double backward) is not available; use cross_device='gather' with "
    "backend='reference' for second derivatives"
)


@dataclass(frozen=True)
class RingSpec:
    """A ring call: the loss (``LossSpec`` with this rank's tags and own-positive layout), the
    ring, and where the reduction weights come from: ``has_pos [B]`` (weights from the global
    valid-anchor count, raising ``ValueError(no_positive)`` on every rank when it is 0 and
    ``check_positive``) or, when None, ``loss.weights`` as given."""

    loss: LossSpec
    comm: RingComm
    has_pos: Tensor | None
    check_positive: bool = False
    no_positive: str = NO_POSITIVE

    def payload(self, block0: Tensor, block1: Tensor) -> list[Tensor]:
        """What travels: the two blocks, their tags, (``[1]``, int32) this rank's valid-anchor
        count (a row range of its own, so only piece 0 carries it) and, with a guide filter,
        the blocks' guide embeddings (row ranges like the blocks')."""
        tags = self.loss.tags
        count = torch.zeros(1, dtype=torch.int32, device=tags[0].device)
        if self.has_pos is not None:
            count = self.has_pos.sum().to(device=tags[0].device, dtype=torch.int32).reshape(1)
        f = self.loss.filter
        guide = [] if f is None or f.guide_blocks is None else [g.contiguous() for g in f.guide_blocks]
        return [block0, block1, tags[0], tags[1], count, *guide]

    def problem(self, anchor: Tensor, payload: list[Tensor], own: bool) -> LSEProblem:
        """This rank's anchors against what it holds: its own payload (whole) or a piece of
        another rank's."""
        b0, b1, t0, t1, _, *guide = payload
        ls = self.loss
        if own:
            return ls.problem(anchor, b0, b1)
        f = ls.filter
        if f is not None and guide:  # the piece's guide rows travelled with it
            f = Filter(f.threshold, f.guide_anchor, (guide[0], guide[1]))
        tags = (foreign_tags(t0), foreign_tags(t1))
        return LSEProblem(anchor, (b0, b1), tags, ls.cosine, ls.eps, None, ls.dims, filter=f)


def _weights(spec: RingSpec, counts: list[Tensor], dtype: torch.dtype) -> Tensor:
    """``[B]`` reduction weights; with ``has_pos`` those of the global batch (see RingSpec)."""
    if spec.has_pos is None:
        return spec.loss.row_weights
    total = torch.cat(counts).sum()
    if spec.check_positive and int(total) == 0:  # every rank has the same total: all raise
        raise ValueError(spec.no_positive)
    weights = reduction_weights(spec.has_pos, spec.loss.reduction, dtype, denominator=total.to(dtype))
    return weights if spec.loss.reduction == "none" else weights * spec.comm.world


def _fuses_own(ls: LossSpec, needs_grad: bool) -> bool:
    """Whether the own block runs the backend's gradient-in-forward sweep (module docstring);
    a ``"fused"`` strategy where it cannot raises, as in one process."""
    return needs_grad and _strategy(ls) == "fused"


def _own_sweep(ls: LossSpec, own, tau: Tensor, pos_values: Tensor, others: Tensor | None, weights: Tensor):
    """The own block's gradient-in-forward sweep with the other blocks' merged ``lse`` (or
    None; ``[K, B]`` with dims) as extra denominator mass: ``(lse_own, mean_logit_own,
    d_anchor, (d0, d1))``."""
    extra = others
    if ls.log_extra is not None:
        own_extra = ls.log_extra.to(pos_values.dtype)
        extra = own_extra if extra is None else torch.logaddexp(extra, own_extra)
    assert ls.impl.fused is not None  # _fuses_own checked it
    out = ls.impl.fused(own, tau, HeadInputs(ls.kind, pos_values, ls.pos_mask, extra, ls.head_weights(weights)))
    d_anchor, d_blocks, _, _, _ = out.sweep_outputs()
    return out.lse, out.mean_logit, d_anchor, d_blocks


class RingLSE(torch.autograd.Function):
    """``ContrastiveLSE`` with the candidates of every rank of a ring (module docstring):
    inputs ``anchor [B, d]``, this rank's ``block0 [N0, d]``, ``block1 [N1, d]``, ``pos_logits``
    (``[B, P]`` / ``[K, B, P]``, or None: own positives folded from block 0), ``tau``; output
    the reduced loss (rows ``[B]`` for ``reduction="none"``) of this rank's anchors."""

    @staticmethod
    def forward(ctx, anchor, block0, block1, pos_logits, tau, spec: RingSpec):
        ls, comm = spec.loss, spec.comm
        cd = compute_dtype(anchor.dtype)
        folded = pos_logits is None
        own = ls.problem(anchor, block0, block1)
        fuse_own = _fuses_own(ls, any(ctx.needs_input_grad[:5]))
        merged, counts = Merged(), []
        partials: dict[tuple[int, int | None], Tensor] = {}  # (source, piece): its lse_t
        own_grads: tuple = ()
        pos_values: Tensor | None = None

        def positive_values() -> Tensor:
            return (_own_logits(ls, own, tau) if folded else pos_logits).detach().to(cd)

        def visit(source: int, piece: int | None, payload: list[Tensor]) -> None:
            nonlocal pos_values
            if payload[4].numel():  # the own payload, or piece 0 of another rank's
                counts.append(payload[4].clone())  # the buffer is reused by a later receive
            if fuse_own and piece is None:
                pos_values = positive_values()  # while the first piece is in flight; the sweep runs last
                return
            if piece is not None and payload[0].shape[0] + payload[1].shape[0] == 0:
                return  # an empty piece (fewer candidate rows than pieces): nothing to merge
            lse_t, ml_t = ls.impl.forward(spec.problem(anchor, payload, piece is None), tau)
            merged.add(lse_t, ml_t)
            partials[source, piece] = lse_t

        failure = circulate(comm, spec.payload(block0, block1), visit)
        if failure is None:
            try:  # an error here (no valid positive anywhere) is every rank's: all agree below
                pos_values = positive_values() if pos_values is None else pos_values
                weights = _weights(spec, counts, cd)
                if fuse_own:
                    lse_t, ml_t, *own_grads = _own_sweep(ls, own, tau, pos_values, merged.lse, weights)
                    merged.add(lse_t, ml_t)
                    partials[comm.rank, None] = lse_t
                assert merged.lse is not None  # every rank's block was merged
                loss_rows, dlse, dpos = head_of(ls, merged.lse, pos_values)
            except Exception as exc:
                failure = exc
        comm.agree_on_status(failure, "forward")

        ctx.spec, ctx.dtype, ctx.folded, ctx.weights = spec, anchor.dtype, folded, weights
        ctx.own_grads = own_grads  # (d_anchor, (d0, d1)) of the own block for grad_out = 1, or ()
        if any(ctx.needs_input_grad[:5]):
            saved = (anchor, block0, block1, tau, pos_logits, merged.lse, merged.mean_logit)
            ctx.visits = {key: i for i, key in enumerate(partials)}  # every item visited
            ctx.save_for_backward(*saved, dlse, dpos, pos_values, torch.stack(list(partials.values())))
        out = loss_rows if ls.reduction == "none" else (loss_rows * weights.to(cd)).sum()
        return out.to(anchor.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: mark the gradients first-order only
            with torch.no_grad():
                grads = RingLSE._grads(ctx, grad_out)
            return _first_order_only(ctx.spec.loss.impl.name, grads, SECOND_ORDER)
        return RingLSE._grads(ctx, grad_out)

    @staticmethod
    def _grads(ctx, grad_out):
        spec, ls, comm = ctx.spec, ctx.spec.loss, ctx.spec.comm
        anchor, block0, block1, tau, pos_input, lse, mean_logit, dlse, dpos, pos_values, partials = ctx.saved_tensors
        cd = compute_dtype(ctx.dtype)
        go = grad_out.to(cd)
        row_w = go * ctx.weights.to(cd) if ls.reduction != "none" else go  # [B] (or [K, B])
        g = dlse * row_w
        d_pos = dpos * row_w[..., None]
        d_anchor = torch.zeros(anchor.shape, dtype=cd, device=anchor.device)

        own_grads, ctx.own_grads = ctx.own_grads, ()  # released once they have started the accumulator

        def contribute(source: int, piece: int | None, payload: list[Tensor]) -> list[Tensor]:
            own = piece is None
            if own and own_grads:  # formed in forward for grad_out = 1 (own positives folded in)
                d_a, (d0, d1) = own_grads
                d_anchor.add_(d_a * go)
                return [d0.mul_(go), d1.mul_(go)]
            if (source, piece) not in ctx.visits:  # an empty piece
                return [torch.zeros(b.shape, dtype=cd, device=b.device) for b in payload[:2]]
            lse_t = partials[ctx.visits[source, piece]]
            fold = d_pos if own and ctx.folded else None  # own positives: this rank's block only
            d_a, (d0, d1) = ls.impl.backward(
                spec.problem(anchor, payload, own), tau, lse_t, block_grad(g, lse, lse_t), fold
            )
            d_anchor.add_(d_a)
            return [d0, d1]

        def zeros() -> list[Tensor]:
            return [torch.zeros(b.shape, dtype=cd, device=b.device) for b in (block0, block1)]

        (d_b0, d_b1), failure = circulate_grads(comm, spec.payload(block0, block1), contribute, zeros)
        comm.agree_on_status(failure, "backward")
        d_tau = None
        if ctx.needs_input_grad[4]:
            d_tau = _tau_grad((g * mean_logit).sum(), d_pos, pos_values, tau, ctx.folded).to(tau.dtype)
        d_inputs = (t.to(ctx.dtype) for t in (d_anchor, d_b0, d_b1))
        return (*d_inputs, None if ctx.folded else d_pos, d_tau, None)


def ring_contrastive_loss(
    anchor: Tensor,
    blocks: tuple[Tensor, Tensor],
    tau: Tensor,
    spec: LossSpec,
    pos_logits: Tensor | None = None,
    *,
    group,
    has_pos: Tensor | None = None,
    check_positive: bool = False,
    no_positive: str = NO_POSITIVE,
    sizes: dict[str, int] | None = None,
    handshake: bool = True,
) -> Tensor:
    """:func:`~fastcl.ops.contrastive.contrastive_loss` over every rank of ``group``'s candidates,
    by the ring (module docstring). Arguments as there, all of them this rank's: ``spec.tags``
    name this rank's anchors (rows ``0..B-1``), ``spec.positives`` is the own-positive layout
    in this rank's block 0. Give ``has_pos [B]`` (anchors with a valid positive: the weights
    are the gather mode's, from the global count; ``check_positive`` raises when it is 0) or
    ``spec.weights [B]`` (used as given); ``no_positive``: that error's message. ``sizes``: the
    named sizes every rank must share (at most six; default the block shapes), checked by one
    handshake unless ``handshake=False`` (the caller checked shapes and dtype already). Every
    rank must call it, and backward."""
    if (has_pos is None) == (spec.weights is None):
        raise TypeError("ring_contrastive_loss takes has_pos or spec.weights (exactly one)")
    anchor = anchor.contiguous()
    blocks = (blocks[0].contiguous(), blocks[1].contiguous())
    # the pieces of other ranks may carry padding
    spec = replace(spec, tags=(spec.tags[0].contiguous(), spec.tags[1].contiguous()), padded=True)
    if handshake:
        shapes = {"B": anchor.shape[0], "N0": blocks[0].shape[0], "N1": blocks[1].shape[0], "d": anchor.shape[1]}
        distributed.check_same_sizes(group, sizes or shapes, blocks[0].dtype)
    spec = spec.choose(spec.problem(anchor, *blocks))
    ring = RingSpec(spec, RingComm(group), has_pos, check_positive, no_positive)
    return RingLSE.apply(anchor, blocks[0], blocks[1], pos_logits, tau, ring)
