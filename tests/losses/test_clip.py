"""CLIP and SigLIP: parity with open-clip-torch's own loss code, the float64 oracle, options and errors.

open_clip's ``ClipLoss`` / ``SigLipLoss`` (loaded from the installed package's ``loss.py``)
are the oracle in float64; fastcl's drop-ins (``fastcl.integrations.open_clip``) and
functions must give the same value and every gradient (both feature tensors, ``logit_scale``,
``logit_bias``) on raw and normalised features, ``B = 1`` and odd ``B``, with and without
the bias, on every backend. Lower precisions are held to the dtype's bound against that
oracle (``fastcl.testing``). Several processes: tests/distributed/test_clip_distributed.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fastcl.losses as L
from fastcl.integrations import open_clip as foc
from fastcl.ops.dispatch import BackendUnavailableError
from fastcl.testing import assert_close, loss_terms
from tests.helpers.backends import backends_under_test, device_under_test, require
from tests.helpers.open_clip import require_open_clip
from tests.helpers.roundoff import grad_term_size

BACKENDS = ["reference", *backends_under_test()]


@pytest.fixture(params=BACKENDS)
def backend(request):
    require(request.param)
    return request.param


def _features(B, d, seed, *, normalised, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    img, txt = torch.randn(B, d, generator=g, dtype=torch.float64), torch.randn(B, d, generator=g, dtype=torch.float64)
    if normalised:
        img, txt = F.normalize(img, dim=-1), F.normalize(txt, dim=-1)
    txt = txt + 0.5 * img  # pairs that agree, as after some training
    dev = device_under_test()
    return img.to(dev, dtype).requires_grad_(), txt.to(dev, dtype).requires_grad_()


def _sizes(img, txt, scale, bias=0.0) -> tuple[int, float]:
    """``(terms, logit size)``: a logit sums ``d`` products, a row and a column ``B`` each
    (fastcl.testing.loss_terms); the logits are ``scale |img| |txt| + |bias|`` at most."""
    B, d = img.shape
    n = img.detach().double().norm(dim=-1).max() * txt.detach().double().norm(dim=-1).max()
    return loss_terms(B, B, d), float(scale) * n.item() + abs(float(bias))


def _close(name, got, want, dtype, img, txt, scale, bias=0.0, *, grad: bool, eager=None):
    """A value (absolute error of the logits' size) or a gradient (relative, times it, of its
    terms: a mean's row weight 1/B times ``scale |x|``, which cancel exactly at B = 1)."""
    terms, logits = _sizes(img, txt, scale, bias)
    kw: dict = dict(magnitude=logits)
    if grad:
        term = grad_term_size((img, txt), similarity="dot", tau=1 / float(scale), row_weight=1 / img.shape[0])
        kw = dict(magnitude=term * logits, logit_scale=logits)
    assert_close(name, got, want, dtype, eager, terms=terms, **kw)


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def _scale_bias(with_bias: bool):
    dev = device_under_test()
    t = torch.tensor(math.exp(2.3), dtype=torch.float64, device=dev, requires_grad=True)
    b = torch.tensor(-4.0, dtype=torch.float64, device=dev, requires_grad=True) if with_bias else None
    return t, b


@pytest.mark.parametrize("B", [1, 7, 32])
@pytest.mark.parametrize("normalised", [True, False], ids=["normalised", "raw"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_drop_in_equals_open_clip(backend, B, normalised, with_bias, loss):
    oc = require_open_clip()
    img, txt = _features(B, 9, B * 7 + normalised, normalised=normalised)
    t, b = _scale_bias(with_bias)
    if loss == "siglip":
        theirs, ours = oc.SigLipLoss(), foc.SigLipLoss(backend=backend)
        b = b if b is not None else torch.zeros((), dtype=torch.float64, device=img.device, requires_grad=True)
    else:
        theirs, ours = oc.ClipLoss(), foc.ClipLoss(backend=backend)
    leaves = [x for x in (img, txt, t, b) if x is not None]
    want = theirs(img, txt, t, b)
    got = ours(img, txt, t, b)
    assert got.dtype == want.dtype and got.shape == want.shape
    _close(f"{loss} loss", got, want, torch.float64, img, txt, t.item(), 0.0 if b is None else b.item(), grad=False)
    for name, g, w in zip(
        ("d image", "d text", "d logit_scale", "d logit_bias"), _grads(got, leaves), _grads(want, leaves)
    ):
        if w is None:  # open_clip's ClipLoss: the bias cancels, its gradient is (rounding of) 0
            assert g is None or g.abs().max() <= 1e-12, name
            continue
        # d logit_scale sums the logits over the scale (terms |img| |txt|), as d bias sums the
        # softmax or sigmoid weights: both are values of the logits' size, not gradients
        bias = 0.0 if b is None else b.item()
        _close(f"{loss} {name}", g, w, torch.float64, img, txt, t.item(), bias, grad=g.dim() > 0)
    as_dict = ours(img, txt, t, b, output_dict=True)
    assert set(as_dict) == {"contrastive_loss"} and torch.equal(as_dict["contrastive_loss"], got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_lower_precision_within_the_dtype_bound(backend, dtype, loss):
    """Values and gradients against open_clip in float64 on the same rounded inputs, within
    the dtype's bound (at most EAGER_FACTOR times open_clip's own error in that dtype)."""
    if backend == "reference" and dtype != torch.float32:
        pytest.skip("the reference computes in float32 for bf16/fp16 inputs like any backend: covered once")
    oc = require_open_clip()
    img, txt = _features(37, 64, 3, normalised=True, dtype=dtype)
    t, b = 20.0, -5.0
    fn = L.siglip_loss if loss == "siglip" else L.clip_loss
    peer = oc.SigLipLoss() if loss == "siglip" else oc.ClipLoss()
    got = fn(img, txt, t, b, similarity="dot", backend=backend)
    got_g = _grads(got, (img, txt))
    leaves64 = [x.detach().double().requires_grad_() for x in (img, txt)]
    want = peer(*leaves64, torch.tensor(t, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
    want_g = _grads(want, leaves64)
    leaves_lp = [x.detach().requires_grad_() for x in (img, txt)]
    eager = peer(*leaves_lp, torch.tensor(t, dtype=dtype), torch.tensor(b, dtype=dtype))
    eager_g = _grads(eager, leaves_lp)
    _close(f"{loss} {dtype}", got.float(), want, dtype, img, txt, t, b, grad=False, eager=eager.float())
    for name, g, w, e in zip(("d image", "d text"), got_g, want_g, eager_g):
        _close(f"{loss} {dtype} {name}", g.float(), w, dtype, img, txt, t, b, grad=True, eager=e.float())


def test_reductions_and_mask(backend):
    """``none`` gives open_clip's per-image terms; a padded pair is the batch without it (value,
    and exactly zero gradient for both of its features), for both losses."""
    img, txt = _features(9, 5, 11, normalised=False)
    mask = torch.tensor([True, True, False, True, True, True, False, True, True], device=img.device)
    keep = mask.nonzero().squeeze(1)
    for fn, extra in ((L.siglip_loss, dict(logit_bias=-1.0)), (L.clip_loss, {})):
        rows = fn(img, txt, 3.0, reduction="none", backend=backend, **extra)
        assert rows.shape == (9,)
        total = fn(img, txt, 3.0, reduction="sum", backend=backend, **extra)
        _close("sum = sum of rows", total, rows.sum(), torch.float64, img, txt, 3.0, 1.0, grad=False)
        masked = fn(img, txt, 3.0, mask=mask, backend=backend, **extra)
        sub = fn(img[keep], txt[keep], 3.0, backend=backend, **extra)
        _close(
            "masked = the batch without the padded pairs", masked, sub, torch.float64, img, txt, 3.0, 1.0, grad=False
        )
        d_img, d_txt = _grads(masked, (img, txt))
        assert (d_img[~mask] == 0).all() and (d_txt[~mask] == 0).all()
        assert d_img[mask].abs().sum() > 0


def test_siglip_matryoshka_is_the_sum_over_prefixes(backend):
    img, txt = _features(6, 12, 5, normalised=False)
    dims, weights = (12, 4, 8), (1.0, 0.5, 2.0)
    got = L.siglip_loss(img, txt, 5.0, -2.0, matryoshka_dims=dims, matryoshka_weights=weights, backend=backend)
    want = sum(w * L.siglip_loss(img[:, :m], txt[:, :m], 5.0, -2.0, backend="reference") for m, w in zip(dims, weights))
    weight = sum(weights)  # the prefixes' sums add up with these weights
    _close("matryoshka value", got, want, torch.float64, img, txt, 5.0 * weight, 2.0 * weight, grad=False)
    for g, w in zip(_grads(got, (img, txt)), _grads(want, (img, txt))):
        _close("matryoshka grad", g, w, torch.float64, img, txt, 5.0 * weight, 2.0 * weight, grad=True)


def test_strategies_agree(backend):
    """Fused (gradient in forward) and recompute give the same values and gradients."""
    from fastcl.ops import dispatch

    if dispatch.get(backend).fused is None:
        pytest.skip(f"the {backend} backend has no fused sweep (recompute only)")
    img, txt = _features(11, 8, 2, normalised=False)
    out = []
    for strategy in ("fused", "recompute"):
        loss = L.siglip_loss(img, txt, 4.0, 1.0, backend=backend, strategy=strategy)
        out.append((loss, *_grads(loss, (img, txt))))
    for a, b in zip(*out):
        _close("fused vs recompute", a, b, torch.float64, img, txt, 4.0, 1.0, grad=a.dim() > 0)


def test_module_forms():
    img, txt = _features(5, 6, 1, normalised=False)
    assert torch.equal(L.SigLipLoss()(img, txt, 2.0, -1.0), L.siglip_loss(img, txt, 2.0, -1.0))
    assert torch.equal(L.ClipLoss(similarity="dot")(img, txt, 2.0), L.clip_loss(img, txt, 2.0, similarity="dot"))


@pytest.mark.parametrize("fn", [L.clip_loss, L.siglip_loss])
def test_bad_input(fn):
    img, txt = _features(4, 6, 0, normalised=True)
    with pytest.raises(ValueError, match=r"both be \[B, d\]"):
        fn(img, txt[:3], 2.0)
    with pytest.raises(ValueError, match=r"both be \[B, d\]"):
        fn(img, txt[:, :5], 2.0)
    for bad in (0.0, -1.0, math.inf, math.nan, torch.tensor(-2.0), torch.tensor(math.nan)):
        with pytest.raises(ValueError, match="logit_scale must be finite and > 0"):
            fn(img, txt, bad)
    with pytest.raises(ValueError, match="logit_bias must be finite"):
        fn(img, txt, 2.0, math.inf)
    with pytest.raises(TypeError, match="logit_scale"):
        fn(img, txt, "2")
    with pytest.raises(TypeError, match="one dtype"):
        fn(img, txt.float(), 2.0)


def test_drop_in_refusals():
    img, txt = _features(4, 6, 0, normalised=True)
    with pytest.raises(ValueError, match="Horovod"):
        foc.ClipLoss(use_horovod=True)
    with pytest.raises(ValueError, match="dist_impl"):
        foc.SigLipLoss(dist_impl="allreduce")
    with pytest.raises(ValueError, match="needs logit_bias"):
        foc.SigLipLoss()(img, txt, 2.0, None)
    with pytest.raises(RuntimeError, match="initialised"):
        foc.SigLipLoss(rank=0, world_size=2)(img, txt, 2.0, 0.0)
    with pytest.raises(ValueError, match="local_loss=True and gather_with_grad=True"):
        foc.ClipLoss(cross_device="ring")
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        L.siglip_loss(img, txt, 2.0, backend="nope")


def test_clip_symmetric_step_equals_the_two_directions(backend):
    """Where the backend computes column statistics the unmasked one-process CLIP loss takes the
    symmetric step (one forward pass for both directions); ``strategy="fused"`` keeps the two
    directional calls: the same values and gradients either way."""
    from fastcl.ops import symmetric

    img, txt = _features(23, 10, 4, normalised=False)
    t = torch.tensor(6.0, dtype=torch.float64, requires_grad=True)
    chosen = symmetric.takes(backend, img, txt, True, 1e-8)
    out = []
    for strategy in ("auto", "fused"):
        try:
            loss = L.clip_loss(img, txt, t, backend=backend, strategy=strategy)
        except ValueError:  # a backend without a fused sweep refuses "fused": compare with recompute
            loss = L.clip_loss(img, txt, t, backend=backend, mask=torch.ones(23, dtype=torch.bool))
        out.append((loss, *_grads(loss, (img, txt, t))))
    for a, b in zip(*out):
        _close("symmetric vs directional", a, b, torch.float64, img, txt, t.item(), grad=a.dim() > 0)
    if backend in ("reference", "torch", "cpp"):
        assert chosen == backend, "the reference, torch and cpp backends compute column statistics"


@pytest.mark.parametrize("loss", ["clip", "siglip"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nonfinite_image_reaches_every_gradient_as_autograd(backend, loss, bad, dtype):
    """A NaN/Inf in image row 2, and its row's upstream 0 (``reduction="none"``): NaN exactly
    where plain autograd of the logits has it, never a finite value in its place (a finite
    ``exp(logit)`` weight from a row whose log-sum-exp is NaN was one).

    CLIP: every row sees image 2 (its logit row, and column 2 of the text direction), so
    every row and every gradient entry of both modalities is NaN. SigLIP: row ``i`` is image
    ``i`` against every text, so only row 2 and image 2's gradient are NaN, and every text's
    gradient (row 2's weights reach each text, 0 * NaN)."""
    img, txt = _features(6, 8, seed=5, normalised=False, dtype=dtype)
    with torch.no_grad():
        img[2, 3] = bad
    fn = L.clip_loss if loss == "clip" else L.siglip_loss
    extra = {} if loss == "clip" else {"logit_bias": -2.0}
    rows = fn(img, txt, logit_scale=10.0, reduction="none", backend=backend, **extra)
    up = torch.ones_like(rows)
    up[2] = 0
    rows.backward(up)
    seen = torch.ones(6, dtype=torch.bool) if loss == "clip" else torch.arange(6) == 2
    assert torch.equal(rows.detach().isnan().cpu(), seen), rows
    assert torch.equal(img.grad.isnan().all(1).cpu(), seen) and not img.grad[~seen].isnan().any(), img.grad
    assert txt.grad.isnan().all(), txt.grad
