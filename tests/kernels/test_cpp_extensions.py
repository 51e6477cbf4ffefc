"""The ``"cpp"`` backend's extensions (the sigmoid reduction, the filter) on paths only the C++
side has, beyond the shared oracle test (tests/ops/test_extensions.py): step 1 by fastcl's GEMM
tile (``cpp.gemm``), the row passes with and without the cosine bound, 16-bit inputs and a guide
of another dtype, a non-finite anchor row under a filter, the fused Matryoshka step with a
filter, determinism, the ops' schema (opcheck) and their argument checks.

Most cases compare with the ``torch`` backend in float64 on the same inputs (itself checked
against the independent oracle), so that shapes beyond the oracle's loops stay cheap.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from fastcl.ops import _cpp
from fastcl.ops._torch_impl import TorchLSE
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, Filter, LSEProblem, OwnPositives, Sigmoid, poison_outputs
from fastcl.ops.head import SIGMOID_HEAD, HeadInputs
from fastcl.testing import assert_close, assert_roundoff
from tests.helpers.backends import require
from tests.helpers.roundoff import grad_term_size
from tests.ops.test_extensions import (
    Case,
    _check_backward,
    _check_forward,
    _check_fused,
    _compare,
    make_case,
    oracle,
    oracle_grads,
)

CPP, TORCH = _cpp.CppLSE(), TorchLSE()
TILE = _cpp._capability == "AVX512"
needs_tile = pytest.mark.skipif(not TILE, reason=f"the GEMM tile needs the AVX-512 build (this is {_cpp._capability})")


@pytest.fixture(autouse=True)
def cpp_backend():
    require("cpp")


def _as64(prob: LSEProblem) -> LSEProblem:
    """The same problem in float64 (the torch backend's reference run on the same inputs)."""
    f, s = prob.filter, prob.sigmoid
    if f is not None:
        f = Filter(f.threshold.double(), f.guide_anchor, f.guide_blocks)
    if s is not None:
        s = Sigmoid(s.bias.double())
    blocks = (prob.blocks[0].double(), prob.blocks[1].double())
    return replace(prob, anchor=prob.anchor.double(), blocks=blocks, filter=f, sigmoid=s)


def _head(prob: LSEProblem, seed: int) -> HeadInputs:
    """Row weights (sigmoid), or a cross-entropy head over the own positives, their logits
    formed by the backend (``pos_logits=None``)."""
    B = prob.num_anchors
    w = torch.rand(B, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if prob.sigmoid is not None:
        return HeadInputs(SIGMOID_HEAD, None, None, None, w)
    return HeadInputs("cross_entropy", None, None, None, w)


def _all_modes(impl, prob: LSEProblem, tau: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Forward, recompute backward (random g) and, for cpp, the fused step, as one dict."""
    g = torch.randn(prob.num_anchors, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    with poison_outputs():
        value, stats = impl.forward(prob, tau)
        g = torch.where(torch.isfinite(value), g.to(value.dtype), 0.0)
        d_a, (d0, d1) = impl.backward(prob, tau, value, g, None)
    return {"value": value, "stats": stats, "d_a": d_a, "d0": d0, "d1": d1}


def _logit_scale(prob: LSEProblem, tau: torch.Tensor) -> float:
    """The logits' size: ``1/tau`` for cosine, ``max|a| max|c| / tau`` for dot products."""
    if prob.cosine:
        return 1 / float(tau)
    norms = [t.double().norm(dim=-1).max().item() for t in (prob.anchor, *prob.blocks) if t.numel()]
    return max(norms) ** 2 / float(tau)


def _terms(prob: LSEProblem) -> int:
    """The sums behind an output: a logit's d coordinates, a row's candidates, a column's anchors."""
    return prob.anchor.shape[1] + sum(b.shape[0] for b in prob.blocks) + prob.num_anchors


def _fused_vs_recompute(prob: LSEProblem, tau: torch.Tensor, seed: int) -> None:
    """cpp's fused step against its own forward + backward with the head's weights: the sigmoid's
    rows are the values themselves (g = w). The same sums in another order, in ``cd``: values
    and mean logits of the logits' size, gradients relative to the largest (the size of the
    terms a small entry cancels)."""
    head = _head(prob, seed)
    cd = torch.float64 if prob.dtype == torch.float64 else torch.float32
    with poison_outputs():
        out = CPP.fused(prob, tau, replace(head, weights=head.weights.to(cd)))
    value, stats = CPP.forward(prob, tau)
    kw = dict(terms=_terms(prob), magnitude=_logit_scale(prob, tau), equal_nan=True)
    assert_roundoff(out.lse, value, cd, **kw, msg="lse")
    assert_roundoff(out.mean_logit, stats, cd, **kw, msg="mean logit")
    if prob.sigmoid is None:
        return  # the LSE head's gradients: the shared oracle test
    assert_roundoff(out.loss_rows, value, cd, **kw, msg="loss rows")
    assert out.d_pos is not None and out.d_pos.shape == (prob.num_anchors, 0)
    d_a, (d0, d1) = CPP.backward(prob, tau, value, head.weights.to(cd))
    assert out.d_anchor is not None and out.d_blocks is not None
    size = max(t.abs().max().item() for t in (d_a, d0, d1) if t.numel()) * _logit_scale(prob, tau)
    for got, want in zip((out.d_anchor, *out.d_blocks), (d_a, d0, d1)):
        assert_roundoff(got, want, cd, terms=_terms(prob), magnitude=size, equal_nan=True, msg="grad")
    g_dot = (head.weights.to(cd) * stats[0]).sum()  # B weights (<= 1) x mean logits
    assert_roundoff(out.g_dot_mean_logit, g_dot, cd, terms=_terms(prob), magnitude=_logit_scale(prob, tau))


def _agree(prob: LSEProblem, tau: torch.Tensor, seed: int) -> None:
    got = _all_modes(CPP, prob, tau, seed)
    want = _all_modes(TORCH, _as64(prob), tau, seed)
    for name in got:
        _compare(name, got[name], want[name], torch.float32, terms=_terms(prob), logit_scale=_logit_scale(prob, tau))
    _fused_vs_recompute(prob, tau, seed)


def _problem(B, N0, N1, d, *, seed, reduce, filt, cosine=True, gdim=7, dtype=torch.float32) -> LSEProblem:
    case = make_case(B, N0, N1, d, seed=seed, reduce=reduce, filt=filt, cosine=cosine, gdim=gdim)
    return case.problem(dtype)


# ----------------------------------------------------------------- step 1 by the GEMM tile


@needs_tile
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("rows", [None, 5])
@pytest.mark.parametrize("reduce, filt", [("sigmoid", None), ("sigmoid", "guide"), ("lse", "self"), ("lse", "guide")])
def test_extensions_with_the_tile(fastcl_config, threads, n_threads, rows, reduce, filt):
    """cpp.gemm='own' forces the tile at any size: block, row-tile (12) and panel (32) edges."""
    threads(n_threads)
    fastcl_config(cpp={"gemm": "own", "test_rows": rows})
    prob = _problem(29, 70, 33, 40, seed=5, reduce=reduce, filt=filt)
    _agree(prob, torch.tensor(0.3), seed=1)


@needs_tile
@pytest.mark.parametrize("reduce, filt", [("sigmoid", "self"), ("lse", "guide")])
def test_tile_chosen_from_512_anchors(threads, reduce, filt):
    """At 512 anchors the automatic choice takes the tile on AVX-512 CPUs other than Intel's."""
    threads(2)
    prob = _problem(520, 1100, 40, 24, seed=2, reduce=reduce, filt=filt)
    _agree(prob, torch.tensor(0.3), seed=2)


# ----------------------------------------------------------------- the row passes


@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
@pytest.mark.parametrize("filt", ["guide", "self"])
@pytest.mark.parametrize("tau, cosine", [(0.05, True), (0.02, True), (2.0, False)], ids=["bound", "max", "dot"])
def test_row_passes(fastcl_config, reduce, filt, tau, cosine):
    """Cosine at tau >= 0.04 takes 1/tau for the row max (one pass fewer), a smaller tau and dot
    products the max; both with the filter's adds and both reductions; rows cut into blocks."""
    fastcl_config(cpp={"test_rows": 4, "test_chunk": 9})
    prob = _problem(11, 40, 9, 16, seed=4, reduce=reduce, filt=filt, cosine=cosine)
    _agree(prob, torch.tensor(tau), seed=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduce, filt", [("sigmoid", None), ("sigmoid", "guide"), ("lse", "self"), ("lse", "guide")])
def test_sixteen_bit_inputs(dtype, reduce, filt):
    """16-bit inputs through the float32 copy (the torch backend's float64 run on the same
    rounded values); a guide of another dtype (bf16 guide, fp16 model and the reverse)."""
    prob = _problem(13, 30, 11, 24, seed=7, reduce=reduce, filt=filt, dtype=dtype)
    f = prob.filter
    if f is not None and f.guide_anchor is not None and f.guide_blocks is not None:
        other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
        guide = (f.guide_anchor.to(other), tuple(g.to(other) for g in f.guide_blocks))
        prob = replace(prob, filter=Filter(f.threshold, guide[0], guide[1]))  # type: ignore[arg-type]
    _agree(prob, torch.tensor(0.3), seed=4)


@pytest.mark.parametrize("B, N0, N1", [(0, 5, 3), (4, 0, 0), (1, 1, 0), (5, 0, 4)])
@pytest.mark.parametrize("reduce, filt", [("sigmoid", "guide"), ("sigmoid", None), ("lse", "self"), ("lse", "guide")])
def test_degenerate_shapes(B, N0, N1, reduce, filt):
    """No anchors, no candidates, one of each, against the oracle with every output poisoned:
    empty rows give the sigmoid 0 and the LSE -inf, and no gradient."""
    g = torch.Generator().manual_seed(B + N0 + N1)
    d = 6
    blocks = (torch.randn(N0, d, generator=g), torch.randn(N1, d, generator=g))
    tags = (torch.full((N0,), TAG_ALL, dtype=torch.int32), torch.full((N1,), TAG_ALL, dtype=torch.int32))
    case = Case(torch.randn(B, d, generator=g), blocks, tags, 0.3, True, None)
    if reduce == "sigmoid":
        case.bias = -1.0
    if filt is not None:
        case.threshold = torch.full((B,), 0.2)
    if filt == "guide":
        case.guide = (torch.randn(B, 3, generator=g), torch.randn(N0, 3, generator=g), torch.randn(N1, 3, generator=g))
    _check_forward(CPP, case)
    _check_backward(CPP, case, seed=1)
    _check_fused(CPP, case, seed=1)
    if N0 + N1 == 0 and B:
        value = CPP.forward(case.problem(), torch.tensor(0.3))[0]
        assert (value == (0 if reduce == "sigmoid" else -math.inf)).all()


# ----------------------------------------------------------------- non-finite rows


@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
@pytest.mark.parametrize("mode", ["recompute", "fused"])
def test_nan_anchor_row_under_a_filter(reduce, mode):
    """Anchor 2 holds a NaN and the guide drops candidate 6 from its row only: row 2 is NaN, and
    its NaN reaches the gradient of every candidate it keeps but not of candidate 6 (its weight
    there is 0 by selection, not 0 * NaN); the other rows are those of the oracle."""
    case = make_case(4, 10, 3, 6, seed=3, reduce=reduce, filt="guide")
    case.positives = OwnPositives(0, 1)
    case.tags = (torch.full((10,), TAG_ALL, dtype=torch.int32), torch.full((3,), TAG_PADDING, dtype=torch.int32))
    a = case.anchor.clone()
    a[2, 1] = math.nan
    ga, g0, g1 = case.guide  # type: ignore[misc]
    g0 = g0.clone()
    g0[6] = ga[2] * 4 + 0.01 * g0[6]  # next to anchor 2 in the guide's space, and dropped there
    case.anchor, case.guide = a, (ga, g0, g1)
    case.threshold = torch.tensor([0.999, 0.999, 0.9, 0.999])
    prob, tau = case.problem(), torch.tensor(case.tau)
    B = 4
    w = torch.rand(B, generator=torch.Generator().manual_seed(0))
    value = CPP.forward(prob, tau)[0]
    if mode == "fused":
        head = HeadInputs(SIGMOID_HEAD if reduce == "sigmoid" else "cross_entropy", None, None, None, w)
        out = CPP.fused(prob, tau, head)
        assert out.d_anchor is not None and out.d_blocks is not None
        d_a, d_b = out.d_anchor, out.d_blocks
    else:
        d_a, d_b = CPP.backward(prob, tau, value, w, None)
    assert torch.isnan(value[2]) and torch.isfinite(value[[0, 1, 3]]).all()
    assert torch.isfinite(d_b[0][6]).all(), "no NaN reaches the candidate the NaN row drops"
    assert torch.isnan(d_b[0][5]).any(), "the NaN row's NaN reaches a candidate it keeps"
    assert (d_b[1] == 0).all(), "padding gets exactly zero"
    assert torch.isfinite(d_a[[0, 1, 3]]).all()
    want_value = oracle(case)[0]
    _compare("value", value, want_value, case=case)
    if mode == "recompute":
        # The LSE: the oracle. It reads the NaN row as zeros through torch.where, whose gradient
        # there is 0, where the kernels' gradient of that row is NaN ("reaches every gradient that
        # sees it"): rows 0, 1, 3 only. The sigmoid: the torch backend in float64, since the oracle
        # forms its terms before selecting them (a where after softplus(NaN) passes 0 * NaN = NaN
        # back into the dropped column, which the contract rules out).
        if reduce == "lse":
            want = oracle_grads(case, w.double(), None)
        else:
            want_a, want_b = TORCH.backward(_as64(prob), tau, value.double(), w.double(), None)
            want = [want_a, *want_b]
        _compare("d block0 row 6", d_b[0][6], want[1][6], case=case)
        _compare("d anchor rows 0, 1, 3", d_a[[0, 1, 3]], want[0][[0, 1, 3]], case=case)


# ----------------------------------------------------------------- Matryoshka


@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
@pytest.mark.parametrize("filt", ["guide", "self"])
@pytest.mark.parametrize("cosine", [True, False])
def test_fused_prefixes_are_the_plain_steps(fastcl_config, reduce, filt, cosine):
    """The fused Matryoshka step (one sweep over d, K weight tiles) equals the K plain fused steps
    on the prefixes, summed: rows per prefix, gradients zero beyond each prefix (per-prefix self
    thresholds, [K, B])."""
    fastcl_config(cpp={"test_rows": 3})
    dims = (24, 8, 16)
    case = make_case(7, 20, 6, 24, seed=5, reduce=reduce, filt=filt, dims=dims, cosine=cosine)
    prob, tau = case.problem(), torch.tensor(case.tau)
    K, B = len(dims), prob.num_anchors
    w = torch.rand(K, B, generator=torch.Generator().manual_seed(1))
    kind = SIGMOID_HEAD if reduce == "sigmoid" else "cross_entropy"
    out = CPP.fused(prob, tau, HeadInputs(kind, None, None, None, w))
    assert out.d_anchor is not None and out.d_blocks is not None
    grads = [torch.zeros_like(t) for t in (prob.anchor, *prob.blocks)]
    for k, m in enumerate(dims):
        part = CPP.fused(prob.prefix(k), tau, HeadInputs(kind, None, None, None, w[k]))
        assert part.d_anchor is not None and part.d_blocks is not None
        torch.testing.assert_close(out.lse[k], part.lse)
        stats = out.mean_logit[:, k] if reduce == "sigmoid" else out.mean_logit[k]
        # mean logits over one sweep of d or K: another order of a logit's d and a row's sums
        assert_roundoff(stats, part.mean_logit, torch.float32, terms=_terms(prob), magnitude=_logit_scale(prob, tau))
        assert out.loss_rows is not None
        torch.testing.assert_close(out.loss_rows[k], part.loss_rows)
        for t, p in zip(grads, (part.d_anchor, *part.d_blocks)):
            t[:, :m] += p
    for got, want in zip((out.d_anchor, *out.d_blocks), grads):
        # the fused head's gradient: softmax-weighted candidates minus the own positives, whose
        # terms (weights <= max w) may cancel: relative error eps * logits of their size
        sim = "cos" if prob.cosine else "dot"
        term = grad_term_size((prob.anchor, *prob.blocks), similarity=sim, tau=float(tau), row_weight=w.max().item())
        logits = _logit_scale(prob, tau)
        kw = dict(terms=_terms(prob), magnitude=term * logits, logit_scale=logits)
        assert_close("d", got, want, torch.float32, **kw)


# ----------------------------------------------------------------- determinism, schema, checks


def test_deterministic_for_a_thread_count(threads):
    threads(2)
    prob = _problem(600, 700, 50, 32, seed=8, reduce="sigmoid", filt="guide")
    tau = torch.tensor(0.1)
    head = HeadInputs(SIGMOID_HEAD, None, None, None, torch.full((600,), 1 / 600))
    first, second = CPP.fused(prob, tau, head), CPP.fused(prob, tau, head)
    for name in ("lse", "mean_logit", "d_anchor", "g_dot_mean_logit"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name


def _op_args(prefix: bool):
    """Small inputs of every op with every extension argument set (sigmoid and guide filter)."""
    g = torch.Generator().manual_seed(0)
    B, N0, N1, d, P = 3, 7, 2, 5, 2
    a, c0, c1 = torch.randn(B, d, generator=g), torch.randn(N0, d, generator=g), torch.randn(N1, d, generator=g)
    t0, t1 = torch.full((N0,), TAG_ALL, dtype=torch.int32), torch.full((N1,), TAG_ALL, dtype=torch.int32)
    rows = (2, B) if prefix else (B,)
    dims = [[2, 5]] if prefix else []
    ext = dict(
        pos_count=P,
        bias=torch.tensor(-1.0),
        threshold=torch.rand(*rows, generator=g),
        guide_anchor=torch.randn(B, 4, generator=g),
        guide_block0=torch.randn(N0, 4, generator=g),
        guide_block1=torch.randn(N1, 4, generator=g),
    )
    return (a, c0, c1, t0, t1, torch.tensor(0.2), True, 1e-8, *dims), ext, rows


@pytest.mark.parametrize("prefix", [False, True])
def test_opcheck_with_extensions(prefix):
    args, ext, rows = _op_args(prefix)
    ops = torch.ops.fastcl
    name = "lse_prefix_" if prefix else "lse_"
    outs = dict(lse=torch.empty(rows), mean_logit=torch.empty(2, *rows))
    torch.library.opcheck(getattr(ops, name + "forward").default, (*args, 1), {**ext, **outs})
    grads = dict(d_anchor=torch.empty(3, 5), d_block0=torch.empty(7, 5), d_block1=torch.empty(2, 5))
    bwd = (*args, torch.randn(rows), torch.rand(rows), None, 1)
    torch.library.opcheck(getattr(ops, name + "backward").default, bwd, {**ext, **grads})
    fused = (*args, "sigmoid", torch.empty(*rows, 0), None, None, torch.rand(rows), 1, False, False)
    outs = dict(
        lse=torch.empty(rows),
        mean_logit=torch.empty(2, *rows),
        loss_rows=torch.empty(rows),
        d_pos=torch.empty(*rows, 0),
        g_dot_mean_logit=torch.empty(()),
        **grads,
    )
    torch.library.opcheck(getattr(ops, name + "fused").default, fused, {**ext, **outs})


def test_bad_extension_arguments_raise():
    args, ext, rows = _op_args(False)
    op = torch.ops.fastcl.lse_forward
    stats = dict(lse=torch.empty(rows), mean_logit=torch.empty(2, *rows))
    with pytest.raises(RuntimeError, match="threshold must be"):
        op(*args, 1, **{**ext, "threshold": torch.zeros(4)}, **stats)
    with pytest.raises(RuntimeError, match="need a threshold"):
        op(*args, 1, **{**ext, "threshold": None}, **stats)
    with pytest.raises(RuntimeError, match="guide_anchor, guide_block0 and guide_block1"):
        op(*args, 1, **{**ext, "guide_block1": None}, **stats)
    with pytest.raises(RuntimeError, match="guide embeddings must be"):
        op(*args, 1, **{**ext, "guide_block0": torch.randn(6, 4)}, **stats)
    with pytest.raises(RuntimeError, match="mean_logit must have shape"):
        op(*args, 1, **ext, lse=torch.empty(rows), mean_logit=torch.empty(rows))  # the sigmoid's stats: [2, B]
    with pytest.raises(RuntimeError, match="do not fit in block0"):
        op(*args, 1, **{**ext, "pos_count": 3}, **stats)
    grads = dict(d_anchor=torch.empty(3, 5), d_block0=torch.empty(7, 5), d_block1=torch.empty(2, 5))
    with pytest.raises(RuntimeError, match="folds no d_pos"):
        torch.ops.fastcl.lse_backward(*args, torch.zeros(3), torch.ones(3), torch.ones(3, 2), 1, **ext, **grads)
    fused = (*args, "cross_entropy", torch.zeros(3, 2), None, None, torch.ones(3), 1, True, False)
    outs = dict(
        lse=torch.empty(3),
        mean_logit=torch.empty(2, 3),
        loss_rows=torch.empty(3),
        d_pos=torch.empty(3, 2),
        g_dot_mean_logit=torch.empty(()),
        **grads,
    )
    with pytest.raises(RuntimeError, match="goes with a bias"):
        torch.ops.fastcl.lse_fused(*fused, **ext, **outs)
