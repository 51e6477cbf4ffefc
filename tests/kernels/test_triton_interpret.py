"""The Triton kernels on CPU tensors through the Triton interpreter.

Run in its own process, with the backend matrix::

    TRITON_INTERPRET=1 FASTCL_TEST_BACKENDS=triton FASTCL_TEST_SMALL=1 \\
        pytest tests/ops/test_backend_matrix.py tests/kernels/test_triton_interpret.py

(skipped without ``TRITON_INTERPRET=1``: the interpreter must be on before the kernels are
imported). The matrix covers the losses end to end on small shapes; this file covers what
it cannot reach cheaply: the primitive on shapes that cross every tile, split and chunk
edge of the launchers (interpreter tiles are 16 wide, chunks 32), the own-positive fold,
``d = 1024``, the structural-mask rule against ``contract.excluded``,
both dS precisions (``triton.ds``), the custom-op registration, and that every launch is in the AOT list.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter suite runs with TRITON_INTERPRET=1 in its own process", allow_module_level=True)
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import fastcl.losses as L  # noqa: E402
from benchmarks.triton_tools import aot  # noqa: E402
from fastcl import config  # noqa: E402
from fastcl import reference as R  # noqa: E402
from fastcl.kernels import _common  # noqa: E402
from fastcl.ops import _torch_impl, _triton  # noqa: E402
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, OwnPositives, excluded, poison_outputs  # noqa: E402
from fastcl.ops.head import HeadInputs  # noqa: E402
from fastcl.testing import assert_close, loss_terms, roundoff  # noqa: E402
from tests.helpers.roundoff import grad_term_size  # noqa: E402

TRITON = _triton.BACKEND


# ---------------------------------------------------------------------------------------
# the structural mask is the contract's
# ---------------------------------------------------------------------------------------


@triton.jit
def _mask_probe(TAGS, OUT, n_rows, n_cols, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    col_ok = cols < n_cols
    keep = _common.structural_mask(rows, n_rows, _common.load_tags(TAGS, cols, col_ok), col_ok)
    tl.store(OUT + rows[:, None] * BN + cols[None, :], keep.to(tl.int32))


def test_structural_mask_is_contract_excluded():
    n_rows, n_cols = 11, 29
    gen = torch.Generator().manual_seed(1)
    tags = torch.randint(-2, n_rows + 3, (n_cols,), generator=gen, dtype=torch.int32)
    tags[:3] = torch.tensor([TAG_PADDING, TAG_ALL, 0], dtype=torch.int32)
    out = torch.full((16, 32), -1, dtype=torch.int32)
    _mask_probe[(1,)](tags, out, n_rows, n_cols, BM=16, BN=32)
    want = ~excluded(tags, torch.arange(n_rows))
    assert torch.equal(out[:n_rows, :n_cols].bool(), want)
    assert not out[n_rows:].any() and not out[:, n_cols:].any()  # out of range: never kept


# ---------------------------------------------------------------------------------------
# the primitive against the float64 oracle, across tile / split / chunk edges
# ---------------------------------------------------------------------------------------


def _problem(B, P, Q, d, dtype, cosine, gen, exclude_own=True):
    """Positives anchor-major in block 0 after ``extra`` leading rows; padding, an empty row,
    a zero-norm candidate (clamped norm)."""
    extra = 3  # block 0 rows before the positives: OwnPositives.offset
    scale = 1.0 if cosine else d**-0.5
    anchor = torch.randn(B, d, generator=gen) * scale
    block0 = torch.randn(extra + B * P, d, generator=gen) * scale
    block1 = torch.randn(Q, d, generator=gen) * scale
    block1[:1] = 0  # a clamped norm
    owner = torch.arange(B, dtype=torch.int32).repeat_interleave(P)
    tags0 = torch.cat([torch.full((extra,), TAG_ALL, dtype=torch.int32), owner if exclude_own else owner * 0 - 1])
    tags1 = torch.full((Q,), TAG_ALL, dtype=torch.int32)
    tags0[torch.rand(tags0.shape, generator=gen) < 0.2] = TAG_PADDING
    tags1[torch.rand(tags1.shape, generator=gen) < 0.2] = TAG_PADDING
    if not exclude_own:  # row 0 empty: every candidate excluded from it
        tags0[tags0 == TAG_ALL] = 0
        tags1[tags1 == TAG_ALL] = 0
    t = [x.to(dtype) for x in (anchor, block0, block1)]
    return LSEProblem(t[0], (t[1], t[2]), (tags0, tags1), cosine, 1e-8, OwnPositives(extra, P))


def _sizes(problem: LSEProblem, tau) -> tuple[int, float]:
    """``(terms, logits)``: a logit's ``d``, a row's candidates, a candidate's ``B`` anchors
    (fastcl.testing.loss_terms); the logits' size ``1/tau`` for cosine, ``max |a| |c| / tau``
    for dot products (the finite rows)."""
    rows = [problem.anchor, *problem.blocks]
    terms = loss_terms(problem.anchor.shape[0], sum(b.shape[0] for b in problem.blocks), problem.anchor.shape[1])
    if problem.cosine:
        return terms, 1 / float(tau)
    norms = [t.double().norm(dim=-1) for t in rows if t.numel()]
    return terms, max(n[n.isfinite()].max().item() for n in norms) ** 2 / float(tau)


def _oracle(problem: LSEProblem, tau: torch.Tensor, g: torch.Tensor, d_pos: torch.Tensor):
    """float64 lse, mean_logit and the gradients of ``sum g*lse + sum d_pos*l_pos``."""
    leaves = [x.detach().double().requires_grad_() for x in (problem.anchor, *problem.blocks)]
    p64 = LSEProblem(leaves[0], (leaves[1], leaves[2]), problem.tags, problem.cosine, problem.eps, problem.positives)
    tau64 = tau.double()
    lse = R.BACKEND.forward(p64, tau64)[0]
    B, P = d_pos.shape
    own = leaves[1][problem.positives.rows(0, B)].view(B, P, -1)
    a = torch.nn.functional.normalize(leaves[0], dim=-1, eps=problem.eps) if problem.cosine else leaves[0]
    o = torch.nn.functional.normalize(own, dim=-1, eps=problem.eps) if problem.cosine else own
    pos_logits = torch.einsum("bd,bpd->bp", a, o) / tau64
    finite = torch.isfinite(lse)
    obj = (g.double() * torch.where(finite, lse, 0.0)).sum() + (d_pos.double() * pos_logits).sum()
    grads = torch.autograd.grad(obj, leaves)
    mean_logit = _torch_impl.BACKEND.forward(p64, tau64)[1]
    return lse.detach(), mean_logit, grads


PRIMITIVE_CASES = [  # B, P, Q, d, dtype, cosine, exclude_own
    (33, 2, 27, 40, torch.float32, True, True),
    (20, 1, 70, 17, torch.bfloat16, True, False),
    (18, 3, 0, 40, torch.float16, True, True),
    (21, 2, 33, 19, torch.float32, False, False),
    (17, 1, 19, 24, torch.bfloat16, False, True),
    (4, 1, 2, 1024, torch.bfloat16, True, True),
]


@pytest.mark.parametrize(
    "B, P, Q, d, dtype, cosine, exclude_own",
    PRIMITIVE_CASES,
    ids=[
        f"B{c[0]}P{c[1]}Q{c[2]}d{c[3]}-{str(c[4])[6:]}-{'cos' if c[5] else 'dot'}-{'excl' if c[6] else 'all'}"
        for c in PRIMITIVE_CASES
    ],
)
def test_primitive_matches_oracle(B, P, Q, d, dtype, cosine, exclude_own):
    gen = torch.Generator().manual_seed(B * 1000 + d)
    problem = _problem(B, P, Q, d, dtype, cosine, gen, exclude_own)
    assert not TRITON.unsupported(problem)
    tau = torch.tensor(0.1 if cosine else 0.7)
    g = torch.randn(B, generator=gen)
    d_pos = torch.randn(B, P, generator=gen)
    pos_tags = problem.tags[0][problem.positives.rows(0, B)].view(B, P)
    d_pos[pos_tags == TAG_PADDING] = 0  # the head gives padded positives no gradient
    ref_lse, ref_ml, ref_grads = _oracle(problem, tau, g, d_pos)
    g = torch.where(torch.isfinite(ref_lse), g, 0.0)  # an empty row has no gradient
    with poison_outputs():
        lse, mean_logit = TRITON.forward(problem, tau)
        d_anchor, d_blocks = TRITON.backward(problem, tau, lse, g, d_pos)
    assert lse.dtype == mean_logit.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "empty rows must give -inf exactly"
    fin = torch.isfinite(ref_lse)
    terms, logits = _sizes(problem, tau)
    assert_close("lse", lse[fin], ref_lse[fin], dtype, terms=terms, magnitude=logits)
    assert_close("mean_logit", mean_logit, ref_ml, dtype, terms=terms, magnitude=logits)
    for name, got, want in zip(("d anchor", "d block0", "d block1"), (d_anchor, *d_blocks), ref_grads):
        assert got.dtype == dtype
        assert_close(name, got, want, dtype, terms=terms, logit_scale=logits)
    for blk, tags in zip(d_blocks, problem.tags):  # padding: exactly zero
        assert (blk[tags == TAG_PADDING] == 0).all()


@pytest.mark.parametrize("similarity", ["cos", "dot"])
def test_width_one_slices_of_transposed_inputs(similarity):
    """d = 1 (and one anchor): a slice of a transposed input is contiguous although its size-1
    dimension has a stride other than 1; the fused step's GEMMs must take it (hypothesis found
    the backward refusing it) and match the oracle."""
    gen = torch.Generator().manual_seed(5)
    for B, P, Q, d in [(1, 2, 0, 1), (3, 2, 2, 1), (1, 3, 1, 5)]:
        a = torch.randn(d, B, generator=gen).t().requires_grad_()
        pos = torch.randn(B, d, P, generator=gen).transpose(1, 2).requires_grad_()
        neg = torch.randn(B, d, Q, generator=gen).transpose(1, 2).requires_grad_()
        kw = dict(temperature=0.5, similarity=similarity)
        got = L.supmpn_loss(a, pos, neg, backend="triton", **kw)
        want = R.supmpn(a.double(), pos.double(), neg.double(), **kw)
        grads = [torch.autograd.grad(x, (a, pos, neg), materialize_grads=True) for x in (got, want)]
        # a logit's d, a row's candidates, a candidate's anchors; logits 1/tau, or |a| |c| / tau
        terms = d + B * (1 + P + Q) + B
        norm = max(t.detach().double().norm(dim=-1).max().item() for t in (a, pos, neg) if t.numel())
        logits = (1.0 if similarity == "cos" else norm**2) / kw["temperature"]
        assert_close("loss", got, want.float(), torch.float32, terms=terms, magnitude=logits)
        for name, g, w in zip(("a", "pos", "neg"), grads[0], grads[1]):
            if similarity == "cos" and d == 1:  # a unit scalar cannot turn: the gradient is 0 up to rounding
                # of terms of size d logit / d x = 1 / (tau |x|) (the smallest input), one per candidate
                size = 1 / (kw["temperature"] * min(t.abs().min().item() for t in (a, pos, neg) if t.numel()))
                assert (w.abs() <= roundoff(torch.float64, terms, size)).all(), name
                assert (g.abs() <= roundoff(torch.float32, terms, size)).all(), name
            else:  # a mean's gradient: one candidate per row cancels it exactly (B = 1, P = 2, Q = 0)
                term = grad_term_size((a, pos, neg), similarity=similarity, tau=kw["temperature"], row_weight=1 / B)
                bound = dict(terms=terms, magnitude=term * logits, logit_scale=logits)
                assert_close(name, g, w.float(), torch.float32, **bound)


def test_empty_problems():
    gen = torch.Generator().manual_seed(3)
    tau = torch.tensor(0.1)
    for B, n0, n1 in [(0, 4, 3), (3, 0, 0)]:
        a, c0, c1 = torch.randn(B, 8, generator=gen), torch.randn(n0, 8, generator=gen), torch.randn(n1, 8)
        tags = (torch.full((n0,), TAG_ALL, dtype=torch.int32), torch.full((n1,), TAG_ALL, dtype=torch.int32))
        problem = LSEProblem(a, (c0, c1), tags)
        with poison_outputs():
            lse, ml = TRITON.forward(problem, tau)
            da, (d0, d1) = TRITON.backward(problem, tau, lse, torch.ones(B))
        assert lse.shape == (B,) and (lse == float("-inf")).all() and (ml == 0).all()
        assert all((x == 0).all() for x in (da, d0, d1))


@pytest.mark.parametrize("mode", ["input", "fp32"])
def test_ds_precision_modes(mode):
    """Both dS precisions of bf16 (``input``: rounded to bf16, one MMA, the default for bf16;
    ``fp32``: two MMAs) stay within bf16 bounds."""
    from fastcl.kernels._common import recording

    gen = torch.Generator().manual_seed(5)
    a, p, n = (torch.randn(*s, generator=gen).bfloat16() for s in ((19, 24), (19, 2, 24), (19, 3, 24)))
    leaves = [x.clone().requires_grad_() for x in (a, p, n)]
    with config.override(triton={"ds": mode}), poison_outputs(), recording() as rec:
        L.supcon_loss(*leaves, temperature=0.1, backend="triton").backward()
    ds_out = {dict(x.signature)["DS"] for x in rec if x.kernel == "_lse_ds_kernel"}
    assert ds_out == ({"*fp32"} if mode == "fp32" else {"*bf16"})  # the mode took effect
    ref = [x.double().requires_grad_() for x in (a, p, n)]
    R.supcon(*ref, temperature=0.1).backward()
    # SupCon's rows: 19 anchors against 19 * (1 + 2 + 3) candidates of d = 24, logits 1/tau = 10;
    # "input" stores dS, the gradient's terms (a mean's row weight 1/19 times 2 / (tau |x|)),
    # in bf16: one rounding of each term (fastcl.testing's ``stored``)
    terms = loss_terms(19, 19 * 6, 24)
    term = grad_term_size(ref, similarity="cos", tau=0.1, row_weight=1 / 19)
    for x, y in zip(leaves, ref):
        assert_close("grad", x.grad, y.grad, torch.bfloat16, terms=terms, logit_scale=10.0, stored=term)


def test_ds_precision_default_and_choices(monkeypatch):
    """``auto`` (default): bf16 keeps dS in bf16, fp16 in fp32 (its range); ``fp32`` applies to
    both, ``input`` to bf16 only; set by ``fastcl.config`` (``FASTCL_TRITON_DS`` or
    ``config.override``); anything else is refused, naming the variable."""
    monkeypatch.delenv("FASTCL_TRITON_DS", raising=False)
    config.reload()
    assert _triton.ds_precision() == "auto"
    assert not _triton.fp32_ds(torch.bfloat16) and _triton.fp32_ds(torch.float16)
    with config.override(triton={"ds": "input"}):  # fp16 dS would be subnormal: fp16 keeps fp32
        assert not _triton.fp32_ds(torch.bfloat16) and _triton.fp32_ds(torch.float16)
    with config.override(triton={"ds": "fp32"}):
        assert _triton.fp32_ds(torch.bfloat16) and _triton.fp32_ds(torch.float16)
    monkeypatch.setenv("FASTCL_TRITON_DS", "bogus")
    try:
        with pytest.raises(ValueError, match="FASTCL_TRITON_DS"):
            config.reload()
    finally:
        monkeypatch.delenv("FASTCL_TRITON_DS")
        config.reload()


def _head_problem(dtype, cosine, gen):
    """Own positives anchor-major in block 0 after ``offset`` rows, masked positives holding
    NaN (never read), a clamped norm, rows near float32's overflow, a row holding NaN or Inf,
    an anchor without any valid positive; negatives in block 1."""
    B, P, d, offset = 19, 3, 70, 4
    anchor = torch.randn(B, d, generator=gen)
    block0 = torch.randn(offset + B * P + 2, d, generator=gen)
    block1 = torch.randn(23, d, generator=gen)
    own = block0[offset : offset + B * P].view(B, P, d)
    mask = torch.rand(B, P, generator=gen) > 0.2
    mask[:, 0] = True
    mask[8] = False  # an anchor without any valid positive: contributes nothing
    own[~mask] = float("nan")  # masked positives are never read
    own[1, 0] = 1e-10  # clamped norm
    if cosine and dtype in (torch.float32, torch.float64):
        anchor[2] *= 1e36  # squares would overflow float32 (dot products may: dot similarity)
        own[3, 1] *= 1e37
    anchor[5, 7] = float("nan")
    own[6, 0, 3] = float("inf")
    mask[5, 2] = False  # NaN anchor beside a masked positive
    owner = torch.arange(B, dtype=torch.int32).repeat_interleave(P)
    tags0 = torch.full((block0.shape[0],), TAG_ALL, dtype=torch.int32)
    tags0[offset : offset + B * P] = torch.where(mask.reshape(-1), owner, torch.full_like(owner, TAG_PADDING))
    tags1 = torch.full((block1.shape[0],), TAG_ALL, dtype=torch.int32)
    t = [x.to(dtype) for x in (anchor, block0, block1)]
    return LSEProblem(t[0], (t[1], t[2]), (tags0, tags1), cosine, 1e-8, OwnPositives(offset, P)), mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("cosine", [True, False])
@pytest.mark.parametrize("kind", ["softplus", "cross_entropy"])
def test_fused_head_matches_the_pytorch_head(dtype, cosine, kind):
    """``head_forward`` (combine + own logits + head in one kernel) against the primitive's
    ``lse`` and ``fastcl/ops/head.py`` on the PyTorch path's own-positive logits: the
    supmpn head's ``dpos = -sigmoid(r - l_k) / count`` checks every own logit on its own."""
    from fastcl.kernels import head_forward
    from fastcl.ops.head import head_rows
    from fastcl.ops.positive_logits import own_positive_similarities

    gen = torch.Generator().manual_seed(21)
    problem, mask = _head_problem(dtype, cosine, gen)
    (a, (c0, c1), (t0, t1)), pos = (problem.anchor, problem.blocks, problem.tags), problem.positives
    B, P = mask.shape
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    tau = torch.tensor(0.07, dtype=cd)
    weights = torch.rand(B, generator=gen, dtype=cd)
    with poison_outputs():
        rows, lse, dlse, dpos, w_row, _ = head_forward(
            a, c0, c1, t0, t1, tau, cosine, 1e-8, kind, pos.offset, P, None, mask, None, weights, True
        )
        loss, *_ = head_forward(
            a, c0, c1, t0, t1, tau, cosine, 1e-8, kind, pos.offset, P, None, mask, None, weights, False
        )
        want_lse, mean = TRITON.forward(problem, tau)
    own = c0[pos.offset : pos.offset + B * P].view(B, P, -1)
    l_pos = own_positive_similarities(a, own, cosine, 1e-8, mask) / tau
    want_rows, want_dlse, want_dpos = head_rows(want_lse, l_pos, mask, kind)
    assert torch.equal(lse.isnan(), want_lse.isnan()) and torch.equal(lse.isinf(), want_lse.isinf())
    fin = torch.isfinite(want_lse)
    terms, logits = _sizes(problem, tau)
    assert_close("lse", lse[fin], want_lse[fin], dtype, terms=terms, magnitude=logits)
    # rows: losses (absolute error of the logits' size); dlse, dpos: the head's weights (<= 1),
    # relative error of the logits' size
    for name, got, want in (("rows", rows, want_rows), ("dlse", dlse, want_dlse), ("dpos", dpos, want_dpos)):
        assert got.dtype == cd and torch.equal(got.isnan(), want.isnan()), name
        ok = ~want.isnan()
        kw = dict(magnitude=logits) if name == "rows" else dict(logit_scale=logits)
        assert_close(name, got[ok], want[ok], dtype, terms=terms, **kw)
    assert rows[8] == 0 and (dpos[8] == 0).all() and dlse[8] == 0  # no valid positive: nothing
    assert rows[5].isnan() and rows[6].isnan()  # a NaN anchor, an Inf positive
    want_w = want_dlse * mean + (want_dpos * torch.where(mask, l_pos, 0.0)).sum(1)
    ok = ~want_w.isnan()
    # w_row: weights (<= 1, relative error eps * logits) times logits (absolute error eps * logits)
    assert_close("w_row", w_row[ok], want_w[ok], dtype, terms=terms + P, magnitude=logits * (1 + logits))
    assert loss.dtype == dtype and loss.isnan()  # the NaN rows reach the reduced loss
    keep = ~want_rows.isnan()
    with poison_outputs():
        w2 = torch.where(keep, weights, 0.0)
        loss2, *_ = head_forward(a, c0, c1, t0, t1, tau, cosine, 1e-8, kind, pos.offset, P, None, mask, None, w2, False)
    # weight 0 on the NaN rows does not hide them (NaN * 0): zero them out of the batch instead
    assert loss2.isnan()


