"""The Triton kernels on CPU tensors through the Triton interpreter.

Run in its own process, with the backend matrix::

    TRITON_INTERPRET=1 FASTCL_TEST_BACKENDS=triton FASTCL_TEST_SMALL=1 \\
        pytest tests/ops/test_backend_matrix.py tests/kernels/test_triton_interpret.py

(skipped without ``TRITON_INTERPRET=1``: the interpreter must be on before the kernels are
imported). The matrix covers the losses end to end on small shapes; this file covers what
it cannot reach cheaply: the primitive on shapes that cross every tile, split and chunk
edge of the launchers (interpreter tiles are 16 wide, chunks 32), the own-positive fold,
``d = 1024``, the structural-mask rule against ``contract.excluded``,
both ``FASTCL_TRITON_DS`` modes, the custom-op registration, and that every launch is in the AOT list.
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
from fastcl import reference as R  # noqa: E402
from fastcl.kernels import _common, aot  # noqa: E402
from fastcl.ops import _torch_impl, _triton  # noqa: E402
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, OwnPositives, excluded, poison_outputs  # noqa: E402
from fastcl.testing import assert_close  # noqa: E402

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
    assert_close("lse", lse[fin], ref_lse[fin], dtype)
    assert_close("mean_logit", mean_logit, ref_ml, dtype)
    for name, got, want in zip(("d anchor", "d block0", "d block1"), (d_anchor, *d_blocks), ref_grads):
        assert got.dtype == dtype
        assert_close(name, got, want, dtype)
    for blk, tags in zip(d_blocks, problem.tags):  # padding: exactly zero
        assert (blk[tags == TAG_PADDING] == 0).all()


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
def test_ds_precision_modes(monkeypatch, mode):
    """Both dS precisions of bf16 (``input``: rounded to bf16, one MMA, the default for bf16;
    ``fp32``: two MMAs) stay within bf16 bounds."""
    monkeypatch.setenv(_triton.DS_ENV, mode)
    gen = torch.Generator().manual_seed(5)
    a, p, n = (torch.randn(*s, generator=gen).bfloat16() for s in ((19, 24), (19, 2, 24), (19, 3, 24)))
    leaves = [x.clone().requires_grad_() for x in (a, p, n)]
    with poison_outputs():
        L.supcon_loss(*leaves, temperature=0.1, backend="triton").backward()
    ref = [x.double().requires_grad_() for x in (a, p, n)]
    R.supcon(*ref, temperature=0.1).backward()
    for x, y in zip(leaves, ref):
        assert_close("grad", x.grad, y.grad, torch.bfloat16)


def test_ds_precision_default_and_choices(monkeypatch):
    """``auto`` (default): bf16 keeps dS in bf16, fp16 in fp32 (its range); the explicit modes
    apply to both; anything else is refused."""
    monkeypatch.delenv(_triton.DS_ENV, raising=False)
    assert _triton.ds_precision() == "auto"
    assert not _triton.fp32_ds(torch.bfloat16) and _triton.fp32_ds(torch.float16)
    monkeypatch.setenv(_triton.DS_ENV, "input")
    assert not _triton.fp32_ds(torch.bfloat16) and not _triton.fp32_ds(torch.float16)
    monkeypatch.setenv(_triton.DS_ENV, "fp32")
    assert _triton.fp32_ds(torch.bfloat16) and _triton.fp32_ds(torch.float16)
    monkeypatch.setenv(_triton.DS_ENV, "bogus")
    with pytest.raises(ValueError, match="FASTCL_TRITON_DS"):
        _triton.ds_precision()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("cosine", [True, False])
def test_own_logits_match_the_pytorch_path(dtype, cosine):
    """``kernels/own_logits.py`` against ``own_positive_similarities / tau`` (the path it
    replaces) and the float64 oracle, on rows that cross ``BD`` and ``BR``, with a masked
    positive holding NaN (no influence), a clamped norm, rows near float32's overflow, and a
    row holding NaN or Inf (its logits NaN, also beside a masked positive)."""
    from fastcl.ops.positive_logits import own_positive_similarities

    gen = torch.Generator().manual_seed(21)
    B, P, d, offset = 19, 3, 70, 4
    anchor = torch.randn(B, d, generator=gen)
    block0 = torch.randn(offset + B * P + 2, d, generator=gen)
    own = block0[offset : offset + B * P].view(B, P, d)
    mask = torch.rand(B, P, generator=gen) > 0.2
    mask[:, 0] = True
    mask[8] = False  # an anchor without any valid positive: every logit 0
    own[~mask] = float("nan")  # masked positives are never read
    own[1, 0] = 1e-10  # clamped norm
    if cosine and dtype in (torch.float32, torch.float64):
        anchor[2] *= 1e36  # squares would overflow float32 (dot products may: dot similarity)
        own[3, 1] *= 1e37
    anchor[5, 7] = float("nan")
    own[6, 0, 3] = float("inf")
    mask[5, 2] = False  # NaN anchor beside a masked positive: NaN, as 0 * NaN in PyTorch
    a, c0 = anchor.to(dtype), block0.to(dtype)
    tau = torch.tensor(0.07)
    got = torch.ops.fastcl_triton.own_logits(a, c0, mask, tau, offset, P, cosine, 1e-8)
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    assert got.dtype == cd and got.shape == (B, P)
    want = own_positive_similarities(a, c0[offset : offset + B * P].view(B, P, d), cosine, 1e-8, mask) / tau.to(cd)
    assert torch.equal(got.isnan(), want.isnan())
    assert got[5].isnan().all() and got[6, 0].isnan()
    assert torch.equal(got[8], torch.zeros(P, dtype=cd))
    fin = ~want.isnan()
    assert_close("own logits vs the PyTorch path", got[fin], want[fin], cd, abs_scale=1 / 0.07)
    # and the float64 oracle on the inputs as given (rounded to dtype)
    a64, o64 = a.double(), c0[offset : offset + B * P].view(B, P, d).double().masked_fill(~mask[..., None], 0)
    if cosine:
        a64 = a64 / a64.norm(dim=-1, keepdim=True).clamp_min(1e-8)
        o64 = o64 / o64.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    oracle = (o64 * a64[:, None]).sum(-1) / float(tau)  # tau as stored (float32)
    assert_close("own logits vs float64", got[fin].double(), oracle[fin], dtype, abs_scale=1 / 0.07)


def test_own_logits_refuses_a_layout_that_does_not_fit():
    a, c0 = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="do not fit"):
        torch.ops.fastcl_triton.own_logits(a, c0, None, torch.tensor(0.1), 3, 2, True, 1e-8)


def test_recompute_forward_takes_the_own_logits_kernel(monkeypatch):
    """The loss's forward forms the own-positive logits with the kernel, not the PyTorch ops."""
    from fastcl.ops import positive_logits

    calls = []
    real = positive_logits.own_positive_similarities
    monkeypatch.setattr(
        "fastcl.ops.contrastive.own_positive_similarities",
        lambda *a, **k: calls.append(1) or real(*a, **k),
    )
    gen = torch.Generator().manual_seed(5)
    a, p, n = (
        torch.randn(6, 16, generator=gen),
        torch.randn(6, 3, 16, generator=gen),
        torch.randn(6, 2, 16, generator=gen),
    )
    a.requires_grad_(True)
    loss = L.supmpn_loss(a, p, n, backend="triton")
    loss.backward()
    assert not calls
    want = L.supmpn_loss(a.detach().double(), p.double(), n.double(), backend="reference")
    assert_close("loss", loss.double(), want, torch.float32, abs_scale=20.0)


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
        (a, c0, c1, t0, t1, tau, lse, torch.ones(5), torch.ones(5, 2), 0, True, 1e-8, True),
        test_utils=checks,
    )
    mask = torch.tensor([[True, False]] * 5)
    torch.library.opcheck(
        torch.ops.fastcl_triton.own_logits.default, (a, c0, mask, tau, 0, 2, True, 1e-8), test_utils=checks
    )


def test_every_real_launch_is_in_the_aot_list():
    """Launches recorded from real (interpreted) runs of the backend are all in the list the
    AOT test compiles (recorded from dry runs of the same launchers)."""
    gen = torch.Generator().manual_seed(11)
    with _common.recording() as launched:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for cosine in (True, False):
                problem = _problem(5, 2, 36, 12, dtype, cosine, gen)  # several chunks, with and without positives
                lse, _ = TRITON.forward(problem, torch.tensor(0.2))
                TRITON.own_logits(problem, None, torch.tensor(0.2))
                TRITON.backward(problem, torch.tensor(0.2), lse, torch.ones(5), torch.ones(5, 2))
    launched = {x.key for x in launched}
    known = {x.key for x in aot.all_launches()}
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
