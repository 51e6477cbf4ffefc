"""The ``"cpp"`` fused step forming the folded own-positive logits itself (``lse_fused`` with
``own_logits=True``, ``CppLSE.forms_own_logits``): the logits equal
``own_positive_similarities / tau`` (a padded positive reads 0 whatever its slot holds, a NaN
in a valid one gives a NaN logit), the head reads them, and the losses' values and gradients,
the temperature's included, match the float64 reference without ``_own_logits`` running."""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L
from fastcl.ops import _cpp, contrastive
from fastcl.ops.contract import EPS, LSEProblem, OwnPositives, poison_outputs, structured_tags
from fastcl.ops.head import HeadInputs, reduction_weights
from fastcl.ops.positive_logits import own_positive_similarities
from fastcl.testing import assert_roundoff
from tests.helpers.backends import require
from tests.helpers.roundoff import assert_loss_and_grads_roundoff, assert_tau_grad_roundoff

B, P, Q, D, OFFSET = 6, 3, 2, 19, 4  # own positives from row OFFSET of block 0
TAU = 0.1


@pytest.fixture(autouse=True)
def _cpp_available():
    require("cpp")


def _inputs(dtype, nan_valid=False, seed=0):
    """anchor, positives [B, P, d] with a NaN-holding padded slot (1, 2), pos_mask, negatives;
    ``nan_valid``: a NaN in valid positive (3, 0) too."""
    g = torch.Generator().manual_seed(seed)
    a, p, n = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in ((B, D), (B, P, D), (B, Q, D)))
    mask = torch.ones(B, P, dtype=torch.bool)
    mask[1, 2] = mask[4, 0] = False
    p[1, 2] = float("nan")
    if nan_valid:
        p[3, 0, 5] = float("nan")
    return a, p, mask, n


def _largest_norm(x):
    norms = x.double().reshape(-1, D).norm(dim=-1)
    return norms[torch.isfinite(norms)].max().item()


