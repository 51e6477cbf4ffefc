"""The filtered losses on 2 and 3 gloo processes: ``gist_loss`` is sentence-transformers'
``GISTEmbedLoss(gather_across_devices=True)`` on every rank (every rank's positives, negatives
and their guide embeddings join the rows; the anchor-anchor block stays this rank's), the
self-margin MNRL is the one-process filtered loss of the concatenated batch under fastcl's
scaling rule, and the ring equals the gather, on every backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastcl.losses as L
from fastcl import reference as R
from tests.distributed import filter_worker as W
from tests.helpers.spawn import spawn_ranks

WORLDS = (2, 3)
SPAWN_TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
TOL = 1e-10  # float64: the ranks add the same terms in another order
_RUNS: dict[int, dict] = {}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def world_run(request, tmp_path_factory):
    world = request.param
    if world not in _RUNS:
        seed = int(torch.initial_seed() % 10_000)
        tmp = str(tmp_path_factory.mktemp(f"filters{world}"))
        _RUNS[world] = {"world": world, "seed": seed, "ranks": spawn_ranks(W.worker, world, tmp, seed, SPAWN_TIMEOUT_S)}
    return _RUNS[world]


def _gist_rank(parts: list[dict], leaves: list[list[torch.Tensor]], r: int) -> torch.Tensor:
    """Rank r's GISTEmbedLoss(gather_across_devices=True), written out as sentence-transformers
    computes it (positives, negatives and guides gathered; anchors this rank's)."""
    a, ga = leaves[r][0], parts[r]["guide"][0]
    P = torch.cat([lv[1] for lv in leaves])
    N = torch.cat([lv[2].reshape(-1, W.D) for lv in leaves])
    gp = torch.cat([p["guide"][1] for p in parts])
    gn = torch.cat([p["guide"][2].reshape(-1, W.G) for p in parts])
    off = r * W.B

    def sim(x, y):
        return F.cosine_similarity(x[:, None], y[None], dim=-1)

    g = sim(ga, gp).diagonal(offset=off)[:, None]
    thr = g - g.abs() * W.GIST["margin"]
    protect = torch.zeros(W.B, P.shape[0], dtype=torch.bool)
    protect[torch.arange(W.B), off + torch.arange(W.B)] = True
    blocks = [
        sim(a, P).masked_fill((sim(ga, gp) > thr) & ~protect, float("-inf")),
        sim(a, a).masked_fill(sim(ga, ga) > thr, float("-inf")),
        sim(P[off : off + W.B], P).masked_fill(sim(gp[off : off + W.B], gp) > thr, float("-inf")),
        sim(a, N).masked_fill(sim(ga, gn) > thr, float("-inf")),
    ]
    scores = torch.cat(blocks, dim=1) / W.GIST["temperature"]
    return F.cross_entropy(scores, off + torch.arange(W.B))


def _check(got, want_value, want_grads, what):
    """``got = (value, grads)``; the value is not compared when ``want_value`` is None."""
    value, grads = got
    assert want_value is None or abs(float(value - want_value.detach())) <= TOL * max(1.0, abs(float(want_value))), (
        f"{what}: {float(value)} != {float(want_value)}"
    )
    for name, g, w in zip(("anchor", "positive", "negatives"), grads, want_grads):
        assert w.abs().max() > 0, f"{what}: zero reference gradient for {name}"
        err = float((g - w).norm() / w.norm())
        assert err <= TOL, f"{what}: d {name} relative error {err:.2e}"


@pytest.mark.parametrize("backend", W.BACKENDS)
@pytest.mark.parametrize("cross_device", ["gather", "ring"])
def test_gist_equals_sentence_transformers_gathered(world_run, backend, cross_device):
    world, seed = world_run["world"], world_run["seed"]
    parts = [W.inputs(seed, r) for r in range(world)]
    leaves = [[p[k].clone().requires_grad_() for k in ("anchor", "positive", "negatives")] for p in parts]
    losses = [_gist_rank(parts, leaves, r) for r in range(world)]
    grads = torch.autograd.grad(sum(losses), [t for lv in leaves for t in lv])  # each rank: d(sum of all ranks' losses)
    for r, rank in enumerate(world_run["ranks"]):
        _check(
            rank["gist", backend, cross_device],
            losses[r],
            grads[3 * r : 3 * r + 3],
            f"gist {backend} {cross_device} rank {r}",
        )


@pytest.mark.parametrize("backend", W.BACKENDS)
@pytest.mark.parametrize("cross_device", ["gather", "ring"])
def test_self_margin_equals_one_process(world_run, backend, cross_device):
    world, seed = world_run["world"], world_run["seed"]
    parts = [W.inputs(seed, r) for r in range(world)]
    a, p, n = (torch.cat([x[k] for x in parts]).requires_grad_() for k in ("anchor", "positive", "negatives"))
    ref = R.self_margin_mnrl(a, p, n, margin=0.05, temperature=0.1)
    d_a, d_p, d_n = torch.autograd.grad(ref, (a, p, n))
    assert (
        abs(float(ref - L.mnrl_loss(a, p, n, false_negative_margin=0.05, temperature=0.1, backend="reference"))) <= TOL
    )
    for r, rank in enumerate(world_run["ranks"]):
        sl = slice(r * W.B, (r + 1) * W.B)
        got_value, got_grads = rank["self_margin", backend, cross_device]
        # fastcl's rule: mean over ranks is the one-process loss; rank r holds W x its slice of the gradient
        want = [world * g[sl] for g in (d_a, d_p, d_n)]
        _check(
            (torch.tensor(0.0), got_grads), torch.tensor(0.0), want, f"self-margin {backend} {cross_device} rank {r}"
        )
    mean = torch.stack([rank["self_margin", backend, cross_device][0] for rank in world_run["ranks"]]).mean()
    assert abs(float(mean - ref)) <= TOL
