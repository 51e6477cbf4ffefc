"""The cpp kernel's work split (csrc/cpu/lse_cpu.cpp, sweep()) on several threads.

All threads work on one block of anchor rows: A C^T split by candidate chunks, the row
passes by rows, X C one GEMM that MKL threads, X^T A by candidate chunks.
These tests use widths and candidate counts large enough that every split has several
parts on 2 and 3 threads, blocks with a short last one, and compare with the torch
backend in float64 (values and gradients, folded own positives included) and check that
a thread count gives bitwise the same results twice.
"""

from __future__ import annotations

import pytest
import torch

from fastcl import config
from fastcl.ops import _cpp
from fastcl.ops.contract import OwnPositives
from tests.helpers.backends import require
from tests.kernels.test_cpp import _compare_fused, _head, _problem


@pytest.fixture(autouse=True)
def _needs_cpp():
    require("cpp")


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("rows", [7, None])  # forced short blocks, or the default plan
@pytest.mark.parametrize("d", [130, 200])
def test_split_matches_torch(fastcl_config, threads, num_threads, rows, d):
    fastcl_config(cpp={"test_rows": rows})
    threads(num_threads)
    g = torch.Generator().manual_seed(num_threads * 1000 + d)
    B = 26
    prob = _problem(B, 3 + 2 * B + 300, 150, d, gen=g, positives=OwnPositives(3, 2))
    head = _head(B, 2, "softplus", g)
    _compare_fused(prob, head, torch.tensor(0.1, dtype=torch.float64))


def test_split_is_bitwise_reproducible(fastcl_config, threads):
    fastcl_config(cpp={"test_rows": 9})
    threads(2)
    g = torch.Generator().manual_seed(3)
    prob = _problem(40, 700, 90, 140, dtype=torch.float32, gen=g, positives=OwnPositives(0, 1))
    head = _head(40, 1, "cross_entropy", g, torch.float32)
    tau = torch.tensor(0.05)
    runs = [_cpp.CppLSE().fused(prob, tau, head) for _ in range(2)]
    for name in ("lse", "loss_rows", "d_pos", "d_anchor", "g_dot_mean_logit"):
        assert torch.equal(getattr(runs[0], name), getattr(runs[1], name)), name
    for u, v in zip(runs[0].d_blocks, runs[1].d_blocks):
        assert torch.equal(u, v)


def _all_outputs(prob, tau, head):
    """Every output of the three sweeps (fused, forward, backward) on ``prob``."""
    cpp = _cpp.CppLSE()
    fused = cpp.fused(prob, tau, head)
    lse, mean_logit = cpp.forward(prob, tau)
    g = torch.linspace(-1, 1, prob.num_anchors, dtype=lse.dtype)
    d_anchor, d_blocks = cpp.backward(prob, tau, lse, g)
    return [fused.lse, fused.loss_rows, fused.d_anchor, *fused.d_blocks, lse, mean_logit, d_anchor, *d_blocks]


def test_kept_block_buffer_changes_nothing(fastcl_config, threads):
    """The block buffer kept between calls (lse_cpu.cpp, block_buffer) is reused by calls of
    other shapes and dtypes, after calls that filled it with NaN: every output is bitwise the
    same as with a fresh buffer per call (cpp.test_keep_bytes=0)."""
    threads(2)
    g = torch.Generator().manual_seed(11)
    tau = torch.tensor(0.05)
    nan_prob = _problem(30, 400, 20, 24, dtype=torch.float32, gen=g)
    nan_prob.anchor[3, 5] = float("nan")  # the NaN row's logits fill the buffer
    calls = [
        (nan_prob, _head(30, 1, "cross_entropy", g, torch.float32)),
        (_problem(30, 400, 20, 24, dtype=torch.float32, gen=g), _head(30, 1, "cross_entropy", g, torch.float32)),
        (_problem(12, 90, 7, 24, dtype=torch.float32, gen=g), _head(12, 1, "softplus", g, torch.float32)),
        (_problem(20, 600, 0, 16, gen=g), _head(20, 2, "softplus", g)),  # float64, more columns
        (_problem(30, 400, 20, 24, dtype=torch.float32, gen=g), _head(30, 1, "cross_entropy", g, torch.float32)),
    ]
    results = {}
    for keep in (0, None):
        fastcl_config(cpp={"test_keep_bytes": keep})
        results[keep] = [_all_outputs(prob, tau.to(prob.dtype), head) for prob, head in calls]
    assert results[0][0][0].isnan().any(), "the first call should have filled the buffer with NaN"
    for i, (fresh, kept) in enumerate(zip(results[0], results[None])):
        for j, (u, v) in enumerate(zip(fresh, kept)):
            assert torch.equal(u.nan_to_num(7.0), v.nan_to_num(7.0)) and torch.equal(u.isnan(), v.isnan()), (i, j)


@pytest.mark.parametrize(
    "name, raw",
    [("_FASTCL_TEST_CPP_ROWS", "abc"), ("_FASTCL_TEST_CPP_ROWS", "0"), ("_FASTCL_TEST_CPP_ROWS", "-3"),
     ("_FASTCL_TEST_CPP_ROWS", "1e3"), ("_FASTCL_TEST_CPP_ROWS", "99999999999999999999"),
     ("_FASTCL_TEST_CPP_CHUNK", "4.5"), ("_FASTCL_TEST_CPP_KEEP_BYTES", "-1")],
)  # fmt: skip
def test_invalid_environment_values_are_refused(monkeypatch, name, raw):
    """The test hooks are knobs of fastcl.config (cpp.test_*), read from the environment once
    with the strict rule of every knob: a value that is not a decimal integer in range raises,
    naming the variable, instead of becoming 1 or wrapping around; the configuration in force
    stays."""
    before = config.get()
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"{name}='{raw}': expected an integer >= "):
        config.reload()
    assert config.get() == before


def test_keep_bytes_zero_is_a_valid_value(fastcl_config):
    """0 (never keep the block buffer, what the memory probes set) is in range for this hook."""
    assert config.from_environment({"_FASTCL_TEST_CPP_KEEP_BYTES": "0"}).cpp.test_keep_bytes == 0
    fastcl_config(cpp={"test_keep_bytes": 0})
    prob = _problem(5, 9, 3, 4, dtype=torch.float32, gen=torch.Generator().manual_seed(0))
    lse, _ = _cpp.CppLSE().forward(prob, torch.tensor(0.1))
    assert torch.isfinite(lse).all()
