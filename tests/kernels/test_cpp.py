"""The ``"cpp"`` backend beyond the shared matrix: gradcheck, opcheck, block edges, threads,
determinism, poisoned outputs, and the lazy build (never at import, reasons kept).

The shared backend matrix (tests/ops/test_backend_matrix.py, tests/ops/test_primitive.py,
tests/ops/test_memory.py) already runs ``"cpp"`` against the float64 oracles.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from fastcl.ops import _build, _cpp, dispatch
from fastcl.ops._torch_impl import TorchLSE
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, OwnPositives, poison_outputs
from fastcl.ops.head import HeadInputs, reduction_weights
from tests.helpers.backends import require
from tests.helpers.gradcheck import gradcheck_contrastive
from tests.helpers.matryoshka import check_fused_roundoff, check_roundoff


@pytest.fixture(autouse=True)
def cpp_backend():
    require("cpp")


def _problem(B, N0, N1, d, dtype=torch.float64, cosine=True, gen=None, positives=None):
    """Random tags: padding, all-rows and owner tags mixed; row 0 loses every candidate.
    ``positives``: an ``OwnPositives`` layout in block 0 (their tags stay random: the fold
    must not care whether a positive is also in the denominator)."""
    g = gen or torch.Generator().manual_seed(0)
    a = torch.randn(B, d, generator=g).to(dtype)
    b0 = torch.randn(N0, d, generator=g).to(dtype)
    b1 = torch.randn(N1, d, generator=g).to(dtype)
    t0 = torch.randint(-2, B, (N0,), generator=g, dtype=torch.int32)
    t1 = torch.where(torch.rand(N1, generator=g) < 0.3, TAG_PADDING, TAG_ALL).to(torch.int32)
    if B > 1:
        t0 = torch.where(t0 == -1, 0, t0).to(torch.int32)
        t0 = torch.where(t0 == 1, TAG_PADDING, t0).to(torch.int32)  # keep some padding
        t1 = torch.full_like(t1, TAG_PADDING) if N1 else t1
    return LSEProblem(a, (b0, b1), (t0, t1), cosine, positives=positives)


def _head(B, P, kind, gen, dtype=torch.float64, masks=True, log_extra=False):
    pos = torch.randn(B, P, generator=gen, dtype=dtype)
    mask = torch.rand(B, P, generator=gen) > 0.3 if masks else None
    extra = torch.rand(B, generator=gen, dtype=dtype).log() if log_extra else None
    has_pos = torch.ones(B, dtype=torch.bool) if mask is None else mask.any(1)
    return HeadInputs(kind, pos, mask, extra, reduction_weights(has_pos, "mean", dtype))


# ----------------------------------------------------------------- gradients in float64


@pytest.mark.parametrize("folded", [True, False])
@pytest.mark.parametrize("strategy", ["fused", "recompute"])
@pytest.mark.parametrize("kind, zero_logit", [("cross_entropy", False), ("softplus", False), ("softplus", True)])
@pytest.mark.parametrize("cosine", [True, False])
def test_gradcheck_cpp(fastcl_config, monkeypatch, strategy, kind, zero_logit, cosine, folded):
    """Folded: the backend adds the positives' gradient itself (OwnPositives); not folded:
    precomputed differentiable positive logits (shared positives)."""
    fastcl_config(strategy=strategy)
    gradcheck_contrastive("cpp", kind=kind, cosine=cosine, folded=folded, zero_logit=zero_logit)


# ----------------------------------------------------------------- opcheck on every op


def _op_cases(requires_grad: bool):
    prob = _problem(5, 7, 3, 4, dtype=torch.float32)
    anchor = prob.anchor.requires_grad_(requires_grad)
    args = (anchor, *prob.blocks, *prob.tags, torch.tensor(0.1), True, 1e-8)
    B, d = 5, 4
    g = torch.Generator().manual_seed(1)
    head = _head(B, 1, "softplus", g, torch.float32, log_extra=True)  # folded: rows 0 .. 4 of block0
    yield "lse_forward", args, dict(lse=torch.empty(B), mean_logit=torch.empty(B))
    for d_pos in (None, torch.randn(B, 1)):  # positives at rows 2 + i of block0
        yield (
            "lse_backward",
            args + (torch.randn(B), torch.randn(B), d_pos, 2),
            dict(d_anchor=torch.empty(B, d), d_block0=torch.empty(7, d), d_block1=torch.empty(3, d)),
        )
    yield (
        "lse_fused",
        args + ("softplus", head.pos_logits, head.pos_mask, head.log_extra, head.weights, 0, True),
        dict(
            lse=torch.empty(B),
            mean_logit=torch.empty(B),
            loss_rows=torch.empty(B),
            d_pos=torch.empty(B, 1),
            d_anchor=torch.empty(B, d),
            d_block0=torch.empty(7, d),
            d_block1=torch.empty(3, d),
            g_dot_mean_logit=torch.empty(()),
        ),
    )


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_every_op(requires_grad):
    cases = list(_op_cases(requires_grad))
    assert {name for name, _, _ in cases} == {"lse_forward", "lse_backward", "lse_fused"}
    for name, args, kwargs in cases:
        torch.library.opcheck(getattr(torch.ops.fastcl, name).default, args, kwargs)


# ----------------------------------------------------------------- against the torch backend


def _compare_fused(prob, head, tau):
    """cpp against the torch backend: the same sums in other orders, within the round-off of
    the problem's dtype (tests/helpers/matryoshka.py)."""
    want = TorchLSE().fused(prob, tau, head)
    with poison_outputs():
        got = _cpp.CppLSE().fused(prob, tau, head)
    check_fused_roundoff(got, want, prob, float(tau))
    return got


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("kind, log_extra", [("cross_entropy", False), ("softplus", False), ("softplus", True)])
def test_fused_matches_torch_across_block_edges(fastcl_config, rows, kind, log_extra, folded):
    """Forced block sizes make many waves and short last blocks; the head in C++ must
    agree with fastcl/ops/head.py row by row (masks, empty rows, log_extra); folded own
    positives (3 per anchor from row 5 of block 0) must match ``_fold_positives``."""
    fastcl_config(cpp={"test_rows": rows})
    g = torch.Generator().manual_seed(int(rows) * 7 + len(kind))
    B = 37
    prob = _problem(B, 5 + 3 * B + 4, 29, 19, gen=g, positives=OwnPositives(5, 3) if folded else None)
    head = _head(B, 3, kind, g, log_extra=log_extra)
    _compare_fused(prob, head, torch.tensor(0.2, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["cross_entropy", "softplus"])
def test_empty_row_among_others(fastcl_config, kind):
    """Every candidate tagged 0 or padding: row 0 has none (lse -inf, no gradient, no NaN)
    while the other rows have all of them; folded own positives one per anchor."""
    fastcl_config(cpp={"test_rows": 2})
    g = torch.Generator().manual_seed(11)
    B, d = 5, 6
    tags0 = torch.where(torch.rand(B + 3, generator=g) < 0.3, TAG_PADDING, 0).to(torch.int32)
    tags1 = torch.tensor([0, TAG_PADDING, 0], dtype=torch.int32)
    prob = LSEProblem(
        torch.randn(B, d, dtype=torch.float64, generator=g),
        (torch.randn(B + 3, d, dtype=torch.float64, generator=g), torch.randn(3, d, dtype=torch.float64, generator=g)),
        (tags0, tags1),
        positives=OwnPositives(3, 1),
    )
    head = _head(B, 1, kind, g, masks=False)
    got = _compare_fused(prob, head, torch.tensor(0.2, dtype=torch.float64))
    assert got.lse[0] == float("-inf") and got.mean_logit[0] == 0
    assert torch.isfinite(got.lse[1:]).all() and torch.isfinite(got.d_anchor).all()


@pytest.mark.parametrize("kind", ["cross_entropy", "softplus"])
def test_log_extra_nan_reaches_the_gradients_and_minus_inf_adds_nothing(fastcl_config, kind):
    """``log_extra`` is the ring's other blocks' merged ``lse`` (fastcl/ops/ring.py): a NaN
    there (a NaN candidate on another rank) must make the row's gradient share NaN, as
    the recompute path's ``exp(lse_t - lse)`` does, never 0; ``-inf`` (no other candidate)
    leaves the row as it is. The C++ head agrees with fastcl/ops/head.py."""
    fastcl_config(cpp={"test_rows": 2})
    g = torch.Generator().manual_seed(5)
    B = 6
    prob = _problem(B, 13, 7, 5, gen=g)
    head = _head(B, 2, kind, g, masks=False, log_extra=True)
    head.log_extra[1], head.log_extra[4] = float("nan"), float("-inf")
    tau = torch.tensor(0.2, dtype=torch.float64)
    want = TorchLSE().fused(prob, tau, head)
    with poison_outputs():
        got = _cpp.CppLSE().fused(prob, tau, head)
    check_fused_roundoff(got, want, prob, 0.2, equal_nan=True)
    assert got.loss_rows[1].isnan() and got.d_anchor[1].isnan().all()
    assert got.g_dot_mean_logit.isnan()
    padded = prob.tags[0] == TAG_PADDING
    assert got.d_blocks[0][~padded].isnan().any() and (got.d_blocks[0][padded] == 0).all()
    plain = _cpp.CppLSE().fused(prob, tau, dataclasses.replace(head, log_extra=None))
    check_roundoff("loss_rows", got.loss_rows[4], plain.loss_rows[4], prob, 0.2, logits=True)
    check_roundoff("d_anchor", got.d_anchor[4], plain.d_anchor[4], prob, 0.2, logits=False)


@pytest.mark.parametrize("cosine", [True, False])
def test_forward_and_backward_match_torch(fastcl_config, cosine):
    fastcl_config(cpp={"test_rows": 4})
    prob = _problem(23, 2 * 23 + 1, 17, 9, cosine=cosine, positives=OwnPositives(1, 2))
    tau = torch.tensor(0.1, dtype=torch.float64)
    ref = TorchLSE()
    with poison_outputs():
        lse, ml = _cpp.CppLSE().forward(prob, tau)
    want_lse, want_ml = ref.forward(prob, tau)
    check_roundoff("lse", lse, want_lse, prob, 0.1, logits=True)
    check_roundoff("mean_logit", ml, want_ml, prob, 0.1, logits=True)
    g = torch.randn(23, dtype=torch.float64)
    g[3] = 0  # a zero row gradient takes the shortcut
    d_pos = torch.randn(23, 2, dtype=torch.float64)
    d_pos[5] = 0
    for dp in (None, d_pos):  # with and without folded own positives
        with poison_outputs():
            d_a, (d0, d1) = _cpp.CppLSE().backward(prob, tau, lse, g, dp)
        w_a, (w0, w1) = ref.backward(prob, tau, want_lse, g, dp)
        up = g.abs().max().item() + (0.0 if dp is None else dp.abs().sum(-1).max().item())
        for name, x, y in (("d_anchor", d_a, w_a), ("d_block0", d0, w0), ("d_block1", d1, w1)):
            check_roundoff(name, x, y, prob, 0.1, logits=False, upstream=up)
    padded = prob.tags[1] == TAG_PADDING
    assert (d1[padded] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_float32(dtype):
    g = torch.Generator().manual_seed(3)
    prob = _problem(19, 40, 25, 33, dtype=dtype, gen=g)
    head = _head(19, 2, "softplus", g, torch.float32)
    tau = torch.tensor(0.05)
    got = _cpp.CppLSE().fused(prob, tau, head)
    assert got.lse.dtype == got.d_anchor.dtype == got.d_blocks[0].dtype == torch.float32
    # the torch backend computes from the same rounded inputs in float32
    _compare_fused(prob, head, tau)


def test_empty_and_degenerate_shapes():
    tau = torch.tensor(0.5)
    impl = _cpp.CppLSE()
    # no candidates at all: every row is empty
    prob = LSEProblem(
        torch.randn(3, 4),
        (torch.randn(0, 4), torch.randn(0, 4)),
        (torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32)),
    )
    with poison_outputs():
        lse, ml = impl.forward(prob, tau)
        d_a, (d0, d1) = impl.backward(prob, tau, lse, torch.ones(3))
    assert torch.isneginf(lse).all() and (ml == 0).all() and (d_a == 0).all()
    # d = 1 and zero vectors: finite, and the d = 1 cosine gradient is exactly 0
    a = torch.tensor([[2.0], [0.0], [-3.0]])
    prob = LSEProblem(
        a,
        (torch.tensor([[1.0], [-0.5]]), torch.zeros(1, 1)),
        (torch.tensor([-1, 0], dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)),
    )
    with poison_outputs():
        lse, _ = impl.forward(prob, tau)
        d_a, (d0, d1) = impl.backward(prob, tau, lse, torch.ones(3))
    assert torch.isfinite(lse).all()
    assert d_a[0].item() == 0 and d_a[2].item() == 0 and d0.abs().max().item() == 0


def test_deterministic_for_a_thread_count(monkeypatch):
    """Same inputs and threads: bitwise the same; other thread counts: float rounding only."""
    g = torch.Generator().manual_seed(5)
    prob = _problem(150, 300, 200, 24, dtype=torch.float32, gen=g)
    head = _head(150, 2, "cross_entropy", g, torch.float32)
    tau = torch.tensor(0.05)
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs = [_cpp.CppLSE().fused(prob, tau, head) for _ in range(2)]
            for name in ("lse", "d_anchor", "d_blocks", "g_dot_mean_logit"):
                x, y = getattr(runs[0], name), getattr(runs[1], name)
                for u, v in zip(x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)):
                    assert torch.equal(u, v), f"{name} differs between two runs with {threads} threads"
            results[threads] = runs[0]
    finally:
        torch.set_num_threads(before)
    check_fused_roundoff(results[1], results[2], prob, 0.05)  # other thread counts: other orders


