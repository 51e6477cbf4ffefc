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

from fastcl.ops import _cpp
from fastcl.ops.contract import OwnPositives
from tests.helpers.backends import require
from tests.kernels.test_cpp import _compare_fused, _head, _problem


@pytest.fixture(autouse=True)
def _needs_cpp():
    require("cpp")


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("rows", ["7", None])  # forced short blocks, or the default plan
@pytest.mark.parametrize("d", [130, 200])
def test_split_matches_torch(monkeypatch, threads, num_threads, rows, d):
    if rows is None:
        monkeypatch.delenv("FASTCL_CPP_ROWS", raising=False)
    else:
        monkeypatch.setenv("FASTCL_CPP_ROWS", rows)
    threads(num_threads)
    g = torch.Generator().manual_seed(num_threads * 1000 + d)
    B = 26
    prob = _problem(B, 3 + 2 * B + 300, 150, d, gen=g, positives=OwnPositives(3, 2))
    head = _head(B, 2, "supmpn", g)
    _compare_fused(prob, head, torch.tensor(0.1, dtype=torch.float64), 1e-10)


def test_split_is_bitwise_reproducible(monkeypatch, threads):
    monkeypatch.setenv("FASTCL_CPP_ROWS", "9")
    threads(2)
    g = torch.Generator().manual_seed(3)
    prob = _problem(40, 700, 90, 140, dtype=torch.float32, gen=g, positives=OwnPositives(0, 1))
    head = _head(40, 1, "supcon", g, torch.float32)
    tau = torch.tensor(0.05)
    runs = [_cpp.CppLSE().fused(prob, tau, head) for _ in range(2)]
    for name in ("lse", "loss_rows", "d_pos", "d_anchor", "g_dot_mean_logit"):
        assert torch.equal(getattr(runs[0], name), getattr(runs[1], name)), name
    for u, v in zip(runs[0].d_blocks, runs[1].d_blocks):
        assert torch.equal(u, v)
