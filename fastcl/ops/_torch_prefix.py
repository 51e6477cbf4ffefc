"""The ``"torch"`` backend's Matryoshka path (``LSEProblem.dims``): K prefixes in one pass over d.

Sorted prefix lengths ``m_1 < ... < m_K`` cut ``[0, m_K)`` into slices ``[m_(j-1), m_j)``.
Rows are scaled once, ``u = x / s`` with ``s`` the row's largest ``|x|`` over ``[0, m_K)``
(no overflow, as ``normalize.row_norms``), so per tile of anchor rows

    acc_j = acc_(j-1) + u_a[:, slice_j] @ u_c[:, slice_j].T       (prefix j's raw dots)
    logits_j = acc_j * alpha_j[:, None] * beta_j[None, :]           alpha = s_a / (tau * |a|_j)

with per-prefix row norms (``[K, B]``, ``[K, N]``, clamped at eps as in the plain path).
Backward, with ``P_j = dLoss/dlogits_j`` (softmax weights times ``g``, plus the folded own
positives): slice ``j`` gets ``W_j = sum_{i >= j} P_i * alpha_i * beta_i`` (a suffix sum
of K tiles), ``dU_a[:, slice_j] += W_j @ u_c[:, slice_j]`` and ``dU_c += W_j.T @ u_a``: the
GEMM work of one full-d loss. The norms' (radial) part is ``-x_hat_j <x_hat_j, d x_hat_j>
/ |x|_j`` whose scalar is ``sum_c P_j * logits_j`` (a row sum for anchors, a column sum
accumulated over tiles for candidates), applied per slice the same way. Tiles only: K + 4
``[R, N]`` tiles with ``R`` chosen so that they fit the plain path's tile budget (memory
does not grow with K).

Non-finite rows: a NaN/Inf at coordinate ``c`` of a read row makes that row's factor NaN in
exactly the prefixes longer than ``c`` (as the plain problem on each prefix); the shorter
prefixes' raw dots are prefix sums that never read it, and the scale ``s`` is taken over the
finite entries. Values beyond ``m_K`` are never read. With a filter the products read the
non-finite entries as zeros too (``contract.Filter``: the NaN reaches the logits through the
factor only, so a dropped logit carries none into the gradients).

The sigmoid reduction (``problem.sigmoid``) and the filter (``problem.filter``) act on each
prefix's logits tile exactly as on the plain path's: ``P_j`` is then ``g * sigma_j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .contract import (
    TAG_PADDING,
    LSEProblem,
    compute_dtype,
    excluded,
    filtered,
    new_output,
    own_positive_columns,
    prefix_order,
)
from .normalize import normalize_rows


def finite_max(x: Tensor, dim: int) -> Tensor:
    """The shift of a masked log-sum-exp along ``dim``: ``x.amax(dim)`` where finite, else 0 (an
    empty line: all ``-inf``, or no entry at all, N = 0 candidates, where ``amax`` refuses)."""
    if x.shape[dim] == 0:
        return x.new_zeros(x.shape[:dim] + x.shape[dim + 1 :])
    m = x.amax(dim=dim)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def softmax_scale(total: Tensor) -> Tensor:
    """``1 / total`` for a row's shifted exp sum; 0 for an empty row (no weights, not NaN), NaN
    for a non-finite sum (a NaN or +inf logit: see :func:`softmax_shift`)."""
    return torch.where(total == 0, 0.0, torch.where(torch.isfinite(total), total.reciprocal(), float("nan")))


def softmax_shift(lse: Tensor) -> Tensor:
    """The shift of a backward's ``exp(logit - lse)``: 0 for an empty line (``lse = -inf``, every
    weight masked to 0), NaN for a NaN or ``+inf`` lse. A NaN lse is a row that saw a NaN
    candidate: replaced by 0, its finite logits would give ``exp(logit)``, finite weights that
    are wrong; NaN keeps the row's gradient NaN, as autograd's softmax does."""
    return torch.where(lse == float("-inf"), 0.0, torch.where(lse == float("inf"), float("nan"), lse))


@dataclass
class _Scaled:
    u: Tensor  # [rows, m_K] compute dtype: x / s
    scale: Tensor  # [rows] s (1 for a zero row or dot similarity)
    coef: Tensor  # [K, rows] s / max(|x|_k, eps) in sorted prefix order (1 for dot)
    unclamped: Tensor | None  # [K, rows] |x|_k > eps (None for dot)


def _scaled(
    x: Tensor, keep: Tensor | None, bounds: list[int], cosine: bool, eps: float, clean: bool = False
) -> _Scaled:
    """``clean``: non-finite entries are read as zeros (the NaN stays in ``coef``)."""
    cd = compute_dtype(x.dtype)
    x = x[:, : bounds[-1]]
    if keep is not None:  # padding is read as zeros, whatever it holds
        x = torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    ones = torch.ones(x.shape[0], dtype=cd, device=x.device)
    finite = torch.isfinite(x)
    if clean:
        x = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    first_bad = torch.where(finite.all(-1), x.shape[1], (~finite).to(torch.int8).argmax(-1))
    bounds_t = torch.tensor(bounds, device=x.device)[:, None]
    poison = torch.where(first_bad[None, :] < bounds_t, torch.nan, 0.0).to(cd)  # [K, rows]
    if not cosine:
        return _Scaled(x.to(cd), ones, ones + poison, None)
    s = torch.where(finite, x.abs(), torch.zeros((), dtype=x.dtype, device=x.device)).amax(dim=-1).to(cd)
    s = torch.where(s > 0, s, ones)  # a zero (or all non-finite) row keeps s = 1
    u = x.to(cd) / s.unsqueeze(-1)
    norms = torch.stack([torch.linalg.vector_norm(u[:, :m], dim=-1) for m in bounds]) * s
    return _Scaled(u, s, s / norms.clamp_min(eps) + poison, norms > eps)


def _prepare(problem: LSEProblem, bounds: list[int]) -> tuple[_Scaled, _Scaled, Tensor]:
    tags = torch.cat(problem.tags)
    c = torch.cat(problem.blocks) if problem.blocks[1].shape[0] else problem.blocks[0]
    clean = problem.filter is not None
    a = _scaled(problem.anchor, None, bounds, problem.cosine, problem.eps, clean)
    return a, _scaled(c, tags != TAG_PADDING, bounds, problem.cosine, problem.eps, clean), tags


class _Filter:
    """The filter's decisions on a block of rows: the guide's tile once (shared by the
    prefixes), or the prefix's own similarity against its threshold row."""

    def __init__(self, problem: LSEProblem, order: list[int], r0: int, r1: int):
        self.f, self.order, self.r0, self.r1 = problem.filter, order, r0, r1
        self.own: Tensor | None = None
        self.guide: Tensor | None = None
        f = self.f
        if f is None:
            return
        rows = torch.arange(r0, r1, device=problem.device)
        N = sum(b.shape[0] for b in problem.blocks)
        self.own = own_positive_columns(problem.positives, rows, N)
        if f.guide_anchor is not None and f.guide_blocks is not None:
            cd = compute_dtype(problem.dtype)
            ga = normalize_rows(f.guide_anchor[r0:r1].to(cd), problem.eps, True)[0]
            gc = normalize_rows(torch.cat(f.guide_blocks).to(cd), problem.eps, True)[0]
            self.guide = ga @ gc.T

    def drop(self, base: Tensor, j: int, logits: Tensor, tau: Tensor) -> Tensor:
        """``base`` (the structural mask) with prefix ``j``'s (sorted position) filter added."""
        f = self.f
        if f is None:
            return base
        assert self.own is not None
        thr = f.threshold if f.threshold.dim() == 1 else f.threshold[self.order[j]]
        sim = self.guide if self.guide is not None else logits * tau.to(logits.dtype)
        return base | filtered(sim, thr[self.r0 : self.r1], self.own)


