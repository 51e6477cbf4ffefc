"""fastcl's GEMM tile (``csrc/cpu/gemm_tile.h``): step 1 of a float32 sweep, ``S = A C^T``, by the
tile instead of MKL (``fastcl.config``'s ``cpp.gemm``, ``FASTCL_CPP_GEMM``; docs/csrc.md, "Own GEMM tile").

The tile computes ``kRows x kCols = 12 x 32`` outputs at a time from packed anchors and
candidate panels, so the cases put block and panel edges everywhere: anchors and candidates not multiples
of 12 or 32, forced block heights, two candidate blocks, padding, owner tags, folded own
positives, non-finite rows, one and two threads. Each is checked against the ``torch``
backend in float64 on the same float32 inputs, and against the MKL path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fastcl import config
from fastcl.losses import infonce_loss
from fastcl.ops import _cpp
from fastcl.ops._torch_impl import TorchLSE
from fastcl.ops.contract import TAG_PADDING, LSEProblem, OwnPositives, poison_outputs
from tests.helpers.backends import require
from tests.helpers.matryoshka import check_fused_roundoff, check_roundoff
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff
from tests.kernels.test_cpp import _head, _problem

ROOT = Path(__file__).resolve().parents[2]
TILE = _cpp._capability == "AVX512"
needs_tile = pytest.mark.skipif(not TILE, reason=f"the GEMM tile needs the AVX-512 build (this is {_cpp._capability})")


@pytest.fixture(autouse=True)
def cpp_backend():
    require("cpp")


def _as(prob: LSEProblem, dtype) -> LSEProblem:
    """The same problem in ``dtype`` (the reference's float64 copy of float32 inputs)."""
    return replace(prob, anchor=prob.anchor.to(dtype), blocks=tuple(b.to(dtype) for b in prob.blocks))


def _head_as(head, dtype):
    return replace(head, pos_logits=head.pos_logits.to(dtype), weights=head.weights.to(dtype))


def _fused(gemm: str, prob, head, tau):
    with config.override(cpp={"gemm": gemm}), poison_outputs():
        return _cpp.CppLSE().fused(prob, tau, head)


def _close(got, want, prob, tau: float):
    """Two orders of the same float32 sums (tile, MKL, float64): tests/helpers/matryoshka.py."""
    check_fused_roundoff(got, want, prob, tau)


@needs_tile
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [None, 5])
@pytest.mark.parametrize(
    "B, N1, d, folded",
    [(1, 0, 1, False), (13, 7, 5, True), (37, 29, 33, True), (50, 0, 130, False), (64, 40, 128, True)],
)
def test_fused_step_by_the_tile(fastcl_config, threads, rows, B, N1, d, folded):
    """The fused step with step 1 by the tile matches the float64 torch backend on the same
    float32 inputs (and the MKL path) across block, row-tile and panel edges."""
    fastcl_config(cpp={"test_rows": rows})
    g = torch.Generator().manual_seed(B * 31 + d)
    P = 2
    prob = _problem(B, 3 + P * B + 4, N1, d, torch.float32, gen=g, positives=OwnPositives(3, P) if folded else None)
    head = _head_as(_head(B, P, "softplus", g), torch.float32)
    tau = torch.tensor(0.05)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        own = _fused("own", prob, head, tau)
        mkl = _fused("mkl", prob, head, tau)
    finally:
        torch.set_num_threads(before)
    want = TorchLSE().fused(_as(prob, torch.float64), tau.double(), _head_as(head, torch.float64))
    _close(own, want, prob, 0.05)
    _close(own, mkl, prob, 0.05)