def _problem(a, p, mask, n, cosine, exclude_own):
    """The losses' layout: OFFSET extra candidates, then the own positives, in block 0."""
    extra = torch.randn(OFFSET, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(a.dtype)
    block0 = torch.cat([extra, p.reshape(B * P, D)])
    pos_tags = structured_tags(B, P, mask, device=a.device, exclude_owner=exclude_own)
    tags0 = torch.cat([torch.full((OFFSET,), -1, dtype=torch.int32), pos_tags])
    tags1 = structured_tags(B, Q, None, device=a.device, exclude_owner=False)
    return LSEProblem(a, (block0, n.reshape(B * Q, D)), (tags0, tags1), cosine, EPS, OwnPositives(OFFSET, P))


@pytest.mark.parametrize("kind", ["cross_entropy", "softplus"])
@pytest.mark.parametrize("cosine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nan_valid", [False, True])
def test_kernel_logits_equal_the_similarities(kind, cosine, dtype, nan_valid):
    """The logits the kernel writes, and every output of the step, equal those of the same
    step given ``own_positive_similarities / tau`` (float64 on the same rounded inputs)."""
    a, p, mask, n = _inputs(dtype, nan_valid)
    prob = _problem(a, p, mask, n, cosine, exclude_own=kind == "softplus")
    tau = torch.tensor(TAU, dtype=torch.float64)
    want = own_positive_similarities(a.double(), p.double(), cosine, EPS, mask) / TAU
    assert want[1, 2] == 0 and want[3, 0].isnan() == nan_valid
    weights = reduction_weights(mask.any(1), "mean", torch.float64)
    with poison_outputs():  # every logit must be written
        got = _cpp.BACKEND.fused(prob, tau, HeadInputs(kind, None, mask, None, weights))
    # D-term sums in float64, or float32 for 16-bit inputs, of size 1/tau (cosine) or
    # |a| |p| / tau: fastcl.testing.roundoff
    sums = torch.float64 if dtype == torch.float64 else torch.float32
    scale = 1 / TAU if cosine else _largest_norm(a) * _largest_norm(p) / TAU
    assert_roundoff(got.pos_logits.double(), want, sums, terms=D, magnitude=scale, equal_nan=True, msg="pos_logits")
    given = _cpp.BACKEND.fused(prob, tau, HeadInputs(kind, got.pos_logits, mask, None, weights))
    assert given.pos_logits is None
    for name in ("lse", "mean_logit", "loss_rows", "d_pos", "d_anchor", "g_dot_mean_logit"):
        torch.testing.assert_close(getattr(got, name), getattr(given, name), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got.d_blocks, given.d_blocks, rtol=0, atol=0, equal_nan=True)
    assert got.loss_rows[3].isnan() == nan_valid


@pytest.mark.parametrize("loss", [L.supmpn_loss, L.supcon_loss])
@pytest.mark.parametrize("cosine", [True, False])
@pytest.mark.parametrize("nan_valid", [False, True])
def test_fused_loss_matches_reference_without_own_logits(fastcl_config, monkeypatch, loss, cosine, nan_valid):
    """Values and gradients (the temperature's too) equal the float64 reference; a NaN in a
    valid positive makes the loss NaN, one in a padded slot changes nothing."""
    a, p, mask, n = _inputs(torch.float64, nan_valid, seed=1)
    similarity = "cos" if cosine else "dot"
    runs = {}
    for backend in ("reference", "cpp"):
        if backend == "cpp":  # fused, the kernel forming the logits: the Python pass must not run
            fastcl_config(strategy="fused")
            monkeypatch.setattr(contrastive, "_own_logits", lambda *_: pytest.fail("_own_logits ran"))
        leaves = [t.clone().requires_grad_() for t in (a, p, n, torch.tensor(TAU, dtype=torch.float64))]
        out = loss(*leaves[:3], pos_mask=mask, temperature=leaves[3], similarity=similarity, backend=backend)
        runs[backend] = (out, *torch.autograd.grad(out, leaves))
    assert runs["cpp"][0].isnan() == nan_valid
    if not nan_valid:  # float64 round-off (tests/helpers/roundoff.py)
        scale = 1 / TAU if cosine else _largest_norm(a) * max(_largest_norm(p), _largest_norm(n)) / TAU
        kw = dict(terms=D + OFFSET + B * (P + Q) + B, logit_scale=scale)
        (got, *got_g, got_t), (want, *want_g, want_t) = runs["cpp"], runs["reference"]
        assert_loss_and_grads_roundoff(got, want, got_g, want_g, torch.float64, **kw)
        assert_tau_grad_roundoff(got_t, want_t, torch.float64, rows=1, **kw)
        assert (runs["cpp"][2][1, 2] == 0).all()  # the padded slot's gradient


def _op_args(prob, mask, own_logits):
    cd = torch.float64
    args = (prob.anchor, *prob.blocks, *prob.tags, torch.tensor(TAU), prob.cosine, EPS, "softplus")
    rest = (mask, None, reduction_weights(mask.any(1), "mean", cd), OFFSET, True, own_logits)
    N0, N1 = (b.shape[0] for b in prob.blocks)
    outs = dict(lse=B, mean_logit=B, loss_rows=B, d_pos=(B, P), d_anchor=(B, D), d_block0=(N0, D), d_block1=(N1, D))
    kwargs = {k: torch.empty(s, dtype=cd) for k, s in outs.items()}
    return (*args, torch.empty(B, P, dtype=cd), *rest), dict(kwargs, g_dot_mean_logit=torch.empty((), dtype=cd))


def test_opcheck_own_logits():
    a, p, mask, n = _inputs(torch.float64)
    p = p.nan_to_num()
    args, kwargs = _op_args(_problem(a, p, mask, n, True, True), mask, True)
    torch.library.opcheck(torch.ops.fastcl.lse_fused.default, args, kwargs)


def test_refuses_a_valid_positive_that_is_padding():
    """The kernel reads a positive from its stored row, which is zeros for a padded one: a
    valid positive tagged padding would silently get logit 0."""
    a, p, mask, n = _inputs(torch.float64)
    prob = _problem(a, p, mask, n, True, True)
    prob.tags[0][OFFSET + 1 * P + 2] = -2  # already padding and masked: accepted
    args, kwargs = _op_args(prob, mask, True)
    torch.ops.fastcl.lse_fused(*args, **kwargs)
    prob.tags[0][OFFSET] = -2  # positive (0, 0) is valid
    with pytest.raises(RuntimeError, match="valid own positive"):
        torch.ops.fastcl.lse_fused(*args, **kwargs)
    args, kwargs = _op_args(prob, torch.ones(B, P, dtype=torch.bool), True)
    with pytest.raises(RuntimeError, match="valid own positive"):
        torch.ops.fastcl.lse_fused(*args[:10], None, *args[11:], **kwargs)


def test_own_logits_needs_folded_positives():
    a, p, mask, n = _inputs(torch.float64)
    args, kwargs = _op_args(_problem(a, p, mask, n, True, True), mask, True)
    args = (*args[:-2], False, True)  # fold_positives=False
    with pytest.raises(RuntimeError, match="fold_positives"):
        torch.ops.fastcl.lse_fused(*args, **kwargs)
