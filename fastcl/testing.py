"""Tolerances for comparing fastcl's floats, derived from the dtype's round-off, the lengths of
the sums and the magnitudes involved: never a per-host or per-dtype constant (a test that
passes on an AVX-512 host and fails on an AVX2 one, whose MKL and C++ sum in other orders, is a
defect).

Every bound is built from one rule, :func:`roundoff`::

    roundoff(dtype, terms, magnitude) = ROUNDOFF_FACTOR * eps(dtype) * magnitude * sqrt(terms)

- ``eps(dtype)``: the dtype's machine epsilon. The sums run in :func:`sums_dtype` (float32 for
  16-bit inputs: every backend, GEMM and eager reduction accumulates in float32).
- ``terms``: the length of the reductions behind one number, added along a chain. For a
  contrastive loss (:func:`loss_terms`): a logit sums ``d`` coordinates, a row's log-sum-exp
  ``N`` candidates, a candidate's gradient ``B`` anchors: ``d + N + B``.
- ``magnitude``: the size of the summed terms. A logit is ``|a| |c| / tau``: ``1 / tau`` for
  cosine, the *logit scale*. Its round-off ``eps / tau`` is an *absolute* error of a loss value
  (``lse - logit``: ``magnitude = logit_scale``) and a *relative* one of the softmax weights,
  so of every gradient (``logit_scale`` multiplies the relative bound), or, where a gradient's
  terms cancel (softmax minus the positives' indicator), an absolute one of the terms' size
  (``magnitude = term * logit_scale``). The temperature's gradient sums the reduction's rows'
  logit differences times ``1/tau``: terms of size ``1/tau^2`` times the reduction's total
  weight (1 for a mean, ``B`` for a sum), which may cancel.
- :func:`storage`: a result stored in a 16-bit dtype after its float32 sums is rounded once
  (or a few times: autograd adds 16-bit partial gradients): ``roundoff(dtype)`` relative. So
  are 16-bit intermediates summed into a result (a per-row loss's upstream weight, e.g.
  ``lam * loss`` in bfloat16): ``roundoff(dtype)`` times their size, absolute. Below the
  dtype's normal range (``finfo.tiny``, 6e-5 in float16: a mean's gradients over thousands of
  rows) the spacing is absolute: ``roundoff(dtype) * tiny``.

Two ways to use it:

1. :func:`assert_close`, against the float64 reference on the *same* (already rounded) inputs,
   as a relative Frobenius error: ``|got - ref|_F <= rtol |ref|_F + atol sqrt(numel)`` (the
   Frobenius form of ``atol + rtol |ref|`` element-wise) with
   ``atol = roundoff(sums_dtype, terms, magnitude)`` and
   ``rtol = roundoff(sums_dtype, terms) * logit_scale + storage(dtype)``. Below float64 a result no worse
   than ``EAGER_FACTOR`` times eager PyTorch's own error on the same inputs also passes
   (flash-attention's rule: a fused kernel may not be worse than what users have; measured
   on the same host, so not host-dependent). NaN or inf never passes.
   At benchmark scale (``benchmarks/harness/correctness.py``, ``peers.py``) the same terms,
   each charged at its own size (a logit's ``d`` products at ``logit_scale``, the ``N + B``
   sums of weights at 1), give :func:`value_tol` and :func:`grad_rtol` from the workload's
   ``B``, ``N``, ``d``: below 1e-3 in float32 at tau = 0.05 and B = N = 16384, d = 768.
2. :func:`assert_roundoff`, element-wise, for two computations of the *same* sums that differ
   only in their order (another backend, tile, BLAS kernel or vector width), or one
   computation against float64.

Both can fail (``tests/test_roundoff.py``): on an InfoNCE step of B = 64, d = 256, tau = 0.05
an error of 1e-3 relative in float32 (a wrong scale) exceeds the value's bound 20x and the
gradients' 2.5x, a missing term fails, and so do a few ulps in 16 bits (5e-2 in bfloat16, 1e-2
in float16). A gradient's relative bound grows as ``eps sqrt(terms) / tau``: at tau = 0.01 and
a few hundred terms it approaches 1e-3 (``tests/losses/test_api_precision.py``).
"""

from __future__ import annotations

import math
import os

import torch

