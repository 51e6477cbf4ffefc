"""One table of tolerances for comparing a backend with the float64 reference.

Errors are relative Frobenius errors ``|got - ref| / |ref|`` against the reference run in
float64 on the *same* (already rounded) inputs. Below float64 the bound is the larger of
the floor below and ``EAGER_FACTOR`` times the error of eager PyTorch computing the
reference in that dtype (flash-attention's rule): a fused kernel may not be worse than
what users have. Where the true value is ~0 (gradients that cancel exactly, an empty
denominator), a tiny RMS absolute error also passes. NaN or inf never passes.
"""

from __future__ import annotations

import math

import torch

FLOOR = {
    torch.float64: 1e-9,
    torch.float32: 3e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}
# RMS absolute error that passes whatever the reference's size (for exact zeros)
ATOL_RMS = {
    torch.float64: 1e-12,
    torch.float32: 1e-7,
    torch.float16: 1e-4,
    torch.bfloat16: 1e-3,
}
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


def assert_close(name: str, got, ref, dtype: torch.dtype, eager=None, *, scalar_sum: bool = False,
                 abs_scale: float | None = None) -> None:
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