def test_fused_head_refuses_a_layout_that_does_not_fit():
    from fastcl.kernels import head_forward

    a, c0, c1 = torch.randn(4, 8), torch.randn(10, 8), torch.randn(0, 8)
    t0, t1 = torch.full((10,), TAG_ALL, dtype=torch.int32), torch.empty(0, dtype=torch.int32)
    w = torch.full((4,), 0.25)
    with pytest.raises(ValueError, match="do not fit"):
        head_forward(a, c0, c1, t0, t1, torch.tensor(0.1), True, 1e-8, "softplus", 3, 2, None, None, None, w, False)


def test_loss_step_takes_the_fused_head(monkeypatch):
    """A loss on ``triton`` forms the own-positive logits and the head in the kernels: neither
    the PyTorch own logits nor the PyTorch head run, forward or backward."""
    from fastcl.ops import contrastive

    def forbidden(*a, **k):
        raise AssertionError("the PyTorch head ran")

    monkeypatch.setattr(contrastive, "own_positive_similarities", forbidden)
    monkeypatch.setattr(contrastive, "head_rows", forbidden)
    gen = torch.Generator().manual_seed(5)
    a, p, n = (
        torch.randn(6, 16, generator=gen),
        torch.randn(6, 3, 16, generator=gen),
        torch.randn(6, 2, 16, generator=gen),
    )
    tau = torch.tensor(0.1, requires_grad=True)
    a.requires_grad_(True)
    loss = L.supmpn_loss(a, p, n, temperature=tau, backend="triton")
    loss.backward()
    monkeypatch.undo()  # the reference runs the PyTorch head
    a64, tau64 = a.detach().double().requires_grad_(), tau.detach().double().requires_grad_()
    want = L.supmpn_loss(a64, p.double(), n.double(), temperature=tau64, backend="reference")
    want.backward()
    # 6 anchors against 6 * (3 + 2) candidates of d = 16, logits 1/tau = 10; d tau: a mean's
    # rows' logit differences times 1/tau, terms of size 1/tau^2
    terms = loss_terms(6, 30, 16)
    assert_close("loss", loss.double(), want, torch.float32, terms=terms, magnitude=10.0)
    assert_close("d anchor", a.grad.double(), a64.grad, torch.float32, terms=terms, logit_scale=10.0)
    assert_close("d tau", tau.grad.double(), tau64.grad, torch.float32, terms=terms, magnitude=100.0)


