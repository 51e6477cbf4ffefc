"""Matryoshka (prefix-dims) problems and an independent float64 oracle for any backend.

Prefix ``k`` of a problem with ``dims`` is the plain primitive on the first ``dims[k]``
coordinates (``LSEProblem.prefix``). The oracle below builds each prefix's logits
directly and differentiates ``sum_k g_k . lse_k + d_pos_k . own_logits_k`` with autograd,
sharing nothing with the backends but the tag rule (``contract.excluded``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, OwnPositives, excluded
from fastcl.ops.head import HeadInputs, head_rows


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


def check_backend(impl, problem: LSEProblem, tau: float, *, rtol: float, atol: float, seed: int = 0) -> None:
    """``impl``'s Matryoshka forward and backward against :func:`oracle` (empty rows: ``-inf``)."""
    gen = torch.Generator().manual_seed(seed)
    K, B = problem.num_prefixes, problem.num_anchors
    g = torch.rand(K, B, generator=gen, dtype=torch.float64)
    P = problem.positives.count if problem.positives is not None else 0
    d_pos = -torch.rand(K, B, P, generator=gen, dtype=torch.float64) if P else None
    want_lse, want_mean, want_da, want_db = oracle(problem, tau, g, d_pos)
    t = torch.tensor(tau, dtype=torch.float64, device=problem.device)
    lse, mean = impl.forward(problem, t)
    assert lse.shape == (K, B) and mean.shape == (K, B)
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=rtol, atol=atol)
    torch.testing.assert_close(mean.cpu().double(), want_mean, rtol=rtol, atol=atol)
    cd = lse.dtype
    dev = problem.device
    d_a, d_b = impl.backward(problem, t, lse, g.to(cd).to(dev), None if d_pos is None else d_pos.to(cd).to(dev))
    torch.testing.assert_close(d_a.cpu().double(), want_da, rtol=rtol, atol=atol)
    for got, want in zip(d_b, want_db):
        torch.testing.assert_close(got.cpu().double(), want, rtol=rtol, atol=atol)


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


def check_fused(impl, problem: LSEProblem, tau: float, *, kind: str, rtol: float, atol: float, seed: int = 0):
    """``impl.fused`` on a Matryoshka problem (``Backend.fused_takes_dims``) against the oracle
    and the PyTorch head (``head_rows``) per prefix: lse, mean logit, the head's rows and
    ``d_pos``, ``g . mean_logit`` and every gradient. Own positives (``problem.positives``)
    are formed by the backend; without them random shared positive logits are given."""
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
    checks = dict(
        lse=(out.lse, want_lse),
        mean_logit=(out.mean_logit, want_mean),
        loss_rows=(out.loss_rows, rows.view(K, B)),
        d_pos=(out.d_pos, d_pos),
        g_dot_mean_logit=(out.g_dot_mean_logit, (g * torch.where(torch.isfinite(want_lse), want_mean, 0.0)).sum()),
        d_anchor=(out.d_anchor, want_da),
        d_block0=(out.d_blocks[0], want_db[0]),
        d_block1=(out.d_blocks[1], want_db[1]),
    )
    if given is None:
        checks["pos_logits"] = (out.pos_logits, pos)
    for name, (got, want) in checks.items():
        torch.testing.assert_close(got.cpu().double(), want, rtol=rtol, atol=atol, msg=name)
