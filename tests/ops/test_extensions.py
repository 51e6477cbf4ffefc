"""The primitive's two extensions on every backend against an independent float64 oracle:
the sigmoid reduction (SigLIP) and the false-negative filter (GIST guide, self-margin).

The oracle below builds the logits, the structural mask, the own-positive layout and the
filter's mask explicitly in float64 and differentiates by autograd; it shares no code with
``fastcl.ops`` (docs/design.md, "Sigmoid reduction", "Filters"). Each case runs the backend's
``forward`` (value and row statistics), ``backward`` (gradients for a random upstream ``g``
and, for the LSE, a folded ``d_pos``) and, where the backend has one, its gradient-in-forward
``fused`` sweep, with outputs poisoned (an element a kernel forgets is NaN). Shapes cross the
backends' row and column tiles (the knobs are set small), and the cases hold padded slots,
rows left empty, ties at the threshold, a NaN in a dropped column and Matryoshka prefixes.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest
import torch

from fastcl.ops import dispatch
from fastcl.ops.contract import (
    TAG_ALL,
    TAG_PADDING,
    Filter,
    LSEProblem,
    OwnPositives,
    Sigmoid,
    poison_outputs,
)
from fastcl.ops.head import SIGMOID_HEAD, HeadInputs
from fastcl.testing import assert_close, loss_terms
from tests.helpers.backends import backends_under_test, device_under_test, require, small_only
from tests.helpers.roundoff import grad_term_size
from tests.helpers.seeds import case_seed

# --------------------------------------------------------------------------- the oracle


@dataclass
class Case:
    anchor: torch.Tensor  # [B, d]
    blocks: tuple[torch.Tensor, torch.Tensor]
    tags: tuple[torch.Tensor, torch.Tensor]
    tau: float
    cosine: bool
    positives: OwnPositives | None
    threshold: torch.Tensor | None = None  # [B] or [K, B]
    guide: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # anchor, block0, block1
    bias: float | None = None  # set: the sigmoid reduction
    dims: tuple[int, ...] | None = None

    def problem(self, dtype=None) -> LSEProblem:
        dev = self.anchor.device
        cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))  # noqa: E731
        cd = torch.float64 if (dtype or self.anchor.dtype) == torch.float64 else torch.float32
        f = None
        if self.threshold is not None:
            guide = self.guide
            f = Filter(
                self.threshold.to(cd),
                None if guide is None else guide[0],
                None if guide is None else (guide[1], guide[2]),
            )
        sig = None if self.bias is None else Sigmoid(torch.tensor(self.bias, dtype=cd, device=dev))
        return LSEProblem(
            cast(self.anchor),
            (cast(self.blocks[0]), cast(self.blocks[1])),
            self.tags,
            self.cosine,
            positives=self.positives,
            dims=self.dims,
            filter=f,
            sigmoid=sig,
        )


def _unit(x: torch.Tensor, cosine: bool) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-8) if cosine else x


def oracle(case: Case, prefix: int | None = None):
    """``(value [B], stats, leaves)``: float64 with autograd; ``stats`` is ``mean_logit [B]`` for the
    LSE and ``[2, B]`` for the sigmoid. ``leaves`` = (anchor, block0, block1) float64 leaves."""
    a = case.anchor.detach().double().requires_grad_()
    b0 = case.blocks[0].detach().double().requires_grad_()
    b1 = case.blocks[1].detach().double().requires_grad_()
    m = prefix or a.shape[1]
    A, C = a[:, :m], torch.cat([b0, b1])[:, :m]
    tags = torch.cat(case.tags).long().cpu()
    B, N = A.shape[0], C.shape[0]
    pad = (tags == TAG_PADDING).to(A.device)
    C = torch.where(pad[:, None], torch.zeros((), dtype=C.dtype, device=C.device), C)
    poison_a = torch.zeros(B, dtype=torch.float64, device=A.device)
    poison_c = torch.zeros(N, dtype=torch.float64, device=A.device)
    if case.threshold is not None:  # non-finite rows read as zeros, NaN added to their logits
        bad_a, bad_c = ~torch.isfinite(A).all(1), ~torch.isfinite(C).all(1)
        A = torch.where(bad_a[:, None], 0.0, A)
        C = torch.where(bad_c[:, None], 0.0, C)
        poison_a[bad_a], poison_c[bad_c] = math.nan, math.nan
    S = _unit(A, case.cosine) @ _unit(C, case.cosine).T + poison_a[:, None] + poison_c[None, :]
    L = S / case.tau
    keep = torch.ones(B, N, dtype=torch.bool)
    own = torch.zeros(B, N, dtype=torch.bool)
    for i in range(B):
        for c in range(N):
            keep[i, c] = tags[c] != TAG_PADDING and tags[c] != i
            if case.positives is not None:
                lo = case.positives.offset + i * case.positives.count
                own[i, c] = lo <= c < lo + case.positives.count
    keep, own = keep.to(A.device), own.to(A.device)
    if case.threshold is not None:
        thr = case.threshold.double()
        if thr.dim() == 2:
            thr = thr[list(case.dims).index(m)]
        if case.guide is not None:
            ga, g0, g1 = (t.detach().double() for t in case.guide)
            sim = _unit(ga, True) @ _unit(torch.cat([g0, g1]), True).T
        else:
            sim = S.detach()
        keep = keep & ~((sim > thr[:, None]) & ~own)
    if case.bias is not None:
        # masked before the elementwise functions: a dropped NaN gets an exactly zero gradient
        # (masking after them gives 0 * NaN under autograd)
        kept = torch.where(keep, L, 0.0)
        z = torch.where(own, 1.0, -1.0).double()
        u = -z * (kept + case.bias)
        terms = torch.where(keep, torch.logaddexp(u, torch.zeros_like(u)), 0.0)
        sigma = torch.where(keep, -z * torch.sigmoid(u), 0.0)
        stats = torch.stack([(sigma * kept).sum(1), sigma.sum(1)]).detach()
        return terms.sum(1), stats, (a, b0, b1), L, own
    masked = torch.where(keep, L, -math.inf)
    empty = ~keep.any(1)
    lse = torch.logsumexp(torch.where(empty[:, None], 0.0, masked), 1)
    lse = torch.where(empty, -math.inf, lse)
    p = torch.where(keep, torch.exp(masked - torch.where(empty, 0.0, lse.detach())[:, None]), 0.0)
    mean_logit = (p * torch.where(keep, L, 0.0)).sum(1).detach()
    return lse, mean_logit, (a, b0, b1), L, own


def oracle_grads(case: Case, g: torch.Tensor, d_pos: torch.Tensor | None, prefix: int | None = None):
    """Gradients of ``sum_i g_i value_i (+ sum d_pos * own-positive logits)`` w.r.t. the raw inputs."""
    value, _, leaves, L, own = oracle(case, prefix)
    rows = g != 0  # an empty row (-inf) gets g = 0 from the caller, and 0 * -inf is no gradient
    total = (g.double()[rows] * value[rows.to(value.device)]).sum()
    if d_pos is not None and case.positives is not None and case.bias is None:
        B, P = d_pos.shape
        cols = case.positives.offset + torch.arange(B)[:, None] * P + torch.arange(P)
        total = total + (d_pos.double() * L[torch.arange(B)[:, None], cols.to(L.device)]).sum()
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, leaves)]


# --------------------------------------------------------------------------- cases


def _tags(n: int, B: int, g: torch.Generator, dev, *, owners: bool) -> torch.Tensor:
    r = torch.rand(n, generator=g)
    t = torch.full((n,), TAG_ALL, dtype=torch.int32)
    t[r < 0.15] = TAG_PADDING
    if owners:
        own = (r >= 0.15) & (r < 0.3)
        t[own] = torch.randint(0, B, (int(own.sum()),), generator=g, dtype=torch.int32)
    return t.to(dev)


def make_case(
    B, N0, N1, d, *, seed, reduce="lse", filt=None, cosine=True, positives=True, dims=None, gdim=5, dev=None
) -> Case:
    """Random inputs; ``filt`` None, "guide" or "self"; ``positives``: one or two own positives per
    anchor at the start of block 0 (``N0 >= 2 B``)."""
    dev = dev or device_under_test()
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, d, generator=g)
    b0, b1 = torch.randn(N0, d, generator=g), torch.randn(N1, d, generator=g)
    count = 1 + seed % 2
    pos = OwnPositives(seed % 3, count) if positives and N0 >= seed % 3 + B * count else None
    if pos is not None:  # make the own positives close to their anchors, as in training
        for i in range(B):
            rows = slice(pos.offset + i * count, pos.offset + (i + 1) * count)
            b0[rows] = a[i] + 0.5 * b0[rows]
    t0 = _tags(N0, B, g, dev, owners=True)
    if pos is not None:  # own positives stay valid and in their row (a tagged one would leave it)
        t0[pos.offset : pos.offset + B * count] = TAG_ALL
    t1 = _tags(N1, B, g, dev, owners=False)
    case = Case(a.to(dev), (b0.to(dev), b1.to(dev)), (t0, t1), 0.3 if cosine else 2.0, cosine, pos, dims=dims)
    if reduce == "sigmoid":
        case.bias = -1.5
    if filt == "guide":
        ga, g0, g1 = (torch.randn(n, gdim, generator=g).to(dev) for n in (B, N0, N1))
        case.guide = (ga, g0, g1)
        case.threshold = (torch.rand(B, generator=g) * 0.8 - 0.2).to(dev)
    elif filt == "self":
        K = len(dims) if dims else 1
        thr = torch.rand(K, B, generator=g) * (0.6 if cosine else 2.0) - 0.1
        case.threshold = (thr if dims and seed % 2 else thr[0]).to(dev)
    return case


@contextlib.contextmanager
def small_tiles(backend: str, fastcl_config):
    """Make every backend cross its row and column tiles at test sizes."""
    if backend == "torch":
        fastcl_config(torch={"tile": 96})
    elif backend == "cpp":
        fastcl_config(cpp={"test_rows": 3, "test_chunk": 5})
    yield


@pytest.fixture(params=["reference", *backends_under_test()])
def backend(request):
    require(request.param)
    return request.param


def _head(case: Case, prob: LSEProblem, w: torch.Tensor) -> HeadInputs:
    """The head of a fused sweep: the sigmoid's row weights, or a cross-entropy head over the own
    positives (their logits from the oracle)."""
    if case.bias is not None:
        return HeadInputs(SIGMOID_HEAD, None, None, None, w)
    assert case.positives is not None
    _, _, _, L, own = oracle(case)
    B, P = prob.num_anchors, case.positives.count
    pos = L.detach()[own].view(B, P).to(w.dtype)
    return HeadInputs("cross_entropy", pos, None, None, w)


CASES = [  # (B, N0, N1, d)
    (1, 2, 0, 3),
    (5, 12, 7, 9),
    (13, 30, 11, 33),
]
if not small_only():
    CASES.append((37, 80, 45, 70))


def _compare(
    name,
    got,
    want,
    dtype=torch.float32,
    *,
    case: Case | None = None,
    terms: int | None = None,
    logit_scale: float | None = None,
    row_weight: float | None = None,
):
    """``assert_close`` on the finite entries; NaN and -inf must sit exactly where the oracle's are.
    The sums (``terms``, by default from ``case``): a logit's ``d``, a row's ``N0 + N1``
    candidates, a candidate's ``B`` anchors; the logits' size ``max |a| |c| / tau`` (``1/tau``
    for cosine, plus the sigmoid's ``|bias|``) is an absolute error of an lse, a mean logit or a
    value, a relative one of a gradient (a name starting with ``d``), or of its terms when they
    cancel (``row_weight``: the largest upstream weight of a row, e.g. the fused head's, whose
    gradient is softmax minus the own positives)."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    for what, test in (("NaN", torch.isnan), ("-inf", lambda t: t == -math.inf)):
        assert torch.equal(test(got), test(want)), (
            f"{name}: {what} at {test(got).nonzero().tolist()}, want {test(want).nonzero().tolist()}"
        )
    finite = torch.isfinite(want)
    rows = []
    if case is not None:
        (B, d), N = case.anchor.shape, sum(b.shape[0] for b in case.blocks)
        rows = [t.detach().double().nan_to_num(0.0, 0.0, 0.0) for t in (case.anchor, *case.blocks) if t.numel()]
        norm = 1.0 if case.cosine else max(t.norm(dim=-1).max().item() for t in rows)
        terms = loss_terms(B, N, d) if terms is None else terms
        logit_scale = norm**2 / case.tau + abs(case.bias or 0.0) if logit_scale is None else logit_scale
    assert terms is not None and logit_scale is not None, "give a case or the terms and the logits' size"
    kw: dict = dict(magnitude=logit_scale)
    if name.startswith("d") or " d " in name:
        kw = dict(logit_scale=logit_scale)  # magnitude: max |want| (no cancellation)
        if row_weight is not None and case is not None:
            sim = "cos" if case.cosine else "dot"
            term = grad_term_size(rows, similarity=sim, tau=case.tau, row_weight=row_weight)
            kw["magnitude"] = max(want[finite].abs().max().item() if finite.any() else 0.0, term * logit_scale)
    assert_close(name, got[finite], want[finite], dtype, terms=terms, **kw)


def _takes(impl, prob: LSEProblem) -> None:
    """Every backend must take both extensions: a refusal fails (it would otherwise skip)."""
    why = dispatch.reasons(impl.name, prob)
    assert not why, f"backend {impl.name!r} refuses: {why}"


def _check_forward(impl, case: Case, dtype=torch.float32):
    prob = case.problem(dtype)
    _takes(impl, prob)
    tau = torch.tensor(case.tau, device=prob.device)
    with poison_outputs():
        value, stats = impl.forward(prob, tau)
    if case.dims is None:
        want, want_stats = oracle(case)[:2]
    else:
        outs = [oracle(case, m)[:2] for m in case.dims]
        want = torch.stack([v for v, _ in outs])
        want_stats = torch.stack([s for _, s in outs], dim=1 if case.bias is not None else 0)
    assert value.shape == want.shape and stats.shape == want_stats.shape
    _compare("value", value, want, dtype, case=case)
    _compare("stats", stats, want_stats, dtype, case=case)


def _check_backward(impl, case: Case, seed: int, dtype=torch.float32):
    prob = case.problem(dtype)
    dev = prob.device
    tau = torch.tensor(case.tau, device=dev)
    gen = torch.Generator().manual_seed(seed)
    K = 1 if case.dims is None else len(case.dims)
    B = prob.num_anchors
    g = torch.randn(K, B, generator=gen).to(dev)
    d_pos = None
    if case.positives is not None and case.bias is None:
        d_pos = torch.randn(K, B, case.positives.count, generator=gen).to(dev)
    value = impl.forward(prob, tau)[0]
    if case.dims is None:
        args = (value, g[0], None if d_pos is None else d_pos[0])
    else:
        args = (value, g, d_pos)
    with poison_outputs():
        d_a, (d0, d1) = impl.backward(prob, tau, *args)
    want = None
    for k in range(K):
        m = None if case.dims is None else case.dims[k]
        gk = torch.where(torch.isfinite(value[k] if case.dims else value), g[k], 0.0)
        part = oracle_grads(case, gk.cpu(), None if d_pos is None else d_pos[k].cpu(), m)
        want = part if want is None else [x + y for x, y in zip(want, part)]
    assert want is not None
    for name, got, ref in zip(("d anchor", "d block0", "d block1"), (d_a, d0, d1), want):
        _compare(name, got, ref, dtype, case=case)
    pad = torch.cat(case.tags) == TAG_PADDING
    assert (torch.cat([d0, d1])[pad] == 0).all(), "padded slots get exactly zero gradient"


def _check_fused(impl, case: Case, seed: int, dtype=torch.float32):
    """The gradient-in-forward sweep: the same rows and, for the row weights ``w``, the gradients
    of ``sum_i w_i loss_i`` (sigmoid: ``loss_i = value_i``; LSE: the cross-entropy head over the
    own positives, checked as ``g = w`` on the LSE plus ``d_pos = -w / P``)."""
    if impl.fused is None or (case.dims is not None and not impl.fused_takes_dims):
        return
    if case.bias is None and (case.positives is None or case.dims is not None):
        return  # the LSE head with dims takes per-prefix positive logits: tests/ops/test_matryoshka_*.py
    prob = case.problem(dtype)
    dev = prob.device
    tau = torch.tensor(case.tau, device=dev)
    K, B = (1 if case.dims is None else len(case.dims)), prob.num_anchors
    w = torch.rand(K, B, generator=torch.Generator().manual_seed(seed)).to(dev)
    head = _head(case, prob, w[0] if case.dims is None else w)
    with poison_outputs():
        out = impl.fused(prob, tau, head)
    _compare("fused value", out.lse, impl.forward(prob, tau)[0], dtype, case=case)
    assert out.d_anchor is not None and out.d_blocks is not None
    value = oracle(case)[0] if case.dims is None else None
    grads = [torch.zeros(x.shape, dtype=torch.float64) for x in (case.anchor, *case.blocks)]
    for k in range(K):
        m = None if case.dims is None else case.dims[k]
        g, d_pos = w[k].cpu().double(), None
        if case.bias is None:  # cross entropy: d loss_i/d lse_i = 1, d loss_i/d l_ik = -1/P
            assert case.positives is not None and value is not None
            g = torch.where(value.detach().cpu() == -math.inf, 0.0, g)
            d_pos = -g[:, None].expand(B, case.positives.count) / case.positives.count
        part = oracle_grads(case, g, d_pos, m)
        grads = [x + y.cpu() for x, y in zip(grads, part)]
    for name, got, ref in zip(("d anchor", "d block0", "d block1"), (out.d_anchor, *out.d_blocks), grads):
        _compare(f"fused {name}", got, ref, dtype, case=case, row_weight=w.abs().max().item() if w.numel() else 0.0)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("shape", CASES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
@pytest.mark.parametrize("filt", [None, "guide", "self"])
@pytest.mark.parametrize("cosine", [True, False], ids=["cos", "dot"])
def test_against_oracle(backend, fastcl_config, shape, reduce, filt, cosine):
    if filt is None and reduce == "lse":
        pytest.skip("the plain LSE: tests/ops/test_backend_matrix.py")
    impl = dispatch.get(backend)
    seed = case_seed(shape, reduce, filt, cosine) % 1000
    case = make_case(*shape, seed=seed, reduce=reduce, filt=filt, cosine=cosine)
    with small_tiles(backend, fastcl_config):
        _check_forward(impl, case)
        _check_backward(impl, case, seed)
        _check_fused(impl, case, seed)


@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
@pytest.mark.parametrize("filt", [None, "guide", "self"])
def test_matryoshka(backend, fastcl_config, reduce, filt):
    """Every prefix's rows as the plain problem on that prefix; the guide's decisions shared,
    a self filter's per prefix (``[K, B]`` thresholds in odd seeds)."""
    if filt is None and reduce == "lse":
        pytest.skip("tests/ops/test_matryoshka_contract.py")
    impl = dispatch.get(backend)
    for seed in (3, 4):
        case = make_case(7, 20, 6, 24, seed=seed, reduce=reduce, filt=filt, dims=(24, 8, 16))
        with small_tiles(backend, fastcl_config):
            _check_forward(impl, case)
            _check_backward(impl, case, seed)
            _check_fused(impl, case, seed)


@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
def test_ties_stay(backend, reduce):
    """A candidate whose guide similarity equals the threshold exactly stays (``>`` is strict):
    guide vectors of +-1/2 in 4 dims have unit norm and dot products that are multiples of 1/4,
    exact in every summation order."""
    dev = device_under_test()
    B, d = 4, 6
    signs = torch.tensor([[1, 1, 1, 1], [1, 1, 1, -1], [1, 1, -1, -1], [1, -1, -1, -1], [-1, -1, -1, -1]])
    guide_rows = 0.5 * signs.double()
    ga = guide_rows[[0, 1, 2, 3]]
    g0 = guide_rows[[0, 1, 2, 3, 1, 2, 4, 0]]  # own positives (rows 0..3: cos 1) then others
    case = make_case(B, 8, 0, d, seed=2, reduce=reduce, dev=dev)
    case.positives = OwnPositives(0, 1)
    case.tags = (torch.full((8,), TAG_ALL, dtype=torch.int32, device=dev), case.tags[1][:0])
    case.guide = (ga.float().to(dev), g0.float().to(dev), torch.zeros(0, 4, device=dev))
    # anchor i's positive has guide cosine 1; margin 0.5 -> threshold 0.5: a candidate at 0.5 stays
    case.threshold = torch.full((B,), 0.5, device=dev)
    impl = dispatch.get(backend)
    _check_forward(impl, case)
    _check_backward(impl, case, 1)
    # the oracle keeps candidate 4 (+++-) for anchor 0 (++++): cosine exactly 0.5, a tie; it drops
    # candidate 7 (++++, cosine 1); so dropping the tie instead changes row 0's value
    bumped = Case(**{**case.__dict__, "threshold": torch.full((B,), 0.4999, device=dev)})
    assert not torch.allclose(oracle(case)[0][0], oracle(bumped)[0][0])


@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
def test_nan_in_a_dropped_column(backend, reduce):
    """A NaN candidate that the guide drops from some rows: those rows' values and gradients stay
    finite (and equal the oracle's); the rows that keep it are NaN."""
    dev = device_under_test()
    case = make_case(6, 14, 5, 8, seed=11, reduce=reduce, filt="guide", dev=dev)
    pos = case.positives
    assert pos is not None and pos.offset > 0
    c = 0  # a block-0 candidate that is no own positive (those are rows offset .. offset + 6 * count)
    b0 = case.blocks[0].clone()
    b0[c, 3] = math.nan
    t0 = case.tags[0].clone()
    t0[c] = TAG_ALL
    ga, g0, g1 = case.guide  # type: ignore[misc]
    g0 = g0.clone()
    g0[c] = ga[0] * 3 + 0.01 * g0[c]  # the guide puts it next to anchor 0 (and drops it there)
    case.blocks, case.tags, case.guide = (b0, case.blocks[1]), (t0, case.tags[1]), (ga, g0, g1)
    case.threshold = torch.full((6,), 0.9, device=dev)
    impl = dispatch.get(backend)
    prob = case.problem()
    _takes(impl, prob)
    value = impl.forward(prob, torch.tensor(case.tau, device=dev))[0]
    want = oracle(case)[0].detach()
    assert torch.isfinite(value[0]), "row 0 drops the NaN column: its value is finite"
    assert torch.equal(torch.isnan(value).cpu(), torch.isnan(want).cpu())
    _check_forward(impl, case)
    g = torch.zeros(6, device=dev)
    g[0] = 1.0
    with poison_outputs():
        d_a, (d0, d1) = impl.backward(prob, torch.tensor(case.tau, device=dev), value, g, None)
    assert torch.isfinite(d_a[0]).all(), "no NaN reaches the gradient of a row that drops the column"
    # row 0's gradients against the oracle's (which masks the logits before any elementwise
    # function: a dropped NaN gets an exactly zero gradient, not 0 * NaN, under autograd too), on
    # the problem of row 0 alone: in the whole problem rows 1..5 keep the NaN, and what their zero
    # upstream gradient times their NaN weights gives is not what this test is about
    row0 = Case(**{**case.__dict__, "anchor": case.anchor[:1], "threshold": case.threshold[:1]})
    row0.guide = (ga[:1], g0, g1)
    prob0 = row0.problem()
    value0 = impl.forward(prob0, torch.tensor(case.tau, device=dev))[0]
    assert torch.isfinite(value0).all()
    with poison_outputs():
        grads = impl.backward(prob0, torch.tensor(case.tau, device=dev), value0, g[:1], None)
    want_grads = oracle_grads(row0, g[:1].cpu(), None)
    assert all(torch.isfinite(w).all() for w in want_grads)
    for name, got, ref in zip(("d anchor", "d block0", "d block1"), (grads[0], *grads[1]), want_grads):
        _compare(name, got, ref, case=case)


def test_bad_filter_shapes():
    a = torch.randn(3, 4)
    blocks = (torch.randn(5, 4), torch.randn(0, 4))
    tags = (torch.full((5,), TAG_ALL, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
    with pytest.raises(ValueError, match="threshold"):
        LSEProblem(a, blocks, tags, filter=Filter(torch.zeros(4)))
    with pytest.raises(ValueError, match="guide embeddings"):
        LSEProblem(
            a, blocks, tags, filter=Filter(torch.zeros(3), torch.randn(3, 2), (torch.randn(4, 2), torch.randn(0, 2)))
        )
    with pytest.raises(ValueError, match="guide_anchor and guide_blocks"):
        LSEProblem(a, blocks, tags, filter=Filter(torch.zeros(3), torch.randn(3, 2), None))


def column_oracle(case: Case):
    """``(lse [B + N], mean_logit [B + N], leaves, L)`` of the column statistics in float64 with
    autograd: the rows' LSE over the structural mask, then the columns' over its transpose (an
    empty line: -inf and 0)."""
    _, _, leaves, L, _ = oracle(case)
    B = L.shape[0]
    tags = torch.cat(case.tags).long().cpu()
    keep = torch.tensor([[t != TAG_PADDING and t != i for t in tags.tolist()] for i in range(B)], device=L.device)

    def lse_of(logits, k):
        masked = torch.where(k, logits, -math.inf)
        empty = ~k.any(1)
        lse = torch.where(empty, -math.inf, torch.logsumexp(torch.where(empty[:, None], 0.0, masked), 1))
        p = torch.where(k, torch.exp(masked - torch.where(empty, 0.0, lse)[:, None]), 0.0)
        return lse, (p * torch.where(k, logits, 0.0)).sum(1)

    (lr, mr), (lc, mc) = lse_of(L, keep), lse_of(L.T, keep.T)
    return torch.cat([lr, lc]), torch.cat([mr, mc]).detach(), leaves, L


def _refuses_columns(impl, prob: LSEProblem) -> bool:
    """True for a backend without column statistics (``takes_columns``, e.g. triton), after
    checking that it refuses them by name: never computed as rows only (CLIP then runs its two
    directions). Otherwise it must take them (:func:`_takes`)."""
    if impl.takes_columns:
        _takes(impl, prob)
        return False
    assert any("column statistics" in why for why in dispatch.reasons(impl.name, prob)), impl.name
    with pytest.raises(dispatch.BackendUnavailableError, match="column statistics"):
        dispatch.choose(prob, backend=impl.name)
    return True


@pytest.mark.parametrize("shape", CASES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cosine", [True, False], ids=["cos", "dot"])
def test_column_statistics(backend, monkeypatch, fastcl_config, shape, cosine):
    """``LSEProblem.columns``: the columns' LSE and mean logit over the rows whose set holds the
    column (the transposed mask), merged over row tiles; the backward's weights add the
    columns' softmax times their gradients (the rows' ``[B + N]`` layout: rows, then columns)."""
    impl = dispatch.get(backend)
    seed = case_seed(shape, cosine, "columns") % 1000
    case = make_case(*shape, seed=seed, cosine=cosine)
    prob = case.problem()
    prob = LSEProblem(prob.anchor, prob.blocks, prob.tags, prob.cosine, positives=prob.positives, columns=True)
    if _refuses_columns(impl, prob):
        return
    dev, B = prob.device, prob.num_anchors
    tau = torch.tensor(case.tau, device=dev)
    want, want_ml, (a, b0, b1), L = column_oracle(case)
    with small_tiles(backend, fastcl_config), poison_outputs():
        value, ml = impl.forward(prob, tau)
    assert value.shape == (prob.num_rows,)
    _compare("lse", value, want, case=case)
    _compare("mean logit", ml, want_ml, case=case)
    g = torch.randn(prob.num_rows, generator=torch.Generator().manual_seed(seed)).double()
    g = torch.where(torch.isfinite(want.detach().cpu()), g, 0.0)
    d_pos = None if case.positives is None else torch.randn(B, case.positives.count).double()
    total = (g[g != 0].to(want.device) * want[g != 0]).sum()
    if d_pos is not None:
        cols = (
            case.positives.offset + torch.arange(B)[:, None] * case.positives.count + torch.arange(case.positives.count)
        )
        total = total + (d_pos.to(L.device) * L[torch.arange(B)[:, None], cols.to(L.device)]).sum()
    ref = torch.autograd.grad(total, (a, b0, b1))
    with small_tiles(backend, fastcl_config), poison_outputs():
        d_a, (d0, d1) = impl.backward(
            prob, tau, value, g.float().to(dev), None if d_pos is None else d_pos.float().to(dev)
        )
    for name, got, r in zip(("d anchor", "d block0", "d block1"), (d_a, d0, d1), ref):
        _compare(name, got, r, case=case)


@pytest.mark.parametrize("cosine", [True, False], ids=["cos", "dot"])
def test_column_statistics_empty_lines(backend, fastcl_config, cosine):
    """A row without candidates and columns in no row (padding, or tagged out of the only row
    that would hold them): lse -inf, mean logit 0 and no gradient from them, even with a nonzero
    upstream gradient, while the other lines match the oracle."""
    impl = dispatch.get(backend)
    dev = device_under_test()
    layouts = [  # (B, tags0, tags1): row 1 has no candidate; columns 4 and 5 (padding) no row
        (3, [1, 1, 1, 1, TAG_PADDING], [1, TAG_PADDING, 1]),
        # B = 1: columns 0 and 2 leave the only row (tag 0), column 3 is padding
        (1, [0, TAG_ALL, 0], [TAG_PADDING]),
    ]
    for B, t0, t1 in layouts:
        case = make_case(B, len(t0), len(t1), 6, seed=B, cosine=cosine, positives=False, dev=dev)
        case.tags = (torch.tensor(t0, dtype=torch.int32, device=dev), torch.tensor(t1, dtype=torch.int32, device=dev))
        prob = LSEProblem(case.anchor, case.blocks, case.tags, cosine, columns=True)
        if _refuses_columns(impl, prob):
            return
        tau = torch.tensor(case.tau, device=dev)
        want, want_ml, leaves, _ = column_oracle(case)
        empty = torch.isinf(want.detach()).cpu()
        assert empty.sum() >= 2
        with small_tiles(backend, fastcl_config), poison_outputs():
            value, ml = impl.forward(prob, tau)
        assert (value.cpu()[empty] == -math.inf).all() and (ml.cpu()[empty] == 0).all()
        _compare("lse", value, want, case=case)
        _compare("mean logit", ml, want_ml, case=case)
        g = torch.linspace(0.5, 1.5, prob.num_rows, dtype=torch.float64)  # nonzero on the empty lines too
        ref = torch.autograd.grad((g[~empty].to(want.device) * want[~empty]).sum(), leaves)
        with small_tiles(backend, fastcl_config), poison_outputs():
            d_a, (d0, d1) = impl.backward(prob, tau, value, g.float().to(dev), None)
        for name, got, r in zip(("d anchor", "d block0", "d block1"), (d_a, d0, d1), ref):
            _compare(name, got, r, case=case)
        d_c, lonely = torch.cat([d0, d1]).cpu(), empty[B:]
        assert (d_c[lonely] == 0).all(), "a column in no row gets exactly zero gradient"
        if empty[:B].any():
            assert (d_a.cpu()[empty[:B]] == 0).all(), "a row without candidates gets exactly zero gradient"


def test_column_statistics_non_finite(backend, fastcl_config):
    """A NaN anchor row and an Inf candidate (no filter): every line that holds one of them is
    NaN, rows and columns; a column tagged out of the NaN row, and a padded one, are not (a
    column pass selects on the mask, never reads -inf + NaN)."""
    impl = dispatch.get(backend)
    dev = device_under_test()
    case = make_case(5, 9, 3, 7, seed=1, positives=False, dev=dev)
    a, b0 = case.anchor.clone(), case.blocks[0].clone()
    a[2, 1], b0[6, 0] = math.nan, math.inf
    t0 = torch.tensor([-1, 2, -1, 2, TAG_PADDING, -1, -1, -1, -1], dtype=torch.int32, device=dev)
    case.anchor, case.blocks, case.tags = a, (b0, case.blocks[1]), (t0, torch.full((3,), TAG_ALL, device=dev).int())
    prob = LSEProblem(case.anchor, case.blocks, case.tags, True, columns=True)
    if _refuses_columns(impl, prob):
        return
    want, want_ml, _, _ = column_oracle(case)
    with small_tiles(backend, fastcl_config), poison_outputs():
        value, ml = impl.forward(prob, torch.tensor(case.tau, device=dev))
    assert torch.isfinite(want[5 + 1]) and torch.isfinite(want[5 + 3]) and want[5 + 4] == -math.inf
    _compare("lse", value, want, case=case)
    _compare("mean logit", ml, want_ml, case=case)
