"""Round-off bounds for the common comparison of the suite: a loss and its gradients computed
twice by the same sums in a different order (another backend, tile, BLAS kernel, vector width
or process), or once against float64.

The rule is ``fastcl.testing.roundoff``: ``ROUNDOFF_FACTOR * eps(dtype) * magnitude *
sqrt(terms)``. For a contrastive loss the sums behind one number are a logit's ``d``
coordinates, a row's ``N`` candidates and a candidate's ``B`` anchors (``terms = d + N + B``),
and the logits, of size ``1/tau`` (cosine; ``|a| |c| / tau`` for dot products), carry the
largest round-off: ``eps / tau`` is an absolute error of a loss value and a relative error of
the softmax weights, hence of every gradient (``magnitude = max|gradient| / tau``). The
temperature's gradient sums ``B`` rows' logit differences times ``1/tau``: terms of size
``1/tau^2``, which may cancel.
"""

from __future__ import annotations

import torch

from fastcl.testing import assert_roundoff

HALF = (torch.float16, torch.bfloat16)


def sums_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the sums run in: float32 for 16-bit inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def assert_loss_roundoff(got, want, dtype: torch.dtype, *, terms: int, logit_scale: float, msg: str = "loss") -> None:
    """A loss (or per-row losses): absolute error ``eps * logit_scale`` per sum, plus the
    rounding of a 16-bit output (``out_dtype`` of ``assert_roundoff``). ``dtype``: the
    inputs' (16-bit inputs sum in float32)."""
    _assert(got, want, dtype, terms, logit_scale, msg)


def assert_grad_roundoff(
    got, want, dtype: torch.dtype, *, terms: int, logit_scale: float, term_size: float = 0.0, msg: str = "grad"
) -> None:
    """A gradient: relative error ``eps * logit_scale`` of its size, ``max|want|`` or the size of
    its terms (``term_size``) when they cancel."""
    size = want.detach().abs().max().item() if want.numel() else 0.0
    _assert(got, want, dtype, terms, max(size, term_size) * logit_scale, msg)


def assert_tau_grad_roundoff(got, want, dtype: torch.dtype, *, terms: int, logit_scale: float, rows: float) -> None:
    """The temperature's gradient: ``rows`` (the reduction weights' sum: 1 for a mean, B for a
    sum) terms of size ``logit_scale^2``."""
    _assert(got, want, dtype, terms, rows * logit_scale**2, "d temperature")


def _assert(got, want, dtype, terms, magnitude, msg) -> None:
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    out = got.dtype if got.dtype in HALF else None  # stored in 16 bits after float32 sums
    assert_roundoff(
        got.double(), want.double(), sums_dtype(dtype), terms=terms, magnitude=magnitude, out_dtype=out, msg=msg
    )


def assert_loss_and_grads_roundoff(
    got, want, got_grads, want_grads, dtype: torch.dtype, *, terms: int, logit_scale: float
) -> None:
    """A loss and its gradients (in order) computed twice: :func:`assert_loss_roundoff` and
    :func:`assert_grad_roundoff` for each."""
    assert_loss_roundoff(got, want, dtype, terms=terms, logit_scale=logit_scale)
    assert len(got_grads) == len(want_grads)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert_grad_roundoff(g, w, dtype, terms=terms, logit_scale=logit_scale, msg=f"grad {i}")


def grad_term_size(inputs, *, similarity: str, tau: float, row_weight: float) -> float:
    """The RMS coordinate of a term ``w_i p_ij d logit_ij / d x`` of an embedding's gradient (a
    Frobenius bound compares RMS errors), for gradients whose terms cancel (exactly, for a row
    with one candidate): the row's reduction weight ``w_i`` times ``1 / (tau min|x| sqrt(d))``
    for cosine (``d logit / d a = (c^ - cos a^) / (tau |a|)``, whose norm is at most
    ``1 / (tau |a|)``) or ``max|c| / (tau sqrt(d))`` for dot products (``c / tau``). Since the
    weights ``p_ij`` of a row sum to 1, a relative error ``e`` of each gives the row's gradient
    an error of at most ``e`` times that. ``inputs``: the embeddings, rows on the last axis."""
    rows = [t.detach().double() for t in inputs if t is not None and t.numel()]
    if not rows:
        return 0.0
    d = rows[0].shape[-1]
    norms = [t.norm(dim=-1) for t in rows]
    if similarity == "cos":
        smallest = min(n.min().item() for n in norms)
        return row_weight / (tau * smallest * d**0.5) if smallest > 0 else 0.0
    return row_weight * max(n.max().item() for n in norms) / (tau * d**0.5)
