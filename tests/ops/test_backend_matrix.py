"""Every fused backend against the float64 oracles of ``fastcl.reference``.

Values and gradients (anchor, positives, negatives, temperature) on fresh random inputs,
for every LSE loss, odd shapes (d = 1 ... 1024), masks with empty rows, fp32/bf16/fp16
(and fp64), every reduction, cosine and dot similarity, fixed and learnable temperature.
Outputs are poisoned with NaN before each kernel runs (``poison_outputs``), and padded
slots must get exactly zero gradient.

The backends come from ``tests/helpers/backends.py`` (``FASTCL_TEST_BACKENDS``), so the Triton
interpreter suite and a GPU run reuse this file unchanged.
"""

from __future__ import annotations

import functools
import itertools
import zlib

import pytest
import torch

import fastcl.losses as L
from fastcl import reference as R
from fastcl.ops.contract import poison_outputs
from fastcl.testing import assert_close, close_bound, loss_terms
from tests.helpers.backends import backends_under_test, device_under_test, require, small_only
from tests.helpers.roundoff import grad_term_size

SMALL_SHAPES = [  # (B, P, Q, d)
    (1, 1, 0, 1),
    (2, 1, 1, 3),
    (3, 2, 0, 7),
    (5, 3, 2, 16),
    (7, 1, 7, 33),
    (4, 7, 3, 5),
]
LARGE_SHAPES = [
    (17, 5, 5, 65),
    (33, 4, 6, 257),
    (9, 2, 1, 1024),
    (64, 5, 5, 128),
    (130, 1, 1, 24),
    (6, 6, 4, 1000),
]
SHAPES = SMALL_SHAPES if small_only() else SMALL_SHAPES + LARGE_SHAPES
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

# loss name -> (fastcl function, oracle, input family)
LOSSES = {
    "supmpn": (L.supmpn_loss, R.supmpn, "structured"),
    "supmpn_zero_logit": (
        functools.partial(L.supmpn_loss, own_positives="zero_logit"),
        functools.partial(R.supmpn, own_positives="zero_logit"),
        "structured",
    ),
    "supcon": (L.supcon_loss, R.supcon, "structured"),
    "mnrl": (L.mnrl_loss, R.mnrl, "pair"),
    "infonce_sym": (
        functools.partial(L.infonce_loss, symmetric=True),
        functools.partial(R.infonce, symmetric=True),
        "two_views",
    ),
    "edacse": (L.edacse_loss, R.edacse, "three_views"),
}


def _cases():
    """A deterministic spread over the option space (not the full product, to stay fast)."""
    reductions = itertools.cycle(["mean", "sum", "none"])
    options = itertools.cycle(
        [
            dict(masks=True, similarity="cos", learn_tau=False),
            dict(masks=False, similarity="cos", learn_tau=True),
            dict(masks=True, similarity="dot", learn_tau=True),
            dict(masks=True, similarity="cos", learn_tau=True),
            dict(masks=False, similarity="dot", learn_tau=False),
        ]
    )
    for loss in LOSSES:
        for shape in SHAPES:
            for dtype in DTYPES:
                if dtype == torch.float64 and shape[3] > 128:
                    continue
                opt = next(options)
                yield pytest.param(
                    loss,
                    shape,
                    dtype,
                    next(reductions),
                    opt,
                    id=f"{loss}-B{shape[0]}P{shape[1]}Q{shape[2]}d{shape[3]}-{str(dtype)[6:]}-"
                    + "-".join(f"{k}={v}" for k, v in opt.items()),
                )


def _masks(B: int, n: int, gen: torch.Generator, device) -> torch.Tensor:
    """Random validity with an empty row (row 0) whenever B > 1."""
    m = torch.rand(B, n, generator=gen) > 0.3
    if B > 1:
        m[0] = False
    return m.to(device)


def _inputs(family, shape, dtype, opt, gen, device):
    B, P, Q, d = shape
    scale = d**-0.5 if opt["similarity"] == "dot" else 1.0  # keep dot logits O(1)

    def emb(*s):
        return (torch.randn(*s, generator=gen) * scale).to(device=device, dtype=dtype)

    if family == "structured":
        t = dict(anchor=emb(B, d), positives=emb(B, P, d), negatives=emb(B, Q, d) if Q else None)
        kw = {}
        if opt["masks"]:
            kw["pos_mask"] = _masks(B, P, gen, device)
            kw["pos_mask"][-1, 0] = True  # some anchor keeps a positive
            if Q:
                kw["neg_mask"] = _masks(B, Q, gen, device)
        return t, kw
    if family == "pair":
        t = dict(anchor=emb(B, d), positive=emb(B, d), negatives=emb(B, Q, d) if Q else None)
        kw = {"neg_mask": _masks(B, Q, gen, device)} if opt["masks"] and Q else {}
        return t, kw
    if family == "two_views":
        return dict(anchor=emb(B, d), positive=emb(B, d)), {}
    return dict(anchor=emb(B, d), dropout_view=emb(B, d), augmented_view=emb(B, d)), {}


def _rows_counted(family, kw, B: int) -> int:
    """The rows a mean divides by: the anchors with a valid positive (at least 1)."""
    if family == "structured" and "pos_mask" in kw:
        return max(int(kw["pos_mask"].any(1).sum()), 1)
    return B