@needs_tile
def test_forward_and_recompute_backward_by_the_tile(fastcl_config, monkeypatch):
    """Step 1 is shared by every mode: the forward and the recompute backward take the tile too."""
    prob = _problem(29, 2 * 29 + 5, 11, 37, torch.float32, positives=OwnPositives(1, 2))
    tau = torch.tensor(0.1)
    g = torch.randn(29)
    d_pos = torch.randn(29, 2)
    out = {}
    for gemm in ("own", "mkl"):
        fastcl_config(cpp={"gemm": gemm})
        with poison_outputs():
            lse, ml = _cpp.CppLSE().forward(prob, tau)
            grads = _cpp.CppLSE().backward(prob, tau, lse, g, d_pos)
        out[gemm] = (lse, ml, grads[0], *grads[1])
    up = g.abs().max().item() + d_pos.abs().sum(-1).max().item()
    for i, (x, y) in enumerate(zip(out["own"], out["mkl"])):
        check_roundoff(f"output {i}", x, y.double(), prob, 0.1, logits=i < 2, upstream=up)


@needs_tile
def test_nonfinite_rows_by_the_tile(fastcl_config, monkeypatch):
    """A NaN anchor row makes its row NaN and nothing else; a NaN in a padded candidate has no
    influence; a NaN in a valid candidate reaches every row that sees it."""
    fastcl_config(cpp={"gemm": "own"})
    g = torch.Generator().manual_seed(4)
    B, N, d = 25, 70, 20
    a, c = torch.randn(B, d, generator=g), torch.randn(N, d, generator=g)
    tags = torch.full((N,), -1, dtype=torch.int32)
    tags[40] = TAG_PADDING
    empty = (torch.empty(0, d), torch.empty(0, dtype=torch.int32))
    head = _head(B, 1, "cross_entropy", g, torch.float32, masks=False)
    tau = torch.tensor(0.05)

    def run(a, c):
        prob = LSEProblem(a, (c, empty[0]), (tags, empty[1]))
        with poison_outputs():
            return _cpp.CppLSE().fused(prob, tau, head)

    clean = run(a, c)
    padded = c.clone()
    padded[40] = float("nan")
    got = run(a, padded)
    assert torch.equal(got.lse, clean.lse) and torch.equal(got.d_blocks[0], clean.d_blocks[0])
    bad_anchor = a.clone()
    bad_anchor[7, 3] = float("nan")
    got = run(bad_anchor, c)
    assert torch.isnan(got.lse[7]) and torch.isfinite(got.lse[torch.arange(B) != 7]).all()
    bad_candidate = c.clone()
    bad_candidate[65, 0] = float("nan")
    assert torch.isnan(run(a, bad_candidate).lse).all()


@needs_tile
def test_tile_is_deterministic(fastcl_config, monkeypatch):
    fastcl_config(cpp={"gemm": "own"})
    prob = _problem(150, 300, 200, 24, torch.float32)
    head = _head(150, 2, "cross_entropy", torch.Generator().manual_seed(1), torch.float32)
    runs = [_cpp.CppLSE().fused(prob, torch.tensor(0.05), head) for _ in range(2)]
    assert torch.equal(runs[0].d_anchor, runs[1].d_anchor) and torch.equal(runs[0].d_blocks[0], runs[1].d_blocks[0])


def test_gemm_choice_is_checked(monkeypatch):
    """An unknown GEMM is refused when the configuration is read or set, and by the library
    itself; "own" without the AVX-512 build is refused by the library, the configuration
    before it staying in force."""
    monkeypatch.setenv("FASTCL_CPP_GEMM", "blas")
    with pytest.raises(ValueError, match="FASTCL_CPP_GEMM='blas': expected one of"):
        config.reload()
    with pytest.raises(ValueError, match="gemm='blas'"):
        config.override(cpp={"gemm": "blas"}).__enter__()
    with pytest.raises(RuntimeError, match="cpp.gemm='blas'; expected auto, own or mkl"):
        torch.ops.fastcl.set_cpu_options(0, "blas")
    with pytest.raises(RuntimeError, match="cpp.tile must be >= 0"):
        torch.ops.fastcl.set_cpu_options(-1, "auto")
    assert config.get().cpp.gemm == "auto"
    if not TILE:
        with pytest.raises(config.ConfigError, match="needs the AVX-512 build"):
            config.override(cpp={"gemm": "own"}).__enter__()
        assert config.get().cpp.gemm == "auto"


