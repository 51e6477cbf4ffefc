"""One table of tolerances for comparing fastcl with the float64 reference.

Used by the tests (small problems, :func:`assert_close`) and by the benchmark's correctness
check at scale (``benchmarks/harness/correctness.py``, ``benchmarks/harness/peers.py``). Errors are relative Frobenius errors ``|got - ref| / |ref|`` against the reference run in
float64 on the *same* (already rounded) inputs. Below float64 the bound is the larger of
the floor below and ``EAGER_FACTOR`` times the error of eager PyTorch computing the
reference in that dtype (flash-attention's rule): a fused kernel may not be worse than
what users have. Where the true value is ~0 (gradients that cancel exactly, an empty
denominator), a tiny RMS absolute error also passes. NaN or inf never passes.

The second rule, :func:`roundoff` and :func:`assert_roundoff`, is for the common test of two
computations of the *same* sums that differ only in their order (another backend, tile,
BLAS kernel or vector width: AVX2 and AVX-512 builds of MKL and of fastcl's C++ sum in
different orders), or of one computation against float64: the bound follows from the
dtype's machine epsilon, the size of the summed terms and the length of the sums, never
from the host.
"""

from __future__ import annotations

import math
import os
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


# Round-off of a reordered sum. Each addition of a length-n sum rounds with a relative error
# of at most eps/2; the errors are independent and of either sign, so they add like a random
# walk: a sum of n terms of size M is off by about eps * M * sqrt(n) in any order (Higham and
# Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019;
# the worst case, n * eps * M, is not met in practice). Two such computations differ by
# the sum of both errors. ROUNDOFF_FACTOR covers that, the tail of the walk over every
# element of a tensor (4 standard deviations of a blocked sum) and the few ulp that exp,
# log, sqrt and division add to each sum. It is small enough that an error of 1e-3 relative
# (a wrong scale, a missing term) fails in float32 for sums up to ~10^4 terms.
ROUNDOFF_FACTOR = 4.0


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of ``dtype`` (the gap between 1 and the next float)."""
    return torch.finfo(dtype).eps


def roundoff(dtype: torch.dtype, terms: int = 1, magnitude: float = 1.0) -> float:
    """``ROUNDOFF_FACTOR * eps(dtype) * magnitude * sqrt(terms)``: how far two orders of a sum
    of ``terms`` terms of size ``magnitude`` computed in ``dtype`` may differ. ``terms`` is the
    length of the reductions behind one element (for a chain, their total: the dot products'
    ``d`` plus the log-sum-exp's ``N``, ...); ``magnitude`` the size of the summed terms, which
    is the result's own size unless the sum cancels (then the terms' size: ``1/tau`` for
    logits, the norm product for a dot product)."""
    return ROUNDOFF_FACTOR * eps(dtype) * magnitude * math.sqrt(max(terms, 1))


def _lower(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def assert_roundoff(
    got,
    want,
    dtype: torch.dtype | None = None,
    *,
    terms: int = 1,
    magnitude: float | None = None,
    out_dtype: torch.dtype | None = None,
    equal_nan: bool = False,
    msg: str | None = None,
) -> None:
    """Fail unless ``got`` and ``want`` (tensors, or tuples/lists of them) agree element-wise
    within the round-off of a reordered sum: ``|got - want| <= atol + rtol * |want|`` with
    ``atol = roundoff(dtype, terms, magnitude)`` and ``rtol = roundoff(dtype, terms)``.

    ``dtype``: the precision the sums ran in (default: the lower of the two tensors' dtypes;
    pass it when ``got`` was cast to float64 for the comparison). ``magnitude``: the size of
    the summed terms (default: ``max |want|`` over its finite entries, i.e. no cancellation;
    ``0`` leaves the relative bound alone). ``out_dtype``: the result was stored in this
    (16-bit) dtype after summing in ``dtype``; its rounding, one or a few roundings of each
    element (autograd adds 16-bit gradients), adds ``roundoff(out_dtype, 1, max|want|)`` and
    ``roundoff(out_dtype)`` to the bounds. Shapes and dtypes must match, as in
    ``torch.testing.assert_close``."""
    if isinstance(got, (tuple, list)):
        assert isinstance(want, (tuple, list)) and len(got) == len(want), f"{msg or ''}: {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_roundoff(
                g,
                w,
                dtype,
                terms=terms,
                magnitude=magnitude,
                out_dtype=out_dtype,
                equal_nan=equal_nan,
                msg=f"{msg or 'item'}[{i}]",
            )
        return
    dt = dtype or (_lower(got.dtype, want.dtype) if got.dtype.is_floating_point else torch.float64)
    finite = want.detach()[torch.isfinite(want.detach())]
    size = finite.abs().max().item() if finite.numel() else 0.0
    if magnitude is None:
        magnitude = size
    rtol = roundoff(dt, terms)
    atol = roundoff(dt, terms, magnitude)
    if out_dtype is not None:
        rtol += roundoff(out_dtype)
        atol += roundoff(out_dtype, 1, size)
    if os.environ.get(ROUNDOFF_LOG_ENV):
        _log_margin(got, want, atol, rtol, msg)
    torch.testing.assert_close(
        got,
        want,
        rtol=rtol,
        atol=atol,
        equal_nan=equal_nan,
        msg=(lambda m: f"{msg}: {m}\n(round-off bound of {dt}: {terms} terms of size {magnitude:.3g})")
        if msg
        else (lambda m: f"{m}\n(round-off bound of {dt}: {terms} terms of size {magnitude:.3g})"),
    )


ROUNDOFF_LOG_ENV = "FASTCL_ROUNDOFF_LOG"


def _log_margin(got, want, atol: float, rtol: float, msg: str | None) -> None:
    """Append ``{"test", "msg", "used"}`` to ``$FASTCL_ROUNDOFF_LOG``: ``used`` is the largest
    ``|got - want| / (atol + rtol |want|)`` (1 = on the bound), to see how much of each bound a
    run uses."""
    import json

    g, w = torch.as_tensor(got).detach().cpu().double(), torch.as_tensor(want).detach().cpu().double()
    ok = torch.isfinite(g) & torch.isfinite(w)
    used = ((g - w).abs()[ok] / (atol + rtol * w.abs()[ok])).max().item() if ok.any() else 0.0
    with open(os.environ[ROUNDOFF_LOG_ENV], "a") as f:
        f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"), "msg": msg, "used": used}) + "\n")


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