# ---------------------------------------------------------------------------------------
# registration and specialisations
# ---------------------------------------------------------------------------------------


def test_custom_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(7)
    a, c0, c1 = (torch.randn(n, 20, generator=gen).bfloat16() for n in (5, 10, 3))
    t0 = torch.arange(5, dtype=torch.int32).repeat_interleave(2)
    t1 = torch.full((3,), TAG_ALL, dtype=torch.int32)
    tau = torch.tensor(0.1)
    lse, _ = torch.ops.fastcl_triton.lse_forward(a, c0, c1, t0, t1, tau, True, 1e-8)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(
        torch.ops.fastcl_triton.lse_forward.default, (a, c0, c1, t0, t1, tau, True, 1e-8), test_utils=checks
    )
    torch.library.opcheck(
        torch.ops.fastcl_triton.lse_backward.default,
        (a, c0, c1, t0, t1, tau, lse, torch.ones(5), torch.ones(5, 2), True, 1e-8, True),
        test_utils=checks,
    )
    mask = torch.tensor([[True, False]] * 5)
    w = torch.full((5,), 0.2)
    args = (a, c0, c1, t0, t1, tau, True, 1e-8, "softplus", 0, 2, None, mask, None, w, False)
    torch.library.opcheck(torch.ops.fastcl_triton.head_forward.default, args, test_utils=checks)
    _, lse, dlse, dpos, w_row, norms = torch.ops.fastcl_triton.head_forward(*args)
    args = (
        a,
        c0,
        c1,
        t0,
        t1,
        tau,
        norms,
        lse,
        dlse,
        dpos,
        w_row,
        w,
        torch.tensor(1.0).bfloat16(),
        0,
        True,
        True,
        False,
        True,
    )
    torch.library.opcheck(torch.ops.fastcl_triton.head_backward.default, args, test_utils=checks)


