"""One table of tolerances for comparing fastcl with the float64 reference.

Used by the tests (small problems, :func:`assert_close`) and by the benchmark's correctness
check at scale (``benchmarks/harness/correctness.py``, ``benchmarks/harness/peers.py``). Errors are relative Frobenius errors ``|got - ref| / |ref|`` against the reference run in
float64 on the *same* (already rounded) inputs. Below float64 the bound is the larger of
the floor below and ``EAGER_FACTOR`` times the error of eager PyTorch computing the
reference in that dtype (flash-attention's rule): a fused kernel may not be worse than
what users have. Where the true value is ~0 (gradients that cancel exactly, an empty
denominator), a tiny RMS absolute error also passes. NaN or inf never passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    floor: float  # relative error floor of a test comparison (see the module docstring)
    atol_rms: float  # RMS absolute error that passes whatever the reference's size (exact zeros)
    grad_at_scale: float  # relative gradient error at benchmark scale (N up to ~16k terms per sum)
    value_at_scale: tuple[float, float]  # (atol, rtol) of a loss value at benchmark scale


TOLERANCES = {
    torch.float64: Tolerance(1e-9, 1e-12, 1e-9, (1e-9, 1e-9)),
    torch.float32: Tolerance(3e-5, 1e-7, 1e-4, (1e-4, 1e-4)),
    torch.float16: Tolerance(5e-3, 1e-4, 5e-3, (1e-2, 5e-3)),
    torch.bfloat16: Tolerance(3e-2, 1e-3, 3e-2, (3e-2, 2e-2)),
}
FLOOR = {dt: t.floor for dt, t in TOLERANCES.items()}
ATOL_RMS = {dt: t.atol_rms for dt, t in TOLERANCES.items()}
GRAD_RTOL = {dt: t.grad_at_scale for dt, t in TOLERANCES.items()}
VALUE_TOL = {dt: t.value_at_scale for dt, t in TOLERANCES.items()}
EAGER_FACTOR = 4.0
# The temperature gradient is one scalar, -(1/tau) * sum_i g_i * (mean_logit_i - l_i+): a
# sum over rows of differences of two logits of size ~1/tau. Its relative error grows
# with that cancellation, so below float64 its floor is wider than an element's.
SCALAR_SUM_FACTOR = 10.0


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got).all():
        return float("inf")
    scale = ref.norm().item()
    diff = (got - ref).norm().item()
    return diff / scale if scale > 0 else diff


def rms_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return (got.detach().double() - ref.detach().double()).norm().item() / math.sqrt(max(ref.numel(), 1))


def max_abs_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return (got.detach().double() - ref.detach().double()).abs().max().item() if ref.numel() else 0.0


def bound(dtype: torch.dtype, eager: torch.Tensor | None = None, ref: torch.Tensor | None = None) -> float:
    floor = FLOOR[dtype]
    if eager is None or ref is None or dtype == torch.float64:
        return floor
    eager_err = rel_err(eager, ref)
    return max(floor, EAGER_FACTOR * eager_err) if math.isfinite(eager_err) else floor


def assert_close(
    name: str, got, ref, dtype: torch.dtype, eager=None, *, scalar_sum: bool = False, abs_scale: float | None = None
) -> None:
    """Fail unless ``got`` matches ``ref`` (see the module docstring); ``scalar_sum`` marks
    a scalar formed by a cancelling sum (the temperature gradient). ``abs_scale``: the size
    of the terms ``got`` is a difference of (the logits, ``1/tau``, for a loss): an error
    of ``FLOOR[dtype]`` relative to *them* also passes, since a loss near 0 made of
    logits near 20 cannot be closer than their rounding; for gradients (differences of
    softmax-weighted terms of the same size) it scales the RMS floor."""
    assert got is not None, f"{name}: no value (gradient missing?)"
    assert tuple(got.shape) == tuple(ref.shape), f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err, b = rel_err(got, ref), bound(dtype, eager, ref)
    if scalar_sum and dtype != torch.float64:
        b = max(b, SCALAR_SUM_FACTOR * FLOOR[dtype])
    if err <= b or rms_err(got, ref) <= ATOL_RMS[dtype] * (abs_scale or 1.0):
        return
    if abs_scale is not None and max_abs_err(got, ref) <= FLOOR[dtype] * abs_scale:
        return
    raise AssertionError(f"{name}: relative error {err:.3e} > {b:.3e} ({dtype}); rms {rms_err(got, ref):.2e}")
