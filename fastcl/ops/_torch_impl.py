"""Chunked PyTorch backend (``"torch"``): the primitive's exact contract without a B x N buffer.

Blocks of anchor rows whose ``[R, N]`` logits exist only while the block is processed
(``R * N <=`` :func:`tile_elements`): extra memory O((B + N) * d + tile). Forward,
recompute-backward and gradient-in-forward are one loop, :func:`_sweep`, for both
reductions (the LSE, and the sigmoid of ``problem.sigmoid``) and with a ``problem.filter``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import config
from . import _torch_prefix
from .backend import Backend
from .contract import (
    TAG_PADDING,
    FusedResult,
    LSEProblem,
    excluded,
    filtered,
    finite_or_zero,
    new_output,
    own_positive_columns,
)
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
    # with a filter: NaN for a row that held a non-finite value (read as zeros above), else 0
    poison_a: Tensor | None = None  # [B]
    poison_c: Tensor | None = None  # [N]
    guide_a: Tensor | None = None  # [B, g] normalised guide rows (guide filter)
    guide_c: Tensor | None = None  # [N, g]


def _keep(tags: Tensor) -> Tensor | None:
    """Rows to read (not padding), or None when every row is read: on the CPU that costs
    nothing to find out and saves a copy of the block; on a GPU it would be a host sync."""
    keep = tags != TAG_PADDING
    # (not while torch.compile traces: reading a value would break the graph)
    if tags.device.type == "cpu" and not torch.compiler.is_compiling() and bool(keep.all()):
        return None
    return keep


def _prepare(problem: LSEProblem) -> _Prepared:
    f = problem.filter
    anchor, blocks = problem.anchor, problem.blocks
    if f is not None:  # non-finite rows read as zeros, their NaN added to the logits (contract.Filter)
        anchor, poison_a = finite_or_zero(anchor)
        (b0, p0), (b1, p1) = finite_or_zero(blocks[0]), finite_or_zero(blocks[1])
        blocks = (b0, b1)
        pad = torch.cat(problem.tags) == TAG_PADDING  # padding is read as zeros: no poison either
        poison_c = torch.cat([p0, p1]).masked_fill(pad, 0.0)
    a_hat, a_norm = normalize_rows(anchor, problem.eps, problem.cosine)
    # one [N, d] matrix of both blocks; no concatenation copy when the second is empty
    nonempty = [i for i, b in enumerate(blocks) if b.shape[0] > 0] or [0]
    # padded candidates are read as zeros (never their values: they may hold NaN/Inf)
    parts = [normalize_rows(blocks[i], problem.eps, problem.cosine, _keep(problem.tags[i])) for i in nonempty]
    tags = [problem.tags[i] for i in nonempty]
    if len(parts) == 1:
        prep = _Prepared(a_hat, a_norm, parts[0][0], parts[0][1], tags[0])
    else:
        c_norm = None if not problem.cosine else torch.cat([p[1] for p in parts if p[1] is not None])  # all, cosine
        prep = _Prepared(a_hat, a_norm, torch.cat([p[0] for p in parts]), c_norm, torch.cat(tags))
    if f is not None:
        prep.poison_a, prep.poison_c = poison_a, poison_c
        if f.guide_anchor is not None and f.guide_blocks is not None:
            cd = a_hat.dtype
            prep.guide_a = normalize_rows(f.guide_anchor.to(cd), problem.eps, True)[0]
            prep.guide_c = normalize_rows(torch.cat(f.guide_blocks).to(cd), problem.eps, True)[0]
    return prep


def _drop(problem: LSEProblem, prep: _Prepared, r0: int, r1: int, logits: Tensor, tau: Tensor) -> Tensor:
    """``[R, N]`` bool for anchor rows ``r0:r1``: structurally excluded or filtered (read before
    ``logits`` is masked in place)."""
    rows = torch.arange(r0, r1, device=problem.device)
    drop = excluded(prep.tags, rows)
    f = problem.filter
    if f is None:
        return drop
    own = own_positive_columns(problem.positives, rows, prep.c_hat.shape[0])
    if prep.guide_a is not None and prep.guide_c is not None:
        sim = prep.guide_a[r0:r1] @ prep.guide_c.T
    else:
        sim = logits * tau.to(logits.dtype)  # the model's own similarity
    return drop | filtered(sim, f.threshold[r0:r1], own)


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
    (``[B]``, ``dLoss/dlse``, or ``dLoss/dvalue`` for the sigmoid) and ``d_pos`` (``[B, P]``,
    folded when ``problem.positives`` is set; LSE only); gradient in forward with ``head``."""
    prep = _prepare(problem)
    B, N = prep.a_hat.shape[0], prep.c_hat.shape[0]
    cd = prep.a_hat.dtype
    inv_tau = tau.to(cd).reciprocal()
    want_grad = row_grad is not None or head is not None
    sigmoid = problem.sigmoid is not None

    lse = new_output(B, dtype=cd, device=problem.device)  # the row value: LSE, or the sigmoid's sum
    mean_logit = new_output((2, B) if sigmoid else B, dtype=cd, device=problem.device)
    if want_grad:
        d_a_hat = new_output(prep.a_hat.shape, dtype=cd, device=problem.device)
        d_c_hat = torch.zeros_like(prep.c_hat)
        g_dot_ml = torch.zeros((), dtype=cd, device=problem.device)
    if head is not None and not sigmoid:
        assert head.pos_logits is not None  # the torch backend does not form them (forms_own_logits)
        loss_rows = new_output(B, dtype=cd, device=problem.device)
        head_d_pos = new_output(head.pos_logits.shape, dtype=cd, device=problem.device)

    step = max(1, min(B, tile_elements() // max(N, 1)))  # anchor rows per block
    for r0 in range(0, B, step):
        r1 = min(B, r0 + step)
        a_blk = prep.a_hat[r0:r1] * inv_tau  # 1/tau on the [R, d] side, not on [R, N]
        logits = a_blk @ prep.c_hat.T  # [R, N]
        if prep.poison_a is not None and prep.poison_c is not None:
            logits += prep.poison_a[r0:r1, None] + prep.poison_c[None, :]
        drop = _drop(problem, prep, r0, r1, logits, tau)
        if sigmoid:
            rows = torch.arange(r0, r1, device=problem.device)
            probs, blk_value, blk_stats = _torch_prefix.sigmoid_block(problem, logits, drop, rows)
            lse[r0:r1] = blk_value
            mean_logit[:, r0:r1] = blk_stats
            if not want_grad:
                continue
            weights = head.weights if head is not None else row_grad
            assert weights is not None  # want_grad: one of the two
            g = weights[r0:r1].to(cd)
            g_dot_ml += torch.dot(g, blk_stats[0])
            torch.mm(probs, prep.c_hat, out=d_a_hat[r0:r1]).mul_((g * inv_tau)[:, None])
            d_c_hat.addmm_(probs.mul_(g[:, None]).T, a_blk)
            continue
        # with a gradient to form, mean_logit comes from a GEMM we do anyway (below), so the
        # raw logits are not needed again and the mask goes in place
        masked = logits.masked_fill_(drop, float("-inf")) if want_grad else logits.masked_fill(drop, float("-inf"))
        # log-sum-exp by hand so exp runs once: its result becomes the softmax in place
        row_max = _torch_prefix.finite_max(masked, 1)  # 0 for an empty row (and for N = 0)
        probs = masked.sub_(row_max[:, None]).exp_()
        total = probs.sum(dim=1)
        blk_lse = total.log().add_(row_max)  # -inf for an empty row
        lse[r0:r1] = blk_lse
        # an empty row gets all-zero softmax weights instead of NaN
        probs.mul_(_torch_prefix.softmax_scale(total)[:, None])
        if not want_grad:
            kept = logits.masked_fill(drop, 0.0)  # a dropped logit may be a NaN (filter)
            mean_logit[r0:r1] = torch.bmm(probs.unsqueeze(1), kept.unsqueeze(2)).view(-1)
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
    fold = None if sigmoid else head_d_pos if head is not None else d_pos
    if want_grad and fold is not None and problem.positives is not None:
        _fold_positives(prep, problem, fold, inv_tau, d_a_hat, d_c_hat)
    if want_grad:
        out.d_anchor = normalize_backward(prep.a_hat, prep.a_norm, d_a_hat, problem.eps)
        d_c = normalize_backward(prep.c_hat, prep.c_norm, d_c_hat, problem.eps)
        if (keep := _keep(prep.tags)) is not None:  # padding: exactly 0, not 0 * NaN from a NaN anchor row
            d_c.masked_fill_(~keep[:, None], 0)
        n0 = problem.blocks[0].shape[0]
        out.d_blocks, out.g_dot_mean_logit = (d_c[:n0], d_c[n0:]), g_dot_ml
    if head is not None and sigmoid:
        out.loss_rows, out.d_pos = lse, lse.new_zeros((B, 0))
    elif head is not None:
        out.loss_rows, out.d_pos = loss_rows, head_d_pos
    return out


def _shifted_exp(masked: Tensor, lse: Tensor, dim: int) -> Tensor:
    """``exp(masked - lse)`` along ``dim`` (rows: 1, columns: 0); 0 for an empty line (lse -inf)."""
    shift = _torch_prefix.softmax_shift(lse).unsqueeze(dim)
    return torch.exp(masked - shift)


def _columns_sweep(
    problem: LSEProblem, tau: Tensor, lse_in: Tensor | None = None, g: Tensor | None = None, d_pos: Tensor | None = None
) -> FusedResult:
    """Column statistics (``problem.columns``): forward ``(lse, mean_logit)`` ``[B + N]``, the
    columns' merged over the row blocks like split partials (one running max and sums per
    column); with ``lse_in`` and ``g`` ``[B + N]`` the recompute backward, weights
    ``g_i p_row_ic + g_(B + c) p_col_ic`` (and the folded ``d_pos``)."""
    prep = _prepare(problem)
    B, N = prep.a_hat.shape[0], prep.c_hat.shape[0]
    cd, dev = prep.a_hat.dtype, problem.device
    inv_tau = tau.to(cd).reciprocal()
    out = FusedResult(new_output(B + N, dtype=cd, device=dev), new_output(B + N, dtype=cd, device=dev))
    col_max = torch.full((N,), float("-inf"), dtype=cd, device=dev)
    col_sum, col_suml = torch.zeros(N, dtype=cd, device=dev), torch.zeros(N, dtype=cd, device=dev)
    if g is not None:
        assert lse_in is not None
        lse_r, lse_c = lse_in[:B].to(cd), lse_in[B:].to(cd)
        g_r, g_c = g[:B].to(cd), g[B:].to(cd)
        d_a_hat, d_c_hat = torch.empty_like(prep.a_hat), torch.zeros_like(prep.c_hat)
    step = max(1, min(B, tile_elements() // (2 * max(N, 1))))  # two [R, N] tiles live at once
    for r0 in range(0, B, step):
        r1 = min(B, r0 + step)
        a_blk = prep.a_hat[r0:r1] * inv_tau
        logits = a_blk @ prep.c_hat.T
        masked = logits.masked_fill_(_drop(problem, prep, r0, r1, logits, tau), float("-inf"))
        if g is None:  # the rows' statistics, and the columns' partials merged into the running ones
            row_max = _torch_prefix.finite_max(masked, 1)
            e = _shifted_exp(masked, row_max, 1)
            total = e.sum(1)
            out.lse[r0:r1] = total.log() + row_max
            # -inf (dropped) reads 0; NaN stays NaN, and "== 0" (an empty line) lets it through
            kept = masked.nan_to_num(nan=float("nan"), neginf=0.0)
            out.mean_logit[r0:r1] = torch.where(total == 0, 0.0, torch.linalg.vecdot(e, kept) / total)
            new_max = torch.maximum(col_max, masked.amax(0))
            shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            rescale = torch.exp(col_max - shift)  # 0 while a column has seen no row
            e = torch.exp(masked - shift[None, :])
            col_sum.mul_(rescale).add_(e.sum(0))
            col_suml.mul_(rescale).add_((e * kept).sum(0))
            col_max = new_max
            continue
        x = _shifted_exp(masked, lse_r[r0:r1], 1).mul_(g_r[r0:r1, None])
        x.add_(_shifted_exp(masked, lse_c, 0).mul_(g_c[None, :]))
        torch.mm(x, prep.c_hat, out=d_a_hat[r0:r1]).mul_(inv_tau)
        d_c_hat.addmm_(x.T, a_blk)
    if g is None:
        shift = torch.where(torch.isfinite(col_max), col_max, torch.zeros_like(col_max))
        empty = col_sum == 0  # a held column sums at least exp(0) = 1; NaN is not empty
        out.lse[B:] = torch.where(empty, float("-inf"), col_sum.log() + shift)
        out.mean_logit[B:] = torch.where(empty, 0.0, col_suml / torch.where(empty, 1.0, col_sum))
        return out
    if d_pos is not None and problem.positives is not None:
        _fold_positives(prep, problem, d_pos, inv_tau, d_a_hat, d_c_hat)
    out.d_anchor = normalize_backward(prep.a_hat, prep.a_norm, d_a_hat, problem.eps)
    d_c = normalize_backward(prep.c_hat, prep.c_norm, d_c_hat, problem.eps)
    if (keep := _keep(prep.tags)) is not None:
        d_c.masked_fill_(~keep[:, None], 0)
    n0 = problem.blocks[0].shape[0]
    out.d_blocks = (d_c[:n0], d_c[n0:])
    return out


class TorchLSE(Backend):
    """The ``"torch"`` backend of the masked-LSE primitive."""

    name = "torch"
    takes_filter = True
    takes_sigmoid = True
    takes_columns = True  # without Matryoshka dims (extension_reasons)

    def forward(self, problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor]:
        if problem.dims is not None:
            return _torch_prefix.forward(problem, tau)
        out = _columns_sweep(problem, tau) if problem.columns else _sweep(problem, tau)
        return out.lse, out.mean_logit

    def backward(self, problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None = None):
        if problem.dims is not None:
            return _torch_prefix.backward(problem, tau, lse, g, d_pos)
        if problem.columns:
            out = _columns_sweep(problem, tau, lse, g, d_pos)
        else:
            out = _sweep(problem, tau, row_grad=g, d_pos=d_pos)
        return out.d_anchor, out.d_blocks

    def fused(self, problem: LSEProblem, tau: Tensor, head: HeadInputs) -> FusedResult:
        return _sweep(problem, tau, head=head)


BACKEND = TorchLSE()
