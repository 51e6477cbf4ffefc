"""Matryoshka (prefix-dims) problems and an independent float64 oracle for any backend.

Prefix ``k`` of a problem with ``dims`` is the plain primitive on the first ``dims[k]``
coordinates (``LSEProblem.prefix``). The oracle below builds each prefix's logits
directly and differentiates ``sum_k g_k . lse_k + d_pos_k . own_logits_k`` with autograd,
sharing nothing with the backends but the tag rule (``contract.excluded``).

The checks bound each quantity by the round-off of its sums (``fastcl.testing.roundoff``):
16-bit problems run in float32 on the rounded values the oracle reads, so their sums are
float32's; see :func:`roundoff_terms`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, OwnPositives, excluded
from fastcl.ops.head import HeadInputs, head_rows
from fastcl.testing import assert_roundoff


def prefix_problem(
    B: int,
    N0: int,
    N1: int,
    d: int,
    dims: tuple[int, ...],
    *,
    dtype=torch.float64,
    device="cpu",
    cosine: bool = True,
    own: int = 0,
    generator: torch.Generator | None = None,
) -> LSEProblem:
    """Random problem: block-0 tags mix padding, self-exclusion and ``TAG_ALL``; block 1 has
    padded rows; ``own > 0`` lays out ``own`` positives per anchor at the start of block 0."""
    kw = dict(dtype=dtype, device=device)
    r = lambda *s: torch.randn(*s, generator=generator).to(**kw)  # noqa: E731
    a, b0, b1 = r(B, d), r(N0 + B * own, d), r(N1, d)
    t0 = torch.randint(-2, B, (N0 + B * own,), generator=generator).to(torch.int32)
    t0[: B * own] = TAG_ALL
    t1 = torch.where(torch.rand(N1, generator=generator) < 0.3, TAG_PADDING, TAG_ALL).to(torch.int32)
    positives = OwnPositives(0, own) if own else None
    return LSEProblem(a, (b0, b1), (t0.to(device), t1.to(device)), cosine, positives=positives, dims=dims)


def _unit(x: Tensor, cosine: bool, eps: float) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps) if cosine else x


def oracle(problem: LSEProblem, tau: float, g: Tensor, d_pos: Tensor | None = None):
    """``(lse [K,B], mean_logit [K,B], d_anchor [B,d], (d_b0, d_b1))`` in float64."""
    tags = torch.cat(problem.tags).cpu()
    a = problem.anchor.detach().cpu().double().requires_grad_()
    blocks = [b.detach().cpu().double().requires_grad_() for b in problem.blocks]
    c = torch.where((tags != TAG_PADDING)[:, None], torch.cat(blocks), 0.0)
    B = a.shape[0]
    keep = ~excluded(tags, torch.arange(B))
    nonempty = keep.any(1)
    lses, means, objective = [], [], 0.0
    for k, m in enumerate(problem.prefixes):
        logits = _unit(a[:, :m], problem.cosine, problem.eps) @ _unit(c[:, :m], problem.cosine, problem.eps).T / tau
        filled = torch.where(keep, logits, -torch.inf)
        filled = torch.where(nonempty[:, None], filled, 0.0)
        lse = torch.where(nonempty, torch.logsumexp(filled, 1), -torch.inf)
        p = torch.where(keep, torch.softmax(filled, 1), 0.0)
        lses.append(lse.detach())
        means.append((p * torch.where(keep, logits, 0.0)).sum(1).detach())
        objective = objective + (g[k].cpu().double() * torch.where(nonempty, lse, 0.0)).sum()
        if d_pos is not None and problem.positives is not None:
            P = problem.positives.count
            cols = problem.positives.offset + torch.arange(B)[:, None] * P + torch.arange(P)
            objective = objective + (d_pos[k].cpu().double() * logits.gather(1, cols)).sum()
    d_a, d_b0, d_b1 = torch.autograd.grad(objective, [a, *blocks], allow_unused=True)
    d_b0 = torch.zeros_like(blocks[0]) if d_b0 is None else d_b0
    d_b1 = torch.zeros_like(blocks[1]) if d_b1 is None else d_b1
    return torch.stack(lses), torch.stack(means), d_a, (d_b0, d_b1)


def roundoff_terms(problem: LSEProblem, tau: float) -> tuple[torch.dtype, int, float]:
    """``(dtype, terms, logit_scale)`` of a problem's round-off: the dtype its sums run in
    (float32 for 16-bit inputs), the length of the chain of sums behind one gradient element
    (a logit's ``d`` coordinates, a row's candidates, a candidate's anchors) and the size of
    the logits (``1/tau`` for cosine, ``max|a| max|c| / tau`` for dot products). A logit's
    absolute error ``eps * logit_scale`` is an absolute error of ``lse`` and the mean logit and
    a relative error of the softmax weights, hence of every gradient."""
    dtype = torch.float64 if problem.dtype == torch.float64 else torch.float32
    B, d = problem.anchor.shape
    terms = d + sum(b.shape[0] for b in problem.blocks) + B
    if problem.cosine:
        return dtype, terms, 1.0 / tau

    def largest_norm(x: Tensor) -> float:  # of the finite rows (a NaN row's logits are NaN anyway)
        norms = x.detach().double().norm(dim=-1)
        norms = norms[torch.isfinite(norms)]
        return norms.max().item() if norms.numel() else 0.0

    return dtype, terms, largest_norm(problem.anchor) * max(map(largest_norm, problem.blocks)) / tau


def _largest(x: Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def gradient_term(problem: LSEProblem, tau: float) -> float:
    """Size of one term of a gradient per unit of upstream gradient: a candidate (or anchor)
    over ``tau``, through the normalisation (``1 / (tau |row|)``) for cosine."""
    rows = torch.cat([problem.anchor.detach().double(), *(b.detach().double() for b in problem.blocks)])
    norms = rows.norm(dim=-1)
    norms = norms[torch.isfinite(norms)]
    if not norms.numel():
        return 0.0
    if problem.cosine:
        return 1.0 / (tau * norms.min().clamp_min(problem.eps).item())
    return norms.max().item() / tau


def check_roundoff(
    name: str, got: Tensor, want: Tensor, problem: LSEProblem, tau: float, *, logits: bool, upstream: float = 0.0
) -> None:
    """``logits``: ``want`` is logit-sized (absolute error ``eps * logit_scale``); otherwise
    it is weighted by softmax weights (relative error ``eps * logit_scale``) and its terms
    are ``upstream * gradient_term`` each (``upstream``: the largest upstream gradient), which
    counts when they cancel (a lone candidate, a candidate equal to the anchor)."""
    dtype, terms, scale = roundoff_terms(problem, tau)
    want = want.detach().cpu().double()
    finite = want[torch.isfinite(want)]
    size = finite.abs().max().item() if finite.numel() else 0.0
    if not logits:
        size = max(size, upstream * gradient_term(problem, tau))
    if got.dtype.is_floating_point and got.dtype.itemsize < 4:  # stored rounded: that dominates
        assert_roundoff(got.cpu().double(), want, got.dtype, magnitude=size, msg=name)
        return
    magnitude = scale if logits else size * scale
    assert_roundoff(got.cpu().double(), want, dtype, terms=terms, magnitude=magnitude, msg=name)


def check_backend(impl, problem: LSEProblem, tau: float, *, seed: int = 0) -> None:
    """``impl``'s Matryoshka forward and backward against :func:`oracle` (empty rows: ``-inf``),
    within the round-off of :func:`roundoff_terms`."""
    gen = torch.Generator().manual_seed(seed)
    K, B = problem.num_prefixes, problem.num_anchors
    g = torch.rand(K, B, generator=gen, dtype=torch.float64)
    P = problem.positives.count if problem.positives is not None else 0
    d_pos = -torch.rand(K, B, P, generator=gen, dtype=torch.float64) if P else None
    want_lse, want_mean, want_da, want_db = oracle(problem, tau, g, d_pos)
    t = torch.tensor(tau, dtype=torch.float64, device=problem.device)
    lse, mean = impl.forward(problem, t)
    assert lse.shape == (K, B) and mean.shape == (K, B)
    check_roundoff("lse", lse, want_lse, problem, tau, logits=True)
    check_roundoff("mean_logit", mean, want_mean, problem, tau, logits=True)
    cd = lse.dtype
    dev = problem.device
    d_a, d_b = impl.backward(problem, t, lse, g.to(cd).to(dev), None if d_pos is None else d_pos.to(cd).to(dev))
    up = _largest(g) + (_largest(d_pos.abs().sum(-1)) if d_pos is not None else 0.0)
    check_roundoff("d_anchor", d_a, want_da, problem, tau, logits=False, upstream=up)
    for i, (got, want) in enumerate(zip(d_b, want_db)):
        check_roundoff(f"d_block{i}", got, want, problem, tau, logits=False, upstream=up)


def own_logits(problem: LSEProblem, tau: float, pos_mask: Tensor | None) -> Tensor:
    """``[K, B, P]`` float64 logits of the own positives (``problem.positives``) per prefix,
    a masked one reading 0 (the contract)."""
    B, P = problem.num_anchors, problem.positives.count
    a = problem.anchor.detach().cpu().double()
    own = problem.blocks[0].detach().cpu().double()[problem.positives.rows(0, B)].view(B, P, -1)
    out = []
    for m in problem.prefixes:
        u, v = _unit(a[:, :m], problem.cosine, problem.eps), _unit(own[..., :m], problem.cosine, problem.eps)
        logit = (u[:, None, :] * v).sum(-1) / tau
        out.append(logit if pos_mask is None else torch.where(pos_mask, logit, 0.0))
    return torch.stack(out)


def check_fused(impl, problem: LSEProblem, tau: float, *, kind: str, seed: int = 0):
    """``impl.fused`` on a Matryoshka problem (``Backend.fused_takes_dims``) against the oracle
    and the PyTorch head (``head_rows``) per prefix: lse, mean logit, the head's rows and
    ``d_pos``, ``g . mean_logit`` and every gradient. Own positives (``problem.positives``)
    are formed by the backend; without them random shared positive logits are given. Bounds:
    :func:`roundoff_terms`; ``g . mean_logit`` sums ``K B`` logit-sized terms weighted by ``g``."""
    gen = torch.Generator().manual_seed(seed)
    K, B = problem.num_prefixes, problem.num_anchors
    P = problem.positives.count if problem.positives is not None else 3
    mask = torch.rand(B, P, generator=gen) > 0.3
    log_extra = torch.rand(B, generator=gen, dtype=torch.float64).log()
    weights = torch.rand(K, B, generator=gen, dtype=torch.float64)
    if problem.positives is not None:
        pos, given = own_logits(problem, tau, mask), None
    else:
        pos = torch.randn(K, B, P, generator=gen, dtype=torch.float64)
        given = pos
    want_lse, want_mean, _, _ = oracle(problem, tau, torch.zeros(K, B))
    rows, dlse, dpos = head_rows(
        want_lse.reshape(K * B), pos.reshape(K * B, P), mask.repeat(K, 1), kind, log_extra.repeat(K)
    )
    g, d_pos = dlse.view(K, B) * weights, dpos.view(K, B, P) * weights[..., None]
    _, _, want_da, want_db = oracle(problem, tau, g, d_pos)
    cd, dev = torch.float64 if problem.dtype == torch.float64 else torch.float32, problem.device
    head = HeadInputs(kind, None if given is None else given.to(cd).to(dev), mask.to(dev), log_extra.to(cd).to(dev),
                      weights.to(cd).to(dev))  # fmt: skip
    out = impl.fused(problem, torch.tensor(tau, dtype=cd, device=dev), head)
    checks = dict(  # name: (got, want, logit-sized)
        lse=(out.lse, want_lse, True),
        mean_logit=(out.mean_logit, want_mean, True),
        loss_rows=(out.loss_rows, rows.view(K, B), True),
        d_pos=(out.d_pos, d_pos, False),
        d_anchor=(out.d_anchor, want_da, False),
        d_block0=(out.d_blocks[0], want_db[0], False),
        d_block1=(out.d_blocks[1], want_db[1], False),
    )
    if given is None:
        checks["pos_logits"] = (out.pos_logits, pos, True)
    up = _largest(g) + _largest(d_pos.abs().sum(-1))
    for name, (got, want, logits) in checks.items():
        check_roundoff(name, got, want, problem, tau, logits=logits, upstream=up)
    dtype, terms, scale = roundoff_terms(problem, tau)
    want_gm = (g * torch.where(torch.isfinite(want_lse), want_mean, 0.0)).sum()
    assert_roundoff(
        out.g_dot_mean_logit.cpu().double(),
        want_gm,
        dtype,
        terms=terms + K * B,
        magnitude=g.abs().sum().item() * scale,
        msg="g_dot_mean_logit",
    )


def check_fused_roundoff(got, want, problem: LSEProblem, tau: float, *, upstream: float = 0.0, equal_nan=False) -> None:
    """Every output of two fused steps on one problem (two backends, GEMM paths or dtypes)
    within :func:`check_roundoff`; ``g . mean_logit`` sums B logit-sized terms more. NaN:
    at the same places when ``equal_nan``."""
    pairs = [(n, getattr(got, n), getattr(want, n), True) for n in ("lse", "mean_logit", "loss_rows")]
    pairs += [("d_pos", got.d_pos, want.d_pos, False), ("d_anchor", got.d_anchor, want.d_anchor, False)]
    pairs += [(f"d_block{i}", g, w, False) for i, (g, w) in enumerate(zip(got.d_blocks, want.d_blocks))]
    dtype, terms, scale = roundoff_terms(problem, tau)
    B = problem.anchor.shape[0]
    for name, x, y, logits in pairs + [("g_dot_mean_logit", got.g_dot_mean_logit, want.g_dot_mean_logit, None)]:
        x, y = x.double(), y.double()
        if equal_nan:
            assert torch.equal(x.isnan(), y.isnan()), f"{name}: NaN at other places"
            x, y = x.nan_to_num(), y.nan_to_num()
        if logits is None:
            assert_roundoff(x, y, dtype, terms=terms + B, magnitude=B * scale, msg=name)
        else:
            check_roundoff(name, x, y, problem, tau, logits=logits, upstream=upstream)
