"""open_clip's losses on 2 and 3 gloo processes: fastcl's drop-ins give each rank open_clip's value
and gradients (features, ``logit_scale``, ``logit_bias``), with the gather and with the ring;
the ring equals the gather; both equal one process on the concatenated batch under fastcl's
scaling rule; bad input raises on every rank and leaves the group usable.
"""

from __future__ import annotations

import math

import pytest
import torch

import fastcl.losses as L
from fastcl.testing import roundoff
from tests.distributed import clip_worker as W
from tests.helpers.open_clip import require_open_clip
from tests.helpers.spawn import spawn_ranks

WORLDS = (2, 3)
SPAWN_TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
# float64 throughout: the ranks add the same terms in another order. The sums behind an output: a
# logit's D coordinates, a row's and a column's up to max(WORLDS) x B pairs (and the mean over
# them); logits of size exp(2) (unit features) plus the bias 3: a relative error of the sigmoid
# or softmax weights, hence of the loss and of every gradient
TERMS = W.D + 3 * max(WORLDS) * W.B
TOL = roundoff(torch.float64, TERMS, math.exp(2.0) + 3.0)
_RUNS: dict[int, dict] = {}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def run(request, tmp_path_factory):
    require_open_clip()
    world = request.param
    if world not in _RUNS:
        seed = int(torch.initial_seed() % 10_000)
        tmp = str(tmp_path_factory.mktemp(f"clip{world}"))
        _RUNS[world] = {"world": world, "seed": seed, "ranks": spawn_ranks(W.worker, world, tmp, seed, SPAWN_TIMEOUT_S)}
    return _RUNS[world]


def _same(got, want, what):
    (v, gs), (wv, wgs) = got, want
    assert abs(float(v - wv)) <= TOL * max(1.0, abs(float(wv))), f"{what}: loss {float(v)} != {float(wv)}"
    for name, g, w in zip(("image", "text", "logit_scale", "logit_bias"), gs, wgs):
        if w is None or (w.abs().max() <= TOL and name == "logit_bias"):  # a sum of weights <= 1 cancels
            assert g is None or g.abs().max() <= TOL, f"{what}: d {name} should be 0"
            continue
        assert g is not None, f"{what}: no gradient for {name}"
        err = float((g - w).norm() / w.norm().clamp_min(1e-30))
        assert err <= TOL, f"{what}: d {name} relative error {err:.2e}"


@pytest.mark.parametrize("backend", W.BACKENDS)
@pytest.mark.parametrize("impl", ["bidir", "gather"])
def test_siglip_equals_open_clip_on_every_rank(run, backend, impl):
    for r, ranks in enumerate(run["ranks"]):
        want = ranks["siglip"]["open_clip", "bidir"]
        _same(ranks["siglip"]["open_clip", impl], want, f"open_clip {impl} vs bidir, rank {r}")
        _same(
            ranks["siglip"][backend, impl],
            want,
            f"fastcl {backend} {impl} ({'ring' if impl == 'bidir' else 'gather'}), rank {r}",
        )


@pytest.mark.parametrize("backend", W.BACKENDS)
@pytest.mark.parametrize("mode", W.CLIP_MODES, ids=lambda m: f"local{int(m[0])}-grad{int(m[1])}")
def test_clip_equals_open_clip_on_every_rank(run, backend, mode):
    for r, ranks in enumerate(run["ranks"]):
        want = ranks["clip"]["open_clip", mode]
        _same(ranks["clip"][backend, mode, "gather"], want, f"{backend} {mode} gather, rank {r}")
        if mode == (True, True):
            _same(ranks["clip"][backend, mode, "ring"], want, f"{backend} {mode} ring, rank {r}")


@pytest.mark.parametrize("loss", ["siglip", "clip"])
def test_one_process_on_the_concatenated_batch(run, loss):
    """``mean_r loss_r`` is the one-process loss of every rank's pairs, and rank r's feature
    gradients are ``W`` times its slice of the one-process gradient (fastcl's scaling rule)."""
    world, seed = run["world"], run["seed"]
    parts = [W.features(seed, r) for r in range(world)]
    img, txt = (torch.cat(x).requires_grad_() for x in zip(*parts))
    fn = L.siglip_loss if loss == "siglip" else L.clip_loss
    ref = fn(img, txt, math.exp(2.0), -3.0, similarity="dot", backend="reference")
    d_img, d_txt = torch.autograd.grad(ref, (img, txt))
    key = ("torch", "bidir") if loss == "siglip" else ("torch", (True, True), "ring")
    got = [ranks[loss][key] for ranks in run["ranks"]]
    assert abs(float(torch.stack([v for v, _ in got]).mean() - ref.detach())) <= TOL
    for r, (_, grads) in enumerate(got):
        for g, ref_g in ((grads[0], d_img), (grads[1], d_txt)):
            want = world * ref_g[r * W.B : (r + 1) * W.B]
            assert float((g - want).norm() / want.norm()) <= TOL, f"rank {r}"


def test_bad_input_raises_on_every_rank(run):
    ranks = [r["errors"] for r in run["ranks"]]
    assert all(r["usable"] for r in ranks), "the group must stay usable after the errors"
    for case in ("sizes", "clip_sizes"):
        for r, errors in enumerate(ranks):
            kind, text = errors[case]
            assert kind == "ValueError" and "same sizes" in text, f"{case}, rank {r}: {kind}: {text}"
    kinds = [errors["scale"] for errors in ranks]
    assert kinds[0][0] == "ValueError" and "logit_scale" in kinds[0][1]
    assert all(k[0] == "RuntimeError" and "rejected their inputs" in k[1] for k in kinds[1:]), kinds