def test_bad_arguments_raise_before_compute():
    prob = _problem(3, 4, 2, 5, dtype=torch.float32)
    args = (prob.anchor, *prob.blocks, *prob.tags, torch.tensor(0.1), True, 1e-8)
    out = dict(lse=torch.empty(3), mean_logit=torch.empty(3))
    with pytest.raises(RuntimeError, match="tau must be finite and > 0"):
        torch.ops.fastcl.lse_forward(*args[:5], torch.tensor(-1.0), True, 1e-8, **out)
    with pytest.raises(RuntimeError, match="output lse must have shape"):
        torch.ops.fastcl.lse_forward(*args, lse=torch.empty(4), mean_logit=torch.empty(3))
    with pytest.raises(RuntimeError, match="tags must be int32"):
        torch.ops.fastcl.lse_forward(*args[:3], prob.tags[0].long(), *args[4:], **out)
    bad_tags = torch.full((4,), -3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="tags must be -2"):
        torch.ops.fastcl.lse_forward(args[0], args[1], args[2], bad_tags, *args[4:], **out)
    grads = dict(d_anchor=torch.empty(3, 5), d_block0=torch.empty(4, 5), d_block1=torch.empty(2, 5))
    with pytest.raises(RuntimeError, match="do not fit in block0"):  # 3 anchors x 2 positives > 4 rows
        torch.ops.fastcl.lse_backward(*args, torch.zeros(3), torch.ones(3), torch.ones(3, 2), 0, **grads)


