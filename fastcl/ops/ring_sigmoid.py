"""``cross_device="ring"`` for the sigmoid losses (SigLIP): every anchor meets every rank's
candidates, and no rank holds them all (the tour: ``ring_comm``; the LSE ring: ``ring.py``).

A row's value is a plain sum over its candidates, so blocks need no merge rule beyond
addition and each block's share of the gradient is the backend's ``backward`` with the
row's own upstream gradient ``g`` (no ``exp(lse_t - lse)`` factor as for the LSE):

* forward: the pieces go round (``circulate``); each step runs the backend's ``forward`` on
  what the rank holds (its own blocks, whose pairs are the ``z = +1`` terms; another rank's
  piece with ``positives=None``: all ``z = -1``) and adds its values and row statistics;
* backward: the pieces go round again (``circulate_grads``); each step's ``backward`` gives
  this rank's share of the piece's gradient, which travels home in the piece's accumulator.

Memory per rank: two pieces in flight and one accumulator, constant in ``W``; what open_clip's
neighbour exchange keeps instead is a ``[B, B]`` logits block per exchange for autograd.
The reduction weights are the gather mode's (the valid-row count travels with piece 0).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .. import distributed
from .blockwise import foreign_tags
from .contract import Filter, LSEProblem, Sigmoid, compute_dtype
from .contrastive import LossSpec, _first_order_only
from .head import reduction_weights
from .ring import SECOND_ORDER
from .ring_comm import RingComm, circulate, circulate_grads
from .sigmoid import _scalar_grads, value_grads


class _Ring:
    """A sigmoid ring call: the loss (``LossSpec``, this rank's tags and pairs), the ring,
    ``has_row [B]`` (rows that count) and the guide embeddings that travel with the blocks."""

    def __init__(self, spec: LossSpec, comm: RingComm, has_row: Tensor, check_rows: bool):
        self.spec, self.comm, self.has_row, self.check_rows = spec, comm, has_row, check_rows

    def payload(self, block0: Tensor, block1: Tensor) -> list[Tensor]:
        """The two blocks, their tags, the valid-row count (piece 0 only) and any guide blocks."""
        s = self.spec
        count = self.has_row.sum().to(device=s.tags[0].device, dtype=torch.int32).reshape(1)
        guide = list(s.filter.guide_blocks) if s.filter is not None and s.filter.guide_blocks is not None else []
        return [block0, block1, s.tags[0], s.tags[1], count, *guide]

    def problem(self, anchor: Tensor, payload: list[Tensor], own: bool, bias: Tensor) -> LSEProblem:
        s = self.spec
        b0, b1, t0, t1, _, *guide = payload
        if own:
            return s.problem(anchor, b0, b1, Sigmoid(bias))
        filt = s.filter
        if filt is not None and guide:
            filt = Filter(filt.threshold, filt.guide_anchor, (guide[0], guide[1]))
        return LSEProblem(
            anchor, (b0, b1), (foreign_tags(t0), foreign_tags(t1)), s.cosine, s.eps, None, s.dims,
            filter=filt, sigmoid=Sigmoid(bias),
        )  # fmt: skip

    def weights(self, counts: list[Tensor], dtype: torch.dtype) -> Tensor:
        total = torch.cat(counts).sum()
        if self.check_rows and int(total) == 0:  # every rank has the same total: all raise
            raise ValueError("no row of any rank is valid (mask is all False everywhere): the loss is undefined")
        w = reduction_weights(self.has_row, self.spec.reduction, dtype, denominator=total.to(dtype))
        return w if self.spec.reduction == "none" else w * self.comm.world


class RingSigmoid(torch.autograd.Function):
    """``SigmoidPairs`` over every rank's candidates (module docstring): inputs ``anchor``,
    this rank's ``block0``, ``block1``, ``tau``, ``bias``; output this rank's reduced loss."""

    @staticmethod
    def forward(ctx, anchor, block0, block1, tau, bias, ring: _Ring):
        cd = compute_dtype(anchor.dtype)
        b = bias.detach().to(cd)
        values: list[Tensor] = []
        stats: list[Tensor] = []
        counts: list[Tensor] = []

        def visit(source: int, piece: int | None, payload: list[Tensor]) -> None:
            if payload[4].numel():  # the own payload, or piece 0 of another rank's
                counts.append(payload[4].clone())
            if piece is not None and payload[0].shape[0] + payload[1].shape[0] == 0:
                return  # an empty piece
            v, st = ring.spec.impl.forward(ring.problem(anchor, payload, piece is None, b), tau)
            values.append(v)
            stats.append(st)

        failure = circulate(ring.comm, ring.payload(block0, block1), visit)
        weights = None
        if failure is None:
            try:
                weights = ring.weights(counts, cd)
            except Exception as exc:
                failure = exc
        ring.comm.agree_on_status(failure, "forward")
        assert weights is not None
        value, stat = torch.stack(values).sum(0), torch.stack(stats).sum(0)
        spec = replace(ring.spec, weights=weights)
        ctx.ring, ctx.spec, ctx.dtype = ring, spec, anchor.dtype
        ctx.save_for_backward(anchor, block0, block1, tau, bias, stat)
        rows = spec.combine(value)
        out = rows if spec.reduction == "none" else (rows * weights.to(cd)).sum()
        return out.to(anchor.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: first derivatives only
            with torch.no_grad():
                grads = RingSigmoid._grads(ctx, grad_out)
            return _first_order_only(ctx.spec.impl.name, grads, SECOND_ORDER)
        return RingSigmoid._grads(ctx, grad_out)

    @staticmethod
    def _grads(ctx, grad_out):
        ring, spec = ctx.ring, ctx.spec
        anchor, block0, block1, tau, bias, stat = ctx.saved_tensors
        cd = compute_dtype(ctx.dtype)
        b = bias.detach().to(cd)
        g = value_grads(spec, grad_out.to(cd))
        d_anchor = torch.zeros(anchor.shape, dtype=cd, device=anchor.device)

        def contribute(source: int, piece: int | None, payload: list[Tensor]) -> list[Tensor]:
            if piece is not None and payload[0].shape[0] + payload[1].shape[0] == 0:
                return [torch.zeros(t.shape, dtype=cd, device=t.device) for t in payload[:2]]
            problem = ring.problem(anchor, payload, piece is None, b)
            d_a, (d0, d1) = spec.impl.backward(problem, tau, g, g)  # the value is not read
            d_anchor.add_(d_a)
            return [d0, d1]

        def zeros() -> list[Tensor]:
            return [torch.zeros(t.shape, dtype=cd, device=t.device) for t in (block0, block1)]

        (d_b0, d_b1), failure = circulate_grads(ring.comm, ring.payload(block0, block1), contribute, zeros)
        ring.comm.agree_on_status(failure, "backward")
        d_tau, d_bias = _scalar_grads(stat, g, tau)
        grads = [t.to(ctx.dtype) for t in (d_anchor, d_b0, d_b1)]
        return (*grads, d_tau.to(tau.dtype), d_bias.to(bias.dtype), None)


def ring_sigmoid_loss(
    anchor: Tensor,
    blocks: tuple[Tensor, Tensor],
    tau: Tensor,
    bias: Tensor,
    spec: LossSpec,
    *,
    group,
    has_row: Tensor,
    check_rows: bool,
    sizes: dict[str, int],
) -> Tensor:
    """:func:`~fastcl.ops.sigmoid.sigmoid_loss` over every rank of ``group``'s candidates by the
    ring (module docstring); arguments as there, all this rank's (``spec.weights`` unset: they
    come from the global count). ``has_row [B]``: the rows that count (``check_rows`` raises
    on every rank when none does). ``sizes``: the named sizes every rank must share (one
    handshake). Every rank must call it, and backward."""
    anchor = anchor.contiguous()
    blocks = (blocks[0].contiguous(), blocks[1].contiguous())
    # the weights come from the global count in forward; the other ranks' pieces recompute
    spec = replace(spec, tags=(spec.tags[0].contiguous(), spec.tags[1].contiguous()), padded=True, strategy="recompute")
    distributed.check_same_sizes(group, sizes, blocks[0].dtype)
    cd = compute_dtype(anchor.dtype)
    spec = spec.choose(spec.problem(anchor, *blocks, Sigmoid(bias.detach().to(cd))))
    ring = _Ring(spec, RingComm(group), has_row, check_rows)
    return RingSigmoid.apply(anchor, blocks[0], blocks[1], tau, bias, ring)
