"""SupCon from class labels (``supcon_labels_loss`` / ``supcon_loss(features, labels=...)``).

Values and gradients in float64 against pytorch-metric-learning's ``SupConLoss`` and
against SupContrast's ``SupConLoss`` formula (written here from its definition), on the
reference, torch and cpp backends; and the memory contract: no ``N x N`` buffer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastcl.losses as L
from fastcl.losses import supcon_labels_loss
from fastcl.testing import assert_roundoff
from tests.helpers.backends import require

BACKENDS = ["reference", "torch", "cpp"]
# float64 comparisons of the same sums in other orders (fastcl.testing.roundoff): the largest
# problems here have d <= 16 coordinates and <= 24 rows (d + N + B terms); logits up to
# |x|^2 / tau <= 50 / 0.1 for the dot products of these randn rows (1/tau for cosine) are an
# absolute error of the loss and a relative one of the gradients.
TERMS = 16 + 24 + 24
LOGIT_SCALE = 50 / 0.1


def _same(got, want, *, scale: float = LOGIT_SCALE):
    """``got`` within float64 round-off of ``want`` (a loss or a gradient: the larger of its
    size and 1 times the logits' size; ``scale``: another size of the logits' terms)."""
    size = max(want.detach().abs().max().item(), 1.0)
    assert_roundoff(got, want, torch.float64, terms=TERMS, magnitude=size * scale)


def _backend(name):
    if name != "reference":
        require(name)
    return name


def _supcontrast(features, labels, temperature, base_temperature):
    """SupContrast's ``SupConLoss`` (contrast_mode='all'), written from its definition.

    ``features [B, V, d]`` (SupContrast expects them L2-normalised), ``labels [B]``.
    Anchors: every view of every sample, view-major. Denominator: every other feature.
    ``loss = -(T / base_T) * mean over anchors of mean_{p in P(i)} log_softmax_{a != i}``;
    an anchor without a positive counts as 0 in that mean (SupContrast's current code).
    """
    B, V, d = features.shape
    x = features.transpose(0, 1).reshape(V * B, d)
    y = labels.repeat(V)
    logits = x @ x.T / temperature
    not_self = ~torch.eye(V * B, dtype=torch.bool)
    log_den = torch.logsumexp(logits.masked_fill(~not_self, float("-inf")), dim=1, keepdim=True)
    log_prob = logits - log_den
    pos = (y[:, None] == y[None, :]) & not_self
    count = pos.sum(1)
    mean_log_prob_pos = (log_prob * pos).sum(1) / torch.where(count > 0, count, torch.ones_like(count))
    return -(temperature / base_temperature) * mean_log_prob_pos.mean()


def _pml(features, labels, temperature, *, dot=False, ref_emb=None, ref_labels=None):
    from pytorch_metric_learning.distances import DotProductSimilarity
    from pytorch_metric_learning.losses import SupConLoss

    kw = {"distance": DotProductSimilarity(normalize_embeddings=False)} if dot else {}
    return SupConLoss(temperature=temperature, **kw)(features, labels, ref_emb=ref_emb, ref_labels=ref_labels)


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("similarity", ["cos", "dot"])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_pml_supcon(backend, similarity, seed):
    pytest.importorskip("pytorch_metric_learning")
    gen = torch.Generator().manual_seed(seed)
    # few labels, one of them seen once: that anchor has no positive (PML drops it too)
    x = torch.randn(13, 9, generator=gen, dtype=torch.float64)
    if similarity == "dot":
        x = x * 0.3
    x.requires_grad_()
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2])
    tau = 0.1 + 0.1 * seed
    got = supcon_labels_loss(x, y, temperature=tau, similarity=similarity, backend=_backend(backend))
    ref = _pml(x, y, tau, dot=similarity == "dot")
    _same(got, ref)
    _same(_grads(got, x)[0], _grads(ref, x)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_pml_with_reference_set(backend):
    pytest.importorskip("pytorch_metric_learning")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    r = torch.randn(11, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 0, 1, 9])  # label 9 is not in the reference set: no positive
    ry = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4, 5, 0])
    got = supcon_labels_loss(x, y, ref_emb=r, ref_labels=ry, temperature=0.2, backend=_backend(backend))
    ref = _pml(x, y, 0.2, ref_emb=r, ref_labels=ry)
    _same(got, ref)
    for g, e in zip(_grads(got, x, r), _grads(ref, x, r)):
        _same(g, e)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("base_temperature", [0.07, 0.2])
def test_matches_supcontrast_multiview(backend, base_temperature):
    gen = torch.Generator().manual_seed(5)
    B, V, d, T = 10, 3, 8, 0.07
    raw = torch.randn(B, V, d, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 4, (B,), generator=gen)
    # SupContrast takes normalised features; fastcl's "cos" normalises inside, "dot" takes them as given
    ref = _supcontrast(F.normalize(raw, dim=-1), labels, T, base_temperature)
    ref_grad = _grads(ref, raw)[0]
    scale = T / base_temperature
    for sim, feats in (("cos", raw), ("dot", F.normalize(raw, dim=-1))):
        got = scale * supcon_labels_loss(feats, labels, temperature=T, similarity=sim, backend=_backend(backend))
        _same(got, ref)
        _same(_grads(got, raw)[0], ref_grad)


def test_view_major_order_and_rows():
    """``reduction="none"`` rows follow SupContrast's flattening: row ``v*B + b`` is view v of sample b."""
    gen = torch.Generator().manual_seed(6)
    B, V, d = 5, 2, 4
    x = torch.randn(B, V, d, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 2])
    rows = supcon_labels_loss(x, y, temperature=0.5, reduction="none", backend="torch")
    flat = torch.cat(torch.unbind(x, dim=1))
    _same(rows, supcon_labels_loss(flat, y.repeat(V), temperature=0.5, reduction="none"))
    # by hand, anchor 0 (view 0 of sample 0): positives = sample 1's two views and its own view 1
    logits = F.normalize(flat, dim=1) @ F.normalize(flat, dim=1).T / 0.5
    lse = torch.logsumexp(torch.cat([logits[0, 1:]]), 0)
    pos = logits[0, [1, 5, 6]].mean()
    _same(rows[0], lse - pos)
    assert rows.shape == (B * V,)