def _run(fn, tensors, kw, tau, reduction, similarity, upstream, **extra):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in tensors.items() if v is not None}
    args = {**{k: None for k in tensors}, **leaves}
    t = tau.detach().clone().requires_grad_(True) if isinstance(tau, torch.Tensor) else tau
    out = fn(**args, **kw, temperature=t, reduction=reduction, similarity=similarity, **extra)
    scalar = (out.double() * upstream).sum() if reduction == "none" else out.double()
    wrt = list(leaves.values()) + ([t] if isinstance(t, torch.Tensor) else [])
    grads = torch.autograd.grad(scalar, wrt)
    names = list(leaves) + (["temperature"] if isinstance(t, torch.Tensor) else [])
    return out, dict(zip(names, grads))


def _backend_params():
    names = backends_under_test()
    # the chunked torch backend again with tiles of a few rows, to cross block edges
    return names + (["torch/tiny-tiles"] if "torch" in names else [])


@pytest.fixture(params=_backend_params())
def backend(request, fastcl_config):
    name, _, variant = request.param.partition("/")
    require(name)
    if variant == "tiny-tiles":
        fastcl_config(torch={"tile": 97})
    return name


@pytest.mark.parametrize("loss, shape, dtype, reduction, opt", list(_cases()))
def test_loss_matches_reference(backend, loss, shape, dtype, reduction, opt):
    device = device_under_test()
    if dtype == torch.float16 and device.type == "cpu" and shape[3] > 300 and small_only():
        pytest.skip("fp16 on CPU at large d is slow under the interpreter")
    fn, oracle, family = LOSSES[loss]
    seed = zlib.crc32(f"{loss}{shape}{dtype}{reduction}{opt}".encode()) ^ torch.initial_seed()
    gen = torch.Generator().manual_seed(seed % 2**63)
    tensors, kw = _inputs(family, shape, dtype, opt, gen, device)
    tau_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    tau = torch.tensor(0.07 if opt["similarity"] == "cos" else 1.3, dtype=tau_dtype) if opt["learn_tau"] else 0.05
    if opt["similarity"] == "dot" and not opt["learn_tau"]:
        tau = 1.0
    B = shape[0]
    # exactly representable in the loss dtype: autograd rounds the upstream gradient of a
    # low-precision output, which would otherwise be an error of the test, not the backend
    upstream = torch.randn(B, generator=gen).to(dtype).to(device=device, dtype=torch.float64)

    with poison_outputs():
        got, got_g = _run(fn, tensors, kw, tau, reduction, opt["similarity"], upstream, backend=backend)
    ref, ref_g = _run(
        oracle,
        {k: None if v is None else v.double() for k, v in tensors.items()},
        kw,
        tau.double() if isinstance(tau, torch.Tensor) else tau,
        reduction,
        opt["similarity"],
        upstream,
    )
    eager, eager_g = (None, {})
    if dtype != torch.float64:  # eager PyTorch in the same dtype sets the error bound
        eager, eager_g = _run(oracle, tensors, kw, tau, reduction, opt["similarity"], upstream)

    assert got.dtype == dtype
    # the logits' size: 1/tau for cosine, max |a| |c| / tau for dot products
    norms = [t.double().norm(dim=-1).max().item() for t in tensors.values() if t is not None and t.numel()]
    logit_scale = (1.0 if opt["similarity"] == "cos" else max(norms) ** 2) / float(tau)
    # a row's candidates are at most every input row (anchors included, for SupCon)
    rows = sum(t.numel() // t.shape[-1] for t in tensors.values() if t is not None)
    terms = loss_terms(B, rows, shape[3])
    # d tau sums the rows' logit differences (size 1/tau each) times 1/tau, weighted by the
    # reduction: total weight 1 (mean), B (sum), sum |upstream| (none)
    weight = {"mean": 1.0, "sum": float(B), "none": upstream.abs().sum().item()}[reduction]
    # an embedding's gradient sums terms of one row's weight (1/rows for a mean) that may cancel
    row_weight = {"mean": 1.0 / _rows_counted(family, kw, B), "sum": 1.0, "none": upstream.abs().max().item()}
    term = grad_term_size(
        tensors.values(), similarity=opt["similarity"], tau=float(tau), row_weight=row_weight[reduction]
    )
    # a value sums logits (size logit_scale) and a log-sum-exp of normalised terms (size 1): a zero
    # logit or tiny dot-product logits leave the latter
    assert_close("loss", got, ref, dtype, eager, terms=terms, magnitude=logit_scale + 1.0)
    for name, g in ref_g.items():
        assert_close(
            f"d {name}",
            got_g[name],
            g,
            dtype,
            eager_g.get(name),
            terms=terms,
            # d tau: terms of size weight / tau^2, its 16-bit row weights stored; an embedding's
            # gradient: relative error eps / tau, or that of its terms where they cancel
            magnitude=weight * logit_scale**2 if name == "temperature" else term * logit_scale,
            logit_scale=1.0 if name == "temperature" else logit_scale,
            stored=weight * logit_scale**2 if name == "temperature" else 0.0,
        )
        if name != "temperature":
            assert got_g[name].dtype == dtype
    # padded slots: exactly zero gradient
    if "pos_mask" in kw:
        assert (got_g["positives"][~kw["pos_mask"]] == 0).all()
    if "neg_mask" in kw:
        key = "negatives"
        assert (got_g[key][~kw["neg_mask"]] == 0).all()


def test_every_dtype_has_a_bound():
    """The bounds follow from each dtype's epsilon (fastcl.testing): none is zero or infinite."""
    for dtype in DTYPES:
        b = close_bound(torch.ones(3, dtype=torch.float64), dtype, terms=loss_terms(4, 8, 16), logit_scale=20.0)
        assert 0 < b < 1