def test_every_real_launch_is_in_the_aot_list():
    """Launches recorded from real (interpreted) runs of the backend are all in the list the
    AOT test compiles (recorded from dry runs of the same launchers)."""
    gen = torch.Generator().manual_seed(11)
    with _common.recording() as launched:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for cosine in (True, False):
                problem = _problem(5, 2, 36, 12, dtype, cosine, gen)  # several chunks, with and without positives
                lse, _ = TRITON.forward(problem, torch.tensor(0.2))
                TRITON.backward(problem, torch.tensor(0.2), lse, torch.ones(5), torch.ones(5, 2))
                head = HeadInputs("softplus", None, None, None, torch.full((5,), 0.2))
                loss, saved = TRITON.head_step.forward(problem, torch.tensor(0.2), head, per_row=False)
                TRITON.head_step.backward(problem, torch.tensor(0.2), saved, head.weights, torch.ones((), dtype=dtype))
    launched = {x.key for x in launched}
    known = {x.key for x in aot.dry_runs("interp")}
    assert launched and launched <= known, sorted(launched - known)


def test_torch_compile_traces_the_ops():
    """``torch.compile`` (eager backend, whole graph) traces through the registered ops."""
    gen = torch.Generator().manual_seed(13)
    a, c0 = torch.randn(4, 8, generator=gen), torch.randn(6, 8, generator=gen)
    t0 = torch.full((6,), TAG_ALL, dtype=torch.int32)
    c1, t1 = torch.empty(0, 8), torch.empty(0, dtype=torch.int32)
    tau = torch.tensor(0.5)

    def f(a, c0):
        lse, _ = torch.ops.fastcl_triton.lse_forward(a, c0, c1, t0, t1, tau, True, 1e-8)
        return lse.sum()

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(a, c0), f(a, c0))