def test_loss_on_the_default_path_matches_the_reference(fastcl_config, monkeypatch):
    """B = 600 >= the tile's threshold: the automatic choice (the tile on non-Intel AVX-512 CPUs,
    MKL elsewhere) through the public loss, against the float64 reference."""
    fastcl_config(cpp={"gemm": "auto"})
    g = torch.Generator().manual_seed(9)
    a, p = torch.randn(600, 64, generator=g), torch.randn(600, 64, generator=g)
    a64, p64 = a.double().requires_grad_(), p.double().requires_grad_()
    a, p = a.requires_grad_(), p.requires_grad_()
    got = infonce_loss(a, p, backend="cpp")
    got.backward()
    want = infonce_loss(a64, p64, backend="reference")
    want.backward()
    # float32 round-off (tests/helpers/roundoff.py): d + N + B terms, logits of size 1/0.05; the
    # MKL path (AVX2 or AVX-512 kernels) and the tile sum in other orders
    kw = dict(terms=64 + 600 + 600, logit_scale=1 / 0.05)
    assert_loss_roundoff(got, want, torch.float32, **kw)
    assert_grad_roundoff(a.grad, a64.grad, torch.float32, msg="d anchor", **kw)
    assert_grad_roundoff(p.grad, p64.grad, torch.float32, msg="d positive", **kw)


@needs_tile
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_take_the_tile_through_their_float32_copy(monkeypatch, dtype):
    g = torch.Generator().manual_seed(6)
    prob = _problem(40, 90, 13, 48, dtype, gen=g)
    head = _head(40, 2, "cross_entropy", g, torch.float32)
    tau = torch.tensor(0.05)
    own = _fused("own", prob, head, tau)
    mkl = _fused("mkl", prob, head, tau)
    assert own.d_anchor.dtype == torch.float32
    _close(own, mkl, prob, 0.05)


@needs_tile
def test_a_single_matryoshka_prefix_keeps_mkl(fastcl_config, monkeypatch):
    """dims = (m,) with m < d is one prefix but not the whole row: the tile (whole rows) must
    not take it. Forced "own" must give the prefix's values, as "mkl" and the plain problem on
    the first m coordinates do."""
    g = torch.Generator().manual_seed(12)
    a, b0, b1 = torch.randn(9, 40, generator=g), torch.randn(14, 40, generator=g), torch.randn(3, 40, generator=g)
    tags = (torch.full((14,), -1, dtype=torch.int32), torch.full((3,), -1, dtype=torch.int32))
    tau = torch.tensor(0.1)
    prefix = LSEProblem(a, (b0, b1), tags, dims=(17,))
    plain = LSEProblem(a[:, :17].contiguous(), (b0[:, :17].contiguous(), b1[:, :17].contiguous()), tags)
    fastcl_config(cpp={"gemm": "own"})
    lse, _ = _cpp.CppLSE().forward(prefix, tau)
    want, _ = _cpp.CppLSE().forward(plain, tau)
    check_roundoff("lse", lse[0], want, plain, 0.1, logits=True)


@needs_tile
@pytest.mark.slow
def test_cpp_contract_suites_with_the_tile_forced():
    """The shared contract suites (values, gradients, masks, non-finite rows, Matryoshka,
    memory) on the cpp backend with the tile forced: their small shapes otherwise take MKL
    (the automatic rule starts at B = 512). A single Matryoshka prefix shorter than d was
    found wrong this way before it shipped."""
    env = dict(os.environ, FASTCL_CPP_GEMM="own", FASTCL_TEST_BACKENDS="cpp")
    # the primitive's suites: the loss layer above them calls the same ops (tests/losses runs
    # them with the automatic rule; forcing the tile there too cost CI ~40 s for no new path)
    # -k cpp: the cases that run the cpp backend (their id or file names it); the reference's
    # and the backend-free ones do not reach the tile (a third of the tests, and the torch
    # backend's float64 gradchecks)
    suites = ["tests/ops", "tests/kernels/test_cpp.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-k", "cpp", "-p", "no:cacheprovider", *suites]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