def test_supcontrast_and_pml_differ_only_by_anchors_without_positive():
    """SupContrast counts an anchor without positive as 0 in its mean; fastcl (and PML) leave it out."""
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 2, 3])  # two anchors without a positive
    got = supcon_labels_loss(x[:, None, :], y, temperature=0.3, similarity="cos")
    ref = _supcontrast(F.normalize(x, dim=-1)[:, None, :], y, 0.3, 0.3)
    _same(got * 4 / 6, ref)


def test_where_pml_takes_a_shortcut_fastcl_follows_the_formula():
    """Deliberate differences from pytorch-metric-learning (docs/losses.md): a batch without any
    negative (one label) has the formula's (docs/contracts.md, and SupContrast's) loss, not PML's 0; and passing the
    features themselves as ``ref_emb`` / ``ref_labels`` never drops "self" (PML does when
    ``ref_labels is labels``): the answer does not depend on tensor identity."""
    pytest.importorskip("pytorch_metric_learning")
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    same = torch.zeros(6, dtype=torch.long)
    got = supcon_labels_loss(x, same, temperature=0.1)
    _same(got, _supcontrast(F.normalize(x, dim=-1)[:, None, :], same, 0.1, 0.1))
    assert got > 0 and float(_pml(x, same, 0.1)) == 0.0
    y = torch.tensor([0, 1, 0, 1, 2, 2])
    by_identity = supcon_labels_loss(x, y, ref_emb=x, ref_labels=y, temperature=0.1)
    by_value = supcon_labels_loss(x, y, ref_emb=x.clone(), ref_labels=y.clone(), temperature=0.1)
    _same(by_identity, by_value)
    _same(by_value, _pml(x, y, 0.1, ref_emb=x.clone(), ref_labels=y.clone()))


def test_module_without_temperature():
    """``SupConLoss()`` takes each call's form default; a learnable one needs a start value."""
    assert "None (0.05 structured, 0.1 labels)" in repr(L.SupConLoss())
    with pytest.raises(ValueError, match="starting temperature"):
        L.SupConLoss(learn_temperature=True)
    assert L.SupConLoss(0.2, learn_temperature=True).temperature.item() == pytest.approx(0.2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_learnable_temperature_gradient(backend):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 2, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (9,), generator=gen)
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    got = supcon_labels_loss(x, y, temperature=tau, similarity="dot", backend=_backend(backend))
    ref = _supcontrast(x, y, tau, tau)  # dot on the given features == SupContrast with base_T = T
    _same(got, ref)
    _same(_grads(got, tau)[0], _grads(ref, tau)[0], scale=LOGIT_SCALE / 0.3)  # d tau: logits / tau


def test_supcon_loss_labels_form_and_module():
    x = torch.randn(8, 2, 6, dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 1, 2, 2, 3, 3])
    want = supcon_labels_loss(x, y, temperature=0.1)
    _same(L.supcon_loss(x, labels=y, temperature=0.1), want)
    _same(L.SupConLoss(temperature=0.1)(x, labels=y), want)
    # the structured form keeps working positionally
    a, p = torch.randn(4, 6), torch.randn(4, 2, 6)
    assert torch.isfinite(L.supcon_loss(a, p))
    with pytest.raises(ValueError, match="not both"):
        L.supcon_loss(a, p, labels=torch.arange(4))
    with pytest.raises(TypeError, match="positives"):
        L.supcon_loss(a)


