"""The primitive's extensions on the Triton kernels, in the interpreter: what the shared suite
(``tests/ops/test_extensions.py``, float32 on small shapes) does not reach.

* the sigmoid reduction's partial row sums of several forward splits (no logaddexp merge) and
  rows with no candidate at all;
* shapes that cross the launchers' edges with the configured interpreter block sizes (tiles
  16 wide, ``d`` and the guide width off the feature steps, dS chunks of 32 columns, three
  splits), plain and Matryoshka;
* degenerate shapes (no anchors, no candidates) and a NaN anchor row under a filter;
* 16-bit inputs (bf16, fp16) beside an fp32 or a 16-bit guide, against the float64 oracle on
  the same (rounded) inputs;
* the fused head step with a filter (the GIST losses' path): it is taken, matches the
  reference, a NaN in a column a row drops reaches neither that row's loss nor its gradient;
* every launch the extensions make is in the AOT compile list;
* the public losses on them (CLIP, SigLIP, GIST) against the reference; CLIP's column
  statistics are refused by the Triton backend, so CLIP runs its two directions.

Runs in the Triton interpreter suite (``tests/kernels/test_triton_suite.py``).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter suite runs with TRITON_INTERPRET=1 in its own process", allow_module_level=True)
pytest.importorskip("triton")

from benchmarks.triton_tools import aot  # noqa: E402
from fastcl.kernels import _common, plan  # noqa: E402
from fastcl.ops import _triton, contrastive  # noqa: E402
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, Filter, LSEProblem, OwnPositives, Sigmoid, poison_outputs  # noqa: E402
from fastcl.testing import assert_close, loss_terms  # noqa: E402
from tests.ops.test_extensions import (  # noqa: E402
    Case,
    _check_backward,
    _check_forward,
    _compare,
    make_case,
    oracle,
    oracle_grads,
)

TRITON = _triton.BACKEND
CPU = torch.device("cpu")


def _rounded(case: Case, dtype: torch.dtype) -> Case:
    """The case on inputs rounded to ``dtype`` (the oracle then sees the kernels' inputs)."""
    r = lambda t: t.to(dtype).float()  # noqa: E731
    case.anchor, case.blocks = r(case.anchor), (r(case.blocks[0]), r(case.blocks[1]))
    return case


def _fwd_launches(fn) -> list:
    with _common.recording() as launched:
        fn()
    return [x for x in launched if x.kernel == "_lse_fwd_kernel"]  # plain and Matryoshka


@pytest.mark.parametrize("filt", [None, "self"])
def test_sigmoid_sums_of_several_splits(filt):
    """Many column tiles: the forward runs three splits whose partial row sums the combine adds
    (an LSE-style merge would be wrong for them); values, statistics and gradients."""
    case = make_case(9, 70, 40, 20, seed=5, reduce="sigmoid", filt=filt, dev=CPU)
    fwd = _fwd_launches(lambda: TRITON.forward(case.problem(), torch.tensor(case.tau)))
    assert fwd and fwd[0].grid[1] == plan.INTERP_SPLITS, [x.grid for x in fwd]
    _check_forward(TRITON, case)
    _check_backward(TRITON, case, 5)


def test_sigmoid_rows_without_candidates():
    """No candidate at all (value 0, statistics 0, gradients 0), and rows whose candidates all
    leave them (tags): the same, beside rows that have some."""
    a = torch.randn(4, 8)
    empty = LSEProblem(a, (a[:0], a[:0]), (torch.empty(0, dtype=torch.int32),) * 2)
    prob = LSEProblem(empty.anchor, empty.blocks, empty.tags, sigmoid=Sigmoid(torch.tensor(0.5)))
    with poison_outputs():
        v, stats = TRITON.forward(prob, torch.tensor(0.2))
    assert v.shape == (4,) and stats.shape == (2, 4) and (v == 0).all() and (stats == 0).all()
    case = make_case(5, 12, 3, 8, seed=3, reduce="sigmoid", positives=False, dev=CPU)
    case.tags = (torch.zeros(12, dtype=torch.int32), torch.full((3,), TAG_PADDING, dtype=torch.int32))
    v, _ = TRITON.forward(case.problem(), torch.tensor(case.tau))
    assert v[0] == 0 and (v[1:] > 0).all()  # row 0 leaves every block-0 candidate (tag 0)
    _check_forward(TRITON, case)
    _check_backward(TRITON, case, 3)


EDGES = [  # (B, N0, N1, d, guide width): tiles 16, feature steps 32 (guide: 32, fp32 16), chunks 32
    (37, 80, 45, 70, 40),
    (17, 34, 33, 33, 17),
]


@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
@pytest.mark.parametrize("filt", [None, "guide", "self"])
@pytest.mark.parametrize("shape", EDGES, ids=lambda s: "x".join(map(str, s)))
def test_tile_edges(shape, filt, reduce):
    if filt is None and reduce == "lse":
        pytest.skip("the plain LSE: tests/kernels/test_triton_interpret.py")
    B, N0, N1, d, g = shape
    case = make_case(B, N0, N1, d, seed=B + d, reduce=reduce, filt=filt, gdim=g, dev=CPU)
    _check_forward(TRITON, case)
    _check_backward(TRITON, case, B)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("guide_dtype", [torch.float32, "model"])
@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
def test_16_bit_inputs(dtype, guide_dtype, reduce):
    """16-bit inputs beside an fp32 guide (GIST's frozen guide model) or one of their own dtype;
    cosine and dot; a self filter in dot mode. The oracle runs on the rounded inputs."""
    for cosine, filt in ((True, "guide"), (False, "guide"), (False, "self")):
        if filt == "self" and guide_dtype != "model":
            continue
        case = _rounded(make_case(13, 30, 11, 40, seed=8, reduce=reduce, filt=filt, cosine=cosine, dev=CPU), dtype)
        if case.guide is not None and guide_dtype == "model":
            case.guide = tuple(t.to(dtype) for t in case.guide)  # type: ignore[assignment]
        _check_forward(TRITON, case, dtype)
        _check_backward(TRITON, case, 8, dtype)


@pytest.mark.parametrize("filt", ["guide", "self"])
@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
def test_matryoshka_edges_16_bit(filt, reduce):
    """Prefixes off the tile edges on bf16 inputs, a per-prefix self threshold (odd seed)."""
    case = _rounded(
        make_case(19, 40, 21, 45, seed=5, reduce=reduce, filt=filt, dims=(45, 7, 33), dev=CPU), torch.bfloat16
    )
    _check_forward(TRITON, case, torch.bfloat16)
    _check_backward(TRITON, case, 5, torch.bfloat16)


@pytest.mark.parametrize("B, N0, N1", [(0, 5, 3), (4, 0, 0), (1, 1, 0)])
@pytest.mark.parametrize("reduce, filt", [("sigmoid", "guide"), ("lse", "self")])
def test_degenerate_shapes(B, N0, N1, reduce, filt):
    """No anchors, no candidates, one of each: empty rows give the sigmoid 0 and the LSE -inf,
    and no gradient (outputs poisoned)."""
    g = torch.Generator().manual_seed(B + N0 + N1)
    d = 6
    blocks = (torch.randn(N0, d, generator=g), torch.randn(N1, d, generator=g))
    tags = (torch.full((N0,), TAG_ALL, dtype=torch.int32), torch.full((N1,), TAG_ALL, dtype=torch.int32))
    case = Case(torch.randn(B, d, generator=g), blocks, tags, 0.3, True, None)
    case.bias = -1.0 if reduce == "sigmoid" else None
    case.threshold = torch.full((B,), 0.2)
    if filt == "guide":
        case.guide = (torch.randn(B, 3, generator=g), torch.randn(N0, 3, generator=g), torch.randn(N1, 3, generator=g))
    _check_forward(TRITON, case)
    _check_backward(TRITON, case, 1)
    if N0 + N1 == 0:
        value = TRITON.forward(case.problem(), torch.tensor(case.tau))[0]
        assert (value == (0 if reduce == "sigmoid" else -math.inf)).all()


@pytest.mark.parametrize("reduce", ["lse", "sigmoid"])
def test_nan_anchor_row_under_a_filter(reduce):
    """Anchor 2 holds a NaN and the guide drops candidate 6 from its row only: row 2 is NaN, its
    NaN reaches the gradient of a candidate it keeps but not of candidate 6 (a weight of 0 by
    selection, not 0 * NaN); the other rows are those of the oracle (the LSE) or of the torch
    backend in float64 (the sigmoid: the oracle forms softplus(NaN) before selecting)."""
    from dataclasses import replace

    from fastcl.ops._torch_impl import TorchLSE

    case = make_case(4, 10, 3, 6, seed=3, reduce=reduce, filt="guide", dev=CPU)
    case.positives = OwnPositives(0, 1)
    case.tags = (torch.full((10,), TAG_ALL, dtype=torch.int32), torch.full((3,), TAG_PADDING, dtype=torch.int32))
    case.anchor = case.anchor.clone()
    case.anchor[2, 1] = math.nan
    ga, g0, g1 = case.guide  # type: ignore[misc]
    g0 = g0.clone()
    g0[6] = ga[2] * 4 + 0.01 * g0[6]  # next to anchor 2 in the guide's space, and dropped there
    case.guide = (ga, g0, g1)
    case.threshold = torch.tensor([0.999, 0.999, 0.9, 0.999])
    prob, tau = case.problem(), torch.tensor(case.tau)
    w = torch.rand(4, generator=torch.Generator().manual_seed(0))
    with poison_outputs():
        value = TRITON.forward(prob, tau)[0]
        d_a, d_b = TRITON.backward(prob, tau, value, w, None)
    assert torch.isnan(value[2]) and torch.isfinite(value[[0, 1, 3]]).all()
    assert torch.isfinite(d_b[0][6]).all(), "no NaN reaches the candidate the NaN row drops"
    assert torch.isnan(d_b[0][5]).any(), "the NaN row's NaN reaches a candidate it keeps"
    assert (d_b[1] == 0).all(), "padding gets exactly zero"
    assert torch.isfinite(d_a[[0, 1, 3]]).all()
    _compare("value", value, oracle(case)[0], case=case)
    if reduce == "lse":
        want = oracle_grads(case, w.double(), None)
    else:
        f = prob.filter
        assert f is not None and prob.sigmoid is not None
        p64 = replace(
            prob, anchor=prob.anchor.double(), blocks=tuple(b.double() for b in prob.blocks),
            filter=Filter(f.threshold.double(), f.guide_anchor, f.guide_blocks), sigmoid=Sigmoid(prob.sigmoid.bias.double()),
        )  # fmt: skip
        want_a, want_b = TorchLSE().backward(p64, tau.double(), value.double(), w.double(), None)
        want = [want_a, *want_b]
    _compare("d block0 row 6", d_b[0][6], want[1][6], case=case)
    _compare("d anchor rows 0, 1, 3", d_a[[0, 1, 3]], want[0][[0, 1, 3]], case=case)


# ---------------------------------------------------------------------------------------
# the fused head step with a filter
# ---------------------------------------------------------------------------------------


def _gist_inputs(seed: int, nan_column: bool):
    """A SupMPN-like layout (P own positives per anchor at the start of block 0, negatives in
    block 1) with a guide that puts block-0 row ``B * P`` next to anchor 0 (a duplicate: the
    guide drops it from row 0 only); optionally that row holds a NaN."""
    g = torch.Generator().manual_seed(seed)
    B, P, Q, d, gd = 6, 2, 3, 24, 10
    anchor = torch.randn(B, d, generator=g)
    block0 = torch.randn(B * P + 4, d, generator=g)
    block1 = torch.randn(B * Q, d, generator=g)
    ga, g0, g1 = (
        torch.randn(B, gd, generator=g),
        torch.randn(B * P + 4, gd, generator=g),
        torch.randn(B * Q, gd, generator=g),
    )
    g0[: B * P] = ga.repeat_interleave(P, 0) + 0.1 * g0[: B * P]  # own positives: close to their anchors
    g0[B * P] = ga[0] * 2  # a false negative of anchor 0
    if nan_column:
        block0[B * P, 5] = math.nan
    owner = torch.arange(B, dtype=torch.int32).repeat_interleave(P)
    tags = (
        torch.cat([owner, torch.full((4,), TAG_ALL, dtype=torch.int32)]),
        torch.full((B * Q,), TAG_ALL, dtype=torch.int32),
    )
    # GIST's absolute margin: leave out what the guide finds closer than the own positive, less 0.1
    pos_sim = torch.nn.functional.cosine_similarity(ga, g0[: B * P : P], dim=-1)
    flt = Filter((pos_sim - 0.1).float(), ga, (g0, g1))
    return anchor, (block0, block1), tags, OwnPositives(0, P), flt


def _gist_loss(backend, anchor, blocks, tags, pos, flt, tau, reduction="mean"):
    B = anchor.shape[0]
    spec = contrastive.LossSpec(
        "softplus", tags, reduction, torch.full((B,), 1.0 / B, dtype=tau.dtype), cosine=True, eps=1e-8,
        positives=pos, strategy="recompute", filter=flt, backend=backend,
    )  # fmt: skip
    return contrastive.contrastive_loss(anchor, blocks, tau, spec)


T = 0.1  # the GIST step's temperature: its logits, the loss's terms, are of size 1 / T
# the GIST rows: 6 anchors against 6 * 2 + 4 and 6 * 3 candidates of d = 24 (_gist_inputs)
GIST_TERMS = loss_terms(6, 6 * 2 + 4 + 6 * 3, 24)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("nan_column", [False, True])
def test_head_step_with_a_filter(reduction, nan_column):
    anchor, blocks, tags, pos, flt = _gist_inputs(4, nan_column)
    assert TRITON.head_step.takes(LSEProblem(anchor, blocks, tags, positives=pos, filter=flt), _head(), 2)
    a = anchor.clone().requires_grad_()
    b0, b1 = (b.clone().requires_grad_() for b in blocks)
    tau = torch.tensor(T, requires_grad=True)
    with _common.recording() as launched, poison_outputs():
        loss = _gist_loss("triton", a, (b0, b1), tags, pos, flt, tau, reduction)
        loss.sum().backward()
    heads = [x for x in launched if x.kernel == "_head_kernel"]
    assert heads and dict(heads[0].constexprs)["POISONED"], "the fused head step did not run with the filter"
    a64, c0, c1 = (t.detach().double().requires_grad_() for t in (anchor, *blocks))
    tau64 = tau.detach().double().requires_grad_()
    f64 = Filter(flt.threshold.double(), flt.guide_anchor, flt.guide_blocks)
    want = _gist_loss("reference", a64, (c0, c1), tags, pos, f64, tau64, reduction)
    want.sum().backward()
    if nan_column:  # block-0 row B * P is dropped by anchor 0 only: row 0 stays finite
        rows = loss if reduction == "none" else None
        if rows is not None:
            assert torch.isfinite(rows[0]) and rows[1:].isnan().all()
        assert torch.isfinite(a.grad[0]).all() and torch.isnan(a.grad[1:]).all()
        assert torch.equal(a.grad.isnan(), a64.grad.isnan())
        ok = torch.isfinite(a64.grad)
        kw = dict(terms=GIST_TERMS, logit_scale=1 / T)
        assert_close("d anchor row 0", a.grad[ok].double(), a64.grad[ok], torch.float32, **kw)
        if rows is not None:
            assert_close("loss row 0", rows[0].double(), want[0], torch.float32, terms=GIST_TERMS, magnitude=1 / T)
        return
    assert_close("loss", loss.double(), want, torch.float32, terms=GIST_TERMS, magnitude=1 / T)
    for name, got, ref in (("d anchor", a, a64), ("d block0", b0, c0), ("d block1", b1, c1)):
        assert_close(name, got.grad.double(), ref.grad, torch.float32, terms=GIST_TERMS, logit_scale=1 / T)
    # dl/dtau = -l / tau: the rows' (weight 1 for a mean, B for the sum of "none") logit
    # differences times 1/tau, terms of size 1/tau^2
    weight = 1.0 if reduction == "mean" else 6.0
    assert_close("d tau", tau.grad.double(), tau64.grad, torch.float32, terms=GIST_TERMS, magnitude=weight / T**2)
    # the filter changed the loss (the guide drops the false negative from row 0)
    plain = _gist_loss(
        "reference", a64.detach(), (c0.detach(), c1.detach()), tags, pos, None, tau64.detach(), reduction
    )
    assert not torch.allclose(plain, want.detach())


def _head():
    from fastcl.ops.head import HeadInputs

    return HeadInputs("softplus", None, None, None, torch.full((6,), 1 / 6))


def test_the_plain_step_is_unchanged():
    """The plain path makes the launches it made before the extensions (no clean pass, no
    poison, the plain configs): a SupMPN-like step without a filter."""
    anchor, blocks, tags, pos, _ = _gist_inputs(4, False)
    a = anchor.clone().requires_grad_()
    with _common.recording() as launched:
        _gist_loss("triton", a, blocks, tags, pos, None, torch.tensor(0.1)).backward()
    kernels = [x.kernel for x in launched]
    assert kernels.count("_row_norms_kernel") == 1 and kernels.count("_head_kernel") == 1
    for x in launched:
        flags = dict(x.constexprs)
        assert not flags.get("FILTER") and not flags.get("SIGMOID") and not flags.get("CLEAN"), x.describe()
        assert not flags.get("POISONED"), x.describe()


# ---------------------------------------------------------------------------------------
# the AOT list
# ---------------------------------------------------------------------------------------


def test_every_extension_launch_is_in_the_aot_list():
    """Launches recorded from real runs of every extension (plain and Matryoshka, forward and
    backward, the head step with a filter) are all in the list the AOT test compiles."""
    with _common.recording() as launched:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for reduce, filt in (("sigmoid", None), ("sigmoid", "guide"), ("lse", "self"), ("lse", "guide")):
                for dims in (None, (8, 3)):
                    case = make_case(5, 36, 12, 8, seed=2, reduce=reduce, filt=filt, dims=dims, gdim=8, dev=CPU)
                    prob, tau = case.problem(dtype), torch.tensor(case.tau)
                    value, _ = TRITON.forward(prob, tau)
                    K = 1 if dims is None else len(dims)
                    g = torch.ones(K, 5) if dims else torch.ones(5)
                    d_pos = None
                    if reduce == "lse" and case.positives is not None:
                        d_pos = torch.ones(*((K,) if dims else ()), 5, case.positives.count)
                    TRITON.backward(prob, tau, value, g, d_pos)
            anchor, blocks, tags, pos, flt = _gist_inputs(1, False)
            _gist_loss("triton", anchor.to(dtype).requires_grad_(), tuple(b.to(dtype) for b in blocks), tags, pos,
                       flt, torch.tensor(0.1)).backward()  # fmt: skip
    launched = {x.key for x in launched}
    known = {x.key for x in aot.dry_runs("interp")}
    assert launched and launched <= known, sorted(launched - known)


# ---------------------------------------------------------------------------------------
# the losses on the extensions
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["clip", "siglip", "gist"])
def test_losses_equal_the_reference(loss):
    """The public losses with ``backend="triton"`` (19 pairs: past a 16-row tile) equal the
    reference in float64, values and gradients. CLIP: the Triton kernels compute no column
    statistics, so the symmetric step is refused and the two directional calls run instead."""
    import fastcl.losses as L
    from fastcl.ops import dispatch, symmetric

    g = torch.Generator().manual_seed(7)
    B, d = 19, 9
    img, txt = torch.randn(B, d, generator=g, dtype=torch.float64), torch.randn(B, d, generator=g, dtype=torch.float64)
    txt = txt + 0.5 * img  # pairs that agree, as after some training
    ga = torch.randn(B, 5, generator=g, dtype=torch.float64)
    guide = (ga, ga + 0.3 * torch.randn(B, 5, generator=g, dtype=torch.float64))  # a positive near its anchor
    scale = torch.tensor(6.0, dtype=torch.float64)
    calls = {
        "clip": lambda x, y, t, backend: L.clip_loss(x, y, t, backend=backend),
        "siglip": lambda x, y, t, backend: L.siglip_loss(x, y, t, -2.0, backend=backend),
        "gist": lambda x, y, t, backend: L.gist_loss(x, y, guide=guide, margin=0.1, temperature=1 / t, backend=backend),
    }
    if loss == "clip":
        spec = symmetric.symmetric_spec(txt, weights=None, reduction="mean", cosine=True, eps=1e-8)
        probe = spec.problem(img, txt, txt[:0])
        assert any("column statistics" in why for why in dispatch.reasons("triton", probe))
        assert symmetric.takes("triton", img, txt, True, 1e-8) is None
    out = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (img, txt, scale)]
        with _common.recording() as launched:
            value = calls[loss](*leaves, backend)
            grads = torch.autograd.grad(value, leaves)
        assert (backend == "triton") == bool(launched), backend
        out[backend] = (value, *grads)
    for name, got, want in zip(("loss", "d image", "d text", "d scale"), out["triton"], out["reference"]):
        # 19 rows, 19 (CLIP, SigLIP) or 19 * 4 (GIST) candidates of d = 9, logits 6 |x| |y| (the
        # guide's d = 5 adds a filter, no sum); d scale sums the logits over the scale
        norm = img.norm(dim=-1).max().item() * txt.norm(dim=-1).max().item()
        logits = 6.0 * norm + 2.0
        kw = dict(logit_scale=logits) if got.dim() else dict(magnitude=logits * (norm if name == "d scale" else 1.0))
        assert_close(f"{loss} {name}", got, want, torch.float64, terms=loss_terms(B, 4 * B, d), **kw)