HALF = (torch.float16, torch.bfloat16)
# Below float64, a fused result may be as far from float64 as EAGER_FACTOR times eager
# PyTorch's own error in that dtype (flash-attention's test rule), whatever the floor.
EAGER_FACTOR = 4.0


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
    g, w = torch.as_tensor(got).detach().cpu().double(), torch.as_tensor(want).detach().cpu().double()
    ok = torch.isfinite(g) & torch.isfinite(w)
    used = ((g - w).abs()[ok] / (atol + rtol * w.abs()[ok])).max().item() if ok.any() else 0.0
    _log_used(msg, used)


def _log_used(msg: str | None, used: float, **more) -> None:
    import json

    rec = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?"), "msg": msg, "used": used, **more}
    with open(os.environ[ROUNDOFF_LOG_ENV], "a") as f:
        f.write(json.dumps(rec) + "\n")


def _ratio(diff: float, bound: float) -> float:
    return diff / bound if bound > 0 else (0.0 if diff == 0 else math.inf)


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


def sums_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the sums run in: float32 for 16-bit inputs (float32 accumulation), else ``dtype``."""
    return torch.float32 if dtype in HALF else dtype


def storage(dtype: torch.dtype) -> float:
    """Relative error of storing a float32 result in ``dtype``: ``roundoff(dtype)`` for a 16-bit
    dtype (one rounding, or a few where autograd adds 16-bit partial gradients), 0 otherwise
    (the sums' own bound covers the last rounding)."""
    return roundoff(dtype) if dtype in HALF else 0.0


def loss_terms(B: int, N: int, d: int) -> int:
    """Reduction length behind a contrastive loss's numbers: a logit's ``d`` coordinates, a
    row's ``N`` candidates, a candidate's gradient over ``B`` anchors."""
    return d + N + B


def close_tolerance(
    dtype: torch.dtype, terms: int, magnitude: float, stored: float = 0.0, logit_scale: float = 1.0
) -> tuple[float, float]:
    """``(atol, rtol)`` of a result computed in ``dtype`` against float64: the round-off of sums
    of ``terms`` terms of size ``magnitude`` in :func:`sums_dtype` (absolute) and of the result's
    own size times ``logit_scale`` (relative: the softmax weights' error), and the :func:`storage` in
    ``dtype`` of the result (relative) and of 16-bit intermediates of size ``stored`` summed
    into it (absolute: per-row losses and their upstream weights kept in ``dtype`` by autograd,
    whose sum may cancel, as the temperature's gradient does), and of subnormal results."""
    dt = sums_dtype(dtype)
    # below the dtype's normal range (tiny) its spacing is eps * tiny, absolute: the storage of
    # small results (a mean's gradients in float16) is bounded by storage(dtype) * tiny
    absolute = storage(dtype) * (stored + torch.finfo(dtype).tiny)
    return roundoff(dt, terms, magnitude) + absolute, roundoff(dt, terms) * logit_scale + storage(dtype)


def value_tol(dtype: torch.dtype, *, B: int, N: int, d: int, logit_scale: float) -> tuple[float, float]:
    """``(atol, rtol)`` of a loss value (a mean over ``B`` rows of ``N`` candidates, logits of
    size ``logit_scale``) at benchmark scale. The chain's terms are charged at their own sizes:
    a logit's ``d`` products give it an absolute error ``roundoff(sums, d, logit_scale)``, which
    passes to ``lse - logit`` unchanged; the row's ``N`` exp terms and the mean's ``B`` rows are
    sums of unit relative size (``roundoff(sums, N + B)``, absolute in the log, relative in the
    mean). Charging all ``d + N + B`` at ``logit_scale`` (:func:`close_tolerance`) would be
    ``sqrt((d + N + B) / d)`` times looser: at B = N = 16384, d = 768, tau = 0.05 it admits a
    1e-3 error in float32, this bound (3.5e-4) does not. For a 16-bit dtype, plus logits stored
    once in that dtype (eager PyTorch's and most peers' GEMM output), ``roundoff(dtype, B,
    logit_scale / B)``: ``B`` independent roundings of size ``eps * logit_scale`` averaged by
    the mean, and the value's own storage."""
    dt = sums_dtype(dtype)
    atol = roundoff(dt, d, logit_scale) + roundoff(dt, N + B)
    rtol = roundoff(dt, N + B) + storage(dtype)
    if dtype in HALF:
        atol += roundoff(dtype, B, logit_scale / B)
    return atol, rtol


def grad_rtol(dtype: torch.dtype, *, B: int, N: int, d: int, logit_scale: float) -> float:
    """Relative Frobenius error of a gradient at benchmark scale: the logits' absolute round-off
    ``roundoff(sums, d, logit_scale)`` is a relative error of the softmax weights, hence of the
    gradients; the weights' normaliser (``N`` terms) and the gradient GEMMs' sums (``N`` or
    ``B`` terms) add ``roundoff(sums, N + B)`` relative; and the :func:`storage` in ``dtype``
    (terms charged at their own sizes, as in :func:`value_tol`)."""
    dt = sums_dtype(dtype)
    return roundoff(dt, d) * logit_scale + roundoff(dt, N + B) + storage(dtype)


def close_bound(
    ref: torch.Tensor,
    dtype: torch.dtype,
    *,
    terms: int | None = None,
    magnitude: float | None = None,
    logit_scale: float = 1.0,
    stored: float = 0.0,
) -> float:
    """The largest ``|got - ref|_F`` :func:`assert_close` accepts without the eager rule:
    ``rtol |ref|_F + atol sqrt(numel)`` with ``(atol, rtol) = close_tolerance(dtype, terms,
    magnitude, stored, logit_scale)``. Defaults: ``terms``, the sum of ``ref``'s dimensions (the
    rows and the width a tensor of that shape is summed over; pass the real lengths, e.g.
    :func:`loss_terms`, and always for a scalar); ``magnitude``, ``max |ref|`` (no
    cancellation). A loss value passes ``magnitude=logit_scale``; a gradient ``logit_scale``
    (its relative error is ``logit_scale`` times the sums') and, where its terms cancel,
    ``magnitude = term size * logit_scale``."""
    r = ref.detach().double()
    if terms is None:
        terms = max(sum(r.shape), 1)
    if magnitude is None:
        magnitude = r.abs().max().item() if r.numel() else 0.0
    atol, rtol = close_tolerance(dtype, terms, magnitude, stored, logit_scale)
    return rtol * r.norm().item() + atol * math.sqrt(r.numel())


def assert_close(
    name: str,
    got,
    ref,
    dtype: torch.dtype,
    eager=None,
    *,
    terms: int | None = None,
    magnitude: float | None = None,
    logit_scale: float = 1.0,
    stored: float = 0.0,
) -> None:
    """Fail unless ``got`` matches the float64 ``ref`` within :func:`close_bound` (relative
    Frobenius error; see the module docstring), or, below float64, within ``EAGER_FACTOR``
    times the error of ``eager`` (the same computation in eager PyTorch in ``dtype``).
    ``dtype``: the inputs' dtype; ``terms``, ``magnitude``, ``logit_scale``, ``stored``: as in
    :func:`close_bound`."""
    assert got is not None, f"{name}: no value (gradient missing?)"
    assert tuple(got.shape) == tuple(ref.shape), f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if not torch.isfinite(torch.as_tensor(got)).all():
        raise AssertionError(f"{name}: not finite ({dtype})")
    diff = (got.detach().double() - ref.detach().double()).norm().item()
    floor = b = close_bound(ref, dtype, terms=terms, magnitude=magnitude, logit_scale=logit_scale, stored=stored)
    scale = ref.detach().double().norm().item()
    if eager is not None and dtype != torch.float64:
        eager_err = rel_err(eager, ref)
        if math.isfinite(eager_err):
            b = max(b, EAGER_FACTOR * eager_err * scale)
    if os.environ.get(ROUNDOFF_LOG_ENV):  # of the whole bound, and of the derived floor alone
        _log_used(name, _ratio(diff, b), of_floor=_ratio(diff, floor), dtype=str(dtype))
    if diff <= b:
        return
    raise AssertionError(
        f"{name}: |got - ref| {diff:.3e} > bound {b:.3e} ({dtype}, {terms} terms; relative error "
        f"{diff / scale if scale else math.inf:.3e} > {b / scale if scale else math.inf:.3e})"
    )
