"""Chunked PyTorch backend (``"torch"``): the primitive's exact contract without a B x N buffer.

Blocks of anchor rows whose ``[R, N]`` logits exist only while the block is processed
(``R * N <=`` :func:`tile_elements`): extra memory O((B + N) * d + tile). Forward,
recompute-backward and gradient-in-forward are one loop, :func:`_sweep`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import config
from . import _torch_prefix
from .backend import Backend
from .contract import TAG_PADDING, FusedResult, LSEProblem, excluded, new_output
from .head import HeadInputs
from .normalize import normalize_backward, normalize_rows


def tile_elements() -> int:
    """Elements of one ``[R, N]`` float32 tile: ``fastcl.config``'s ``torch.tile`` (default 2^22,
    16 MB; a block holds about three). Measured on the 2-core CI machine
    (benchmarks/bench_losses.py): 2^20..2^23 are within 5 % of each other at d = 768; smaller
    tiles lose GEMM efficiency, larger ones only add memory."""
    return config.get().torch.tile


@dataclass
class _Prepared:
    a_hat: Tensor  # [B, d] compute dtype
    a_norm: Tensor | None
    c_hat: Tensor  # [N, d] compute dtype, both blocks
    c_norm: Tensor | None
    tags: Tensor  # int32 [N]


def _keep(tags: Tensor) -> Tensor | None:
    """Rows to read (not padding), or None when every row is read: on the CPU that costs
    nothing to find out and saves a copy of the block; on a GPU it would be a host sync."""
    keep = tags != TAG_PADDING
    # (not while torch.compile traces: reading a value would break the graph)
    if tags.device.type == "cpu" and not torch.compiler.is_compiling() and bool(keep.all()):
        return None
    return keep


def _prepare(problem: LSEProblem) -> _Prepared:
    a_hat, a_norm = normalize_rows(problem.anchor, problem.eps, problem.cosine)
    # one [N, d] matrix of both blocks; no concatenation copy when the second is empty
    nonempty = [i for i, b in enumerate(problem.blocks) if b.shape[0] > 0] or [0]
    # padded candidates are read as zeros (never their values: they may hold NaN/Inf)
    parts = [normalize_rows(problem.blocks[i], problem.eps, problem.cosine, _keep(problem.tags[i])) for i in nonempty]
    tags = [problem.tags[i] for i in nonempty]
    if len(parts) == 1:
        return _Prepared(a_hat, a_norm, parts[0][0], parts[0][1], tags[0])
    c_norm = None if not problem.cosine else torch.cat([p[1] for p in parts if p[1] is not None])  # all, cosine
    return _Prepared(a_hat, a_norm, torch.cat([p[0] for p in parts]), c_norm, torch.cat(tags))


def _fold_positives(
    prep: _Prepared, problem: LSEProblem, d_pos: Tensor, inv_tau: Tensor, d_a_hat: Tensor, d_c_hat: Tensor
) -> None:
    """Add the own-positive logits' gradient to the float32 accumulators, in place."""
    B, d = prep.a_hat.shape
    assert problem.positives is not None  # the caller folds only with own positives
    rows = problem.positives.rows(0, B)
    scaled = d_pos.to(d_a_hat.dtype) * inv_tau  # [B, P]
    c_pos = prep.c_hat[rows].view(B, -1, d)
    d_a_hat.add_(torch.bmm(scaled.unsqueeze(1), c_pos).squeeze(1))
    d_c_hat[rows].view(B, -1, d).addcmul_(scaled.unsqueeze(-1), prep.a_hat.unsqueeze(1))