def sigmoid_block(problem: LSEProblem, logits: Tensor, drop: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(sigma [R, N], value [R], stats [2, R])`` of the sigmoid reduction on a block's logits
    (``sigma``, zero where dropped, is the block's ``dvalue/dlogits``); plain and prefix paths.
    Three ``[R, N]`` temporaries: the own positives' entries (``z = +1``) are flipped by index."""
    assert problem.sigmoid is not None
    u = logits + problem.sigmoid.bias.to(logits.dtype)  # u = -z (l + b): z = -1 but at the own positives
    pos = problem.positives
    if pos is not None:
        cols = pos.offset + rows[:, None] * pos.count + torch.arange(pos.count, device=rows.device)
        at = (torch.arange(rows.shape[0], device=rows.device)[:, None], cols)
        u[at] = -u[at]
    sigma = torch.sigmoid(u)  # -z sigmoid(u): the sign flips back at the own positives below
    if pos is not None:
        sigma[at] = -sigma[at]
    terms = F.logsigmoid(u.neg_()).neg_()  # softplus(u) = -log sigmoid(-u), exact for every u
    terms.masked_fill_(drop, 0.0)
    sigma.masked_fill_(drop, 0.0)
    kept = logits if problem.filter is None else logits.masked_fill(drop, 0.0)  # a dropped logit may be NaN
    stats = torch.stack([torch.linalg.vecdot(sigma, kept), sigma.sum(1)])
    return sigma, terms.sum(1), stats


def _rows_per_tile(problem: LSEProblem, tiles: int) -> int:
    from ._torch_impl import tile_elements  # one budget for both paths

    N, B = max(sum(b.shape[0] for b in problem.blocks), 1), problem.num_anchors
    return max(1, min(B, (3 * tile_elements()) // (tiles * N)))


def _prefix_tiles(a: _Scaled, c: _Scaled, bounds: list[int], r0: int, r1: int, inv_tau: Tensor):
    """Yield ``(j, logits_j [R, N])`` for the sorted prefixes, one slice GEMM each."""
    acc, lo = None, 0
    for j, hi in enumerate(bounds):
        a_j, c_j = a.u[r0:r1, lo:hi], c.u[:, lo:hi].T
        acc = a_j @ c_j if acc is None else acc.addmm_(a_j, c_j)  # prefix sums, in place
        alpha = a.coef[j, r0:r1] * inv_tau
        yield j, acc * alpha[:, None] * c.coef[j][None, :]
        lo = hi


def _softmax(logits: Tensor, drop: Tensor, lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(lse [R], p [R, N])`` of the masked row; an empty row has lse -inf and p = 0."""
    masked = logits.masked_fill(drop, float("-inf"))
    if lse is None:
        row_max = finite_max(masked, 1)
        p = masked.sub_(row_max[:, None]).exp_()
        total = p.sum(dim=1)
        p.mul_(softmax_scale(total)[:, None])
        return total.log().add_(row_max), p
    return lse, masked.sub_(softmax_shift(lse)[:, None]).exp_()


def _order(problem: LSEProblem) -> tuple[list[int], list[int]]:
    """Sorted distinct bounds and, per sorted position, the caller's prefix index."""
    order, _ = prefix_order(problem.prefixes)
    return [problem.prefixes[k] for k in order], order


def forward(problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor]:
    """``(lse [K, B], mean_logit [K, B])`` in the caller's dims order; with the sigmoid
    reduction ``(value [K, B], stats [2, K, B])``."""
    bounds, order = _order(problem)
    a, c, tags = _prepare(problem, bounds)
    K, B = len(bounds), problem.num_anchors
    inv_tau = tau.to(a.u.dtype).reciprocal()
    sigmoid = problem.sigmoid is not None
    lse = new_output((K, B), dtype=a.u.dtype, device=problem.device)
    mean = new_output((2, K, B) if sigmoid else (K, B), dtype=a.u.dtype, device=problem.device)
    # live tiles: acc, logits, softmax, mask (and the guide's)
    step = _rows_per_tile(problem, 5 if problem.filter is not None else 4)
    for r0 in range(0, B, step):
        r1 = min(B, r0 + step)
        rows = torch.arange(r0, r1, device=problem.device)
        base, filt = excluded(tags, rows), _Filter(problem, order, r0, r1)
        for j, logits in _prefix_tiles(a, c, bounds, r0, r1, inv_tau):
            drop = filt.drop(base, j, logits, tau)
            if sigmoid:
                _, lse[order[j], r0:r1], mean[:, order[j], r0:r1] = sigmoid_block(problem, logits, drop, rows)
                continue
            blk_lse, p = _softmax(logits, drop)
            lse[order[j], r0:r1] = blk_lse
            kept = logits.masked_fill(drop, 0.0)  # a dropped logit may be a NaN (filter)
            mean[order[j], r0:r1] = torch.bmm(p.unsqueeze(1), kept.unsqueeze(2)).view(-1)
    return lse, mean


def _radial(x: _Scaled, stat: Tensor) -> Tensor:
    """``[K, rows]`` factor of ``u`` in the norms' gradient: ``stat * coef^2 / s`` where unclamped."""
    assert x.unclamped is not None  # cosine similarity only: dot products have no norms
    return stat * x.coef.square() * x.unclamped.to(stat.dtype) / x.scale


def _to_raw(x: _Scaled, d_u: Tensor, radial: Tensor | None, bounds: list[int], d: int) -> Tensor:
    """Gradient w.r.t. the raw rows from the slice-combined ``d_u``, zero beyond ``m_K``."""
    out = d_u / x.scale.unsqueeze(-1)
    if radial is not None:
        suffix = radial.flip(0).cumsum(0).flip(0)  # slice j: sum over prefixes i >= j
        lo = 0
        for j, hi in enumerate(bounds):
            out[:, lo:hi].addcmul_(x.u[:, lo:hi], suffix[j].unsqueeze(-1), value=-1)
            lo = hi
    return torch.nn.functional.pad(out, (0, d - bounds[-1]))


def backward(problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None = None):
    """Summed, zero-padded gradients from ``g``/``lse`` ``[K, B]`` and ``d_pos`` ``[K, B, P]``."""
    bounds, order = _order(problem)
    a, c, tags = _prepare(problem, bounds)
    K, B, N = len(bounds), problem.num_anchors, c.u.shape[0]
    cd, dev = a.u.dtype, problem.device
    inv_tau = tau.to(cd).reciprocal()
    lse, g = lse.to(cd)[order], g.to(cd)[order]
    pos = problem.positives if d_pos is not None and problem.sigmoid is None else None
    if d_pos is not None:
        d_pos = d_pos.to(cd)[order]
    d_ua, d_uc = torch.zeros_like(a.u), torch.zeros_like(c.u)
    rad_a = torch.zeros(K, B, dtype=cd, device=dev)
    rad_c = torch.zeros(K, N, dtype=cd, device=dev)
    step = _rows_per_tile(problem, K + 5)  # live: K weight tiles, acc, logits, softmax, mask, guide
    w_all = torch.empty((K, step, N), dtype=cd, device=dev)
    for r0 in range(0, B, step):
        r1 = min(B, r0 + step)
        rows = torch.arange(r0, r1, device=dev)
        base, filt = excluded(tags, rows), _Filter(problem, order, r0, r1)
        w = w_all[:, : r1 - r0]
        for j, logits in _prefix_tiles(a, c, bounds, r0, r1, inv_tau):
            drop = filt.drop(base, j, logits, tau)
            if problem.sigmoid is not None:
                p = sigmoid_block(problem, logits, drop, rows)[0]
            else:
                _, p = _softmax(logits, drop, lse[j, r0:r1])
            p.mul_(g[j, r0:r1, None])  # dLoss/dlogits_j
            if problem.filter is not None:  # a dropped logit may be a NaN: p is 0 there
                logits = logits.masked_fill(drop, 0.0)
            if pos is not None and d_pos is not None:  # own positive k of anchor i: column offset + i * count + k
                cols = pos.offset + rows[:, None] * pos.count + torch.arange(pos.count, device=dev)
                p.scatter_add_(1, cols, d_pos[j, r0:r1])
            if problem.cosine:  # <x_hat, d x_hat> per anchor and per candidate (w[j] as scratch)
                pl = torch.mul(p, logits, out=w[j])
                rad_a[j, r0:r1] = pl.sum(1)
                rad_c[j] += pl.sum(0)
            torch.mul(p, (a.coef[j, r0:r1] * inv_tau)[:, None], out=w[j]).mul_(c.coef[j][None, :])
        for j in reversed(range(K - 1)):  # suffix sums: slice j takes every prefix i >= j
            w[j] += w[j + 1]
        lo = 0
        for j, hi in enumerate(bounds):
            d_ua[r0:r1, lo:hi].addmm_(w[j], c.u[:, lo:hi])
            d_uc[:, lo:hi].addmm_(w[j].T, a.u[r0:r1, lo:hi])
            lo = hi
    ra = _radial(a, rad_a) if problem.cosine else None
    rc = _radial(c, rad_c) if problem.cosine else None
    d_a = _to_raw(a, d_ua, ra, bounds, problem.dim)
    d_c = _to_raw(c, d_uc, rc, bounds, problem.dim)
    d_c.masked_fill_((tags == TAG_PADDING)[:, None], 0)  # exactly 0, not 0 * NaN from a NaN anchor row
    n0 = problem.blocks[0].shape[0]
    return d_a, (d_c[:n0], d_c[n0:])