@pytest.mark.parametrize("shape", [(16, 6), (8, 2, 6)])
def test_labels_second_positionally_as_pml_and_supcontrast_take_them(shape):
    """``loss(features, labels)``: a 1-D integer tensor second is read as labels (function and
    module), values and gradients as with ``labels=``; with ref_emb too; a 1-D tensor of another dtype
    is refused as labels; anything else second stays the structured form's positives."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 3, shape[:1], generator=g)
    want = supcon_labels_loss(x, y, temperature=0.1)
    (want_grad,) = torch.autograd.grad(want, x)
    for got in (L.supcon_loss(x, y, temperature=0.1), L.SupConLoss(temperature=0.1)(x, y)):
        _same(got, want)
        _same(torch.autograd.grad(got, x)[0], want_grad)
    ref, ref_y = torch.randn(5, 6, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    _same(
        L.SupConLoss(0.1)(x, y, ref_emb=ref, ref_labels=ref_y),
        supcon_labels_loss(x, y, ref_emb=ref, ref_labels=ref_y, temperature=0.1),
    )
    with pytest.raises(ValueError, match="not both"):  # labels positionally and hard negatives
        L.supcon_loss(x, y, torch.randn(shape[0], 2, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):  # 1-D is labels' shape:
        L.supcon_loss(x, y.double())  # float ones are refused as labels, not as positives


def test_input_errors():
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match="no label occurs twice"):
        supcon_labels_loss(x, torch.arange(6))
    with pytest.raises(TypeError, match="integer"):
        supcon_labels_loss(x, torch.zeros(6))
    with pytest.raises(ValueError, match=r"shape \[6\]"):
        supcon_labels_loss(x, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="together"):
        supcon_labels_loss(x, torch.zeros(6, dtype=torch.long), ref_emb=x)
    with pytest.raises(ValueError, match=r"\[N, d\] or \[B, V, d\]"):
        supcon_labels_loss(torch.randn(6), torch.zeros(6, dtype=torch.long))
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        supcon_labels_loss(x, torch.zeros(6, dtype=torch.long), process_group=object())


# ------------------------------------------------------------------------------- memory

N, D, LABELS = 8192, 32, 64
LOGITS_BYTES = N * N * 4  # one float32 N x N buffer: 256 MiB


def test_meter_sees_pml_nxn_buffers():
    pytest.importorskip("pytorch_metric_learning")
    from benchmarks.harness.memory import cpu_extra_peak_bytes

    peer = cpu_extra_peak_bytes(
        "benchmarks.harness.api_cases:supcon_labels_step", dict(backend="pml-supcon", N=N, d=D, num_labels=LABELS)
    )
    assert peer > LOGITS_BYTES, f"PML SupCon peaked at only {peer / 2**20:.0f} MiB"


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_no_nxn_buffer(backend):
    require(backend)
    from benchmarks.harness.memory import cpu_extra_peak_bytes

    extra = cpu_extra_peak_bytes(
        "benchmarks.harness.api_cases:supcon_labels_step", dict(backend=backend, N=N, d=D, num_labels=LABELS)
    )
    # O(N d) copies and bounded tiles; any N x N float32 buffer alone would add 256 MiB
    assert extra < LOGITS_BYTES / 2, f"{backend}: extra peak {extra / 2**20:.0f} MiB"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype, scale",
    [
        (torch.float32, 1e20),
        (torch.float32, 1e30),
        (torch.float32, 1e-6),
        (torch.bfloat16, 1e20),
        (torch.float64, 1e200),
    ],
)
def test_cosine_is_scale_free(backend, dtype, scale):
    """Features scaled by any finite factor give the unscaled loss and the gradient divided by
    the factor (docs/losses.md, "Scale"); the mean positive logit once normalised with a plain
    sum of squares, which overflows at ~1e19 in float32."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 2, 16, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 3, (12,), generator=g)
    # float32/float64: the sums' round-off (d + N + B terms, logits of size 1/tau, relative in the
    # gradients). bfloat16: scaling rounds each input by eps/2, so a cosine moves by up to eps
    # and the loss (logits' difference) by 2 eps / tau: that bound, with the gradients' relative
    # to their size; and the gradients are stored rounded.
    terms, inv_tau = 16 + 2 * 24 + 24, 1 / 0.1
    for ref in (False, True):  # the features as candidates, and a reference set
        kw = dict(backend=_backend(backend), temperature=0.1)
        if ref:
            kw.update(ref_emb=x[:, 0] * 1.5, ref_labels=y)
        leaf = x.detach().requires_grad_()
        want = supcon_labels_loss(leaf, y, **kw)
        (want_g,) = _grads(want, leaf)
        big = (x * scale).detach().requires_grad_()
        if ref:
            kw["ref_emb"] = kw["ref_emb"] * scale
        got = supcon_labels_loss(big, y, **kw)
        (got_g,) = _grads(got, big)
        got_g, want_g = got_g.double() * scale, want_g.double()
        if dtype == torch.bfloat16:
            assert_roundoff(got.double(), want.double(), dtype, magnitude=inv_tau / 2, msg="loss")
            size = want_g.abs().max().item()
            assert_roundoff(got_g, want_g, dtype, magnitude=size * inv_tau / 2, out_dtype=dtype, msg="grad")
        else:
            assert_roundoff(got.double(), want.double(), dtype, terms=terms, magnitude=inv_tau, msg="loss")
            size = want_g.abs().max().item()
            assert_roundoff(got_g, want_g, dtype, terms=terms, magnitude=size * inv_tau, msg="grad")