def _sweep(
    problem: LSEProblem,
    tau: Tensor,
    *,
    row_grad: Tensor | None = None,
    head: HeadInputs | None = None,
    d_pos: Tensor | None = None,
) -> FusedResult:
    """One pass over blocks of anchor rows: forward only; recompute-backward with ``row_grad``
    (``[B]``, ``dLoss/dlse``) and ``d_pos`` (``[B, P]``, folded when ``problem.positives`` is
    set); gradient in forward with ``head``."""
    prep = _prepare(problem)
    B, N = prep.a_hat.shape[0], prep.c_hat.shape[0]
    cd = prep.a_hat.dtype
    inv_tau = tau.to(cd).reciprocal()
    want_grad = row_grad is not None or head is not None

    lse = new_output(B, dtype=cd, device=problem.device)
    mean_logit = new_output(B, dtype=cd, device=problem.device)
    if want_grad:
        d_a_hat = new_output(prep.a_hat.shape, dtype=cd, device=problem.device)
        d_c_hat = torch.zeros_like(prep.c_hat)
        g_dot_ml = torch.zeros((), dtype=cd, device=problem.device)
    if head is not None:
        assert head.pos_logits is not None  # the torch backend does not form them (forms_own_logits)
        loss_rows = new_output(B, dtype=cd, device=problem.device)
        head_d_pos = new_output(head.pos_logits.shape, dtype=cd, device=problem.device)

    step = max(1, min(B, tile_elements() // max(N, 1)))  # anchor rows per block
    for r0 in range(0, B, step):
        r1 = min(B, r0 + step)
        a_blk = prep.a_hat[r0:r1] * inv_tau  # 1/tau on the [R, d] side, not on [R, N]
        logits = a_blk @ prep.c_hat.T  # [R, N]
        rows = torch.arange(r0, r1, device=problem.device)
        # with a gradient to form, mean_logit comes from a GEMM we do anyway (below), so the
        # raw logits are not needed again and the mask goes in place
        drop = excluded(prep.tags, rows)
        masked = logits.masked_fill_(drop, float("-inf")) if want_grad else logits.masked_fill(drop, float("-inf"))
        # log-sum-exp by hand so exp runs once: its result becomes the softmax in place
        row_max = masked.amax(dim=1)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # empty row
        probs = masked.sub_(row_max[:, None]).exp_()
        total = probs.sum(dim=1)
        blk_lse = total.log().add_(row_max)  # -inf for an empty row
        lse[r0:r1] = blk_lse
        # an empty row gets all-zero softmax weights instead of NaN
        probs.mul_(torch.where(total > 0, total.reciprocal(), torch.zeros_like(total))[:, None])
        if not want_grad:
            mean_logit[r0:r1] = torch.bmm(probs.unsqueeze(1), logits.unsqueeze(2)).view(-1)
            continue

        # sum_c p_ic c_hat_c: the anchor-gradient GEMM, and <a_i/tau, .> is the mean logit
        p_c = torch.mm(probs, prep.c_hat, out=d_a_hat[r0:r1])
        blk_ml = torch.linalg.vecdot(a_blk, p_c)
        mean_logit[r0:r1] = blk_ml
        if head is not None:
            blk_loss, g, blk_dpos = head.rows(r0, r1, blk_lse)
            loss_rows[r0:r1] = blk_loss
            head_d_pos[r0:r1] = blk_dpos
        else:
            assert row_grad is not None  # want_grad without a head: the recompute backward
            g = row_grad[r0:r1].to(cd)
        g_dot_ml += torch.dot(g, blk_ml)
        # dLoss/dsim_ic = g_i * p_ic / tau; padded columns have p = 0 exactly
        p_c.mul_((g * inv_tau)[:, None])
        d_c_hat.addmm_(probs.mul_(g[:, None]).T, a_blk)  # a_blk carries the 1/tau

    out = FusedResult(lse, mean_logit)
    # the own positives' logit gradient: given (recompute backward) or formed by the head (fused)
    fold = head_d_pos if head is not None else d_pos
    if want_grad and fold is not None and problem.positives is not None:
        _fold_positives(prep, problem, fold, inv_tau, d_a_hat, d_c_hat)
    if want_grad:
        out.d_anchor = normalize_backward(prep.a_hat, prep.a_norm, d_a_hat, problem.eps)
        d_c = normalize_backward(prep.c_hat, prep.c_norm, d_c_hat, problem.eps)
        if (keep := _keep(prep.tags)) is not None:  # padding: exactly 0, not 0 * NaN from a NaN anchor row
            d_c.masked_fill_(~keep[:, None], 0)
        n0 = problem.blocks[0].shape[0]
        out.d_blocks, out.g_dot_mean_logit = (d_c[:n0], d_c[n0:]), g_dot_ml
    if head is not None:
        out.loss_rows, out.d_pos = loss_rows, head_d_pos
    return out


class TorchLSE(Backend):
    """The ``"torch"`` backend of the masked-LSE primitive."""

    name = "torch"

    def forward(self, problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor]:
        if problem.dims is not None:
            return _torch_prefix.forward(problem, tau)
        out = _sweep(problem, tau)
        return out.lse, out.mean_logit

    def backward(self, problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None = None):
        if problem.dims is not None:
            return _torch_prefix.backward(problem, tau, lse, g, d_pos)
        out = _sweep(problem, tau, row_grad=g, d_pos=d_pos)
        return out.d_anchor, out.d_blocks

    def fused(self, problem: LSEProblem, tau: Tensor, head: HeadInputs) -> FusedResult:
        return _sweep(problem, tau, head=head)


BACKEND = TorchLSE()
