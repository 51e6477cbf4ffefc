"""The torch backend's one-pass Matryoshka path (fastcl/ops/_torch_prefix.py) in the corners
the contract test does not reach: several row tiles, clamped norms, values beyond the
largest prefix, half-precision inputs."""

from __future__ import annotations

import pytest
import torch

from fastcl.ops import dispatch
from tests.helpers.matryoshka import check_backend, check_roundoff, oracle, prefix_problem

TORCH = dispatch.get("torch")


@pytest.mark.parametrize("cosine", [True, False])
def test_many_row_tiles(fastcl_config, cosine):
    fastcl_config(torch={"tile": 16})  # one or two anchor rows per tile
    prob = prefix_problem(9, 6, 4, 12, (3, 12, 7), cosine=cosine, own=2, generator=torch.Generator().manual_seed(3))
    check_backend(TORCH, prob, 0.3)


def test_zero_and_tiny_rows_use_the_clamped_norm():
    prob = prefix_problem(6, 5, 3, 10, (10, 4, 2), own=1, generator=torch.Generator().manual_seed(4))
    prob.anchor[1] = 0.0
    prob.anchor[2, :4] = 1e-12  # prefixes 4 and 2 clamped, the full one not
    prob.blocks[0][3, :2] = 0.0
    check_backend(TORCH, prob, 0.5)


def test_values_beyond_the_largest_prefix_are_never_read():
    prob = prefix_problem(5, 4, 3, 10, (6, 3), own=1, generator=torch.Generator().manual_seed(5))
    prob.anchor[0, 8] = float("nan")
    prob.blocks[0][2, 7] = float("inf")
    lse, mean = TORCH.forward(prob, torch.tensor(0.2, dtype=torch.float64))
    assert torch.isfinite(lse).all() and torch.isfinite(mean).all()
    g = torch.ones(2, 5, dtype=torch.float64)
    d_a, (d_b0, d_b1) = TORCH.backward(prob, torch.tensor(0.2, dtype=torch.float64), lse, g)
    assert d_a[:, 6:].eq(0).all() and d_b0[:, 6:].eq(0).all() and torch.isfinite(d_a).all()


def test_nan_in_a_read_row_is_nan():
    prob = prefix_problem(5, 4, 3, 10, (6, 3), generator=torch.Generator().manual_seed(6))
    prob.blocks[0][1, 1] = float("nan")
    prob.tags[0][1] = -1  # read by every row
    lse, _ = TORCH.forward(prob, torch.tensor(0.2, dtype=torch.float64))
    assert torch.isnan(lse).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("cosine", [True, False])
def test_nonfinite_reaches_only_the_longer_prefixes(bad, cosine):
    """As the plain problem on each prefix: a candidate's NaN/Inf at coordinate 4 leaves prefix 3 exact."""
    prob = prefix_problem(5, 4, 3, 10, (6, 3), cosine=cosine, generator=torch.Generator().manual_seed(7))
    prob.blocks[0][1, 4] = bad
    prob.tags[0][1] = -1
    tau = torch.tensor(0.2, dtype=torch.float64)
    lse, _ = TORCH.forward(prob, tau)
    want, _ = dispatch.get("reference").forward(prob, tau)
    assert torch.isnan(lse[0]).all() and torch.isnan(want[0]).all()
    check_roundoff("lse", lse[1], want[1], prob, 0.2, logits=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_compute_in_float32(dtype):
    prob = prefix_problem(8, 6, 3, 16, (16, 8), dtype=dtype, own=1, generator=torch.Generator().manual_seed(7))
    tau = torch.tensor(0.1)
    lse, _ = TORCH.forward(prob, tau)
    assert lse.dtype == torch.float32
    want, _, _, _ = oracle(prob, 0.1, torch.ones(2, 8))
    check_roundoff("lse", lse, want, prob, 0.1, logits=True)  # float32 sums of the rounded inputs


@pytest.mark.slow
def test_no_bxn_buffer_whatever_the_number_of_prefixes():
    """B = N = 8192: one float32 logits copy is 256 MiB, K = 2 prefixes' would be 512 MiB; the
    fused forward + backward (fresh process, tests/ops/test_memory.py's meter) stays below half of one
    copy: about 50 MiB of tiles, bounded by the plain path's tile budget whatever K is."""
    from benchmarks.harness.memory import cpu_extra_peak_bytes

    B = 8192
    case = dict(backend="torch", B=B, d=16, Q=0, dims=[16, 8])
    extra = cpu_extra_peak_bytes("benchmarks.harness.api_cases:matryoshka_step", case)
    assert extra < B * B * 4 / 2, f"extra peak {extra / 2**20:.0f} MiB"