def test_unsupported_lists_reasons():
    meta = LSEProblem(
        torch.randn(2, 3, device="meta"),
        (torch.randn(2, 3, device="meta"),) * 2,
        (torch.full((2,), -1, dtype=torch.int32, device="meta"),) * 2,
    )
    assert any("CPU tensors only" in r for r in _cpp.CppLSE().unsupported(meta))
    ints = LSEProblem(
        torch.ones(2, 3, dtype=torch.int64),
        (torch.ones(2, 3, dtype=torch.int64),) * 2,
        (torch.full((2,), -1, dtype=torch.int32),) * 2,
    )
    assert any("float32/float64" in r for r in _cpp.CppLSE().unsupported(ints))


# ----------------------------------------------------------------- the lazy build


def test_auto_picks_cpp_on_cpu():
    prob = _problem(3, 4, 2, 5, dtype=torch.float32)
    assert dispatch.choose(prob).name == "cpp"
    assert dispatch.describe()["cpp"] == "available"


def test_import_never_builds(tmp_path):
    """Importing fastcl (and the backend module) with an empty cache compiles nothing."""
    code = (
        "import fastcl, fastcl.losses, fastcl.ops._cpp as c, json; "
        "print(json.dumps([c.EXTENSION._tried, c.EXTENSION.build_dir().exists()]))"
    )
    env = dict(os.environ, FASTCL_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [False, False]
    assert out.stderr == ""


def test_build_failure_reason_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTCL_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "broken.cpp").write_text("this is not C++;\n")
    monkeypatch.setattr(_build, "csrc_dir", lambda: broken)
    ext = _build.Extension(name="fastcl_broken", sources=["broken.cpp"], describe="test")
    why = ext.error()
    assert why and "failed to build" in why and "build-error.log" in why
    assert ext.error() is why  # tried once, remembered
    monkeypatch.setenv(_build.NO_BUILD_ENV, "1")
    assert "disabled" in _build.Extension(name="fastcl_off", sources=[], describe="test").error()


def test_info_shows_cpp_status():
    from fastcl.info import report

    assert "cpp" in report()


def test_ninja_missing_is_a_reason(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", no_ninja)
    why = _build.Extension(name="fastcl_noninja", sources=[], describe="test").error()
    assert why and "ninja" in why and "pip install ninja" in why


def test_second_process_loads_the_cached_build():
    """The library built for this session is reused by a new process: no compile message."""
    code = "import fastcl.ops._cpp as c, sys; sys.exit(1 if c.BACKEND.unavailable() else 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "compiling" not in out.stderr, out.stderr
