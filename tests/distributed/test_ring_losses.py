"""``cross_device="ring"`` through every public LSE loss: 2-, 3- and 4-process gloo rings equal
one process on the concatenated batch, with the gather mode's identities (docs/distributed.md;
``tests/distributed/ring_loss_cases.py`` runs every case and backend in one spawn per world):

* ``mean_r loss_r == L`` and rank r's gradients are ``W * dL/d(slice r)`` (``"none"``: the
  one-process rows, and each rank the gradient of the global sum); a learnable temperature:
  ``mean_r dL_r/dtau == dL/dtau``; a rank without a valid anchor returns exactly 0;
* DDP with the ring inside the model: parameter gradients equal one process's;
* errors: a rank failing validation stops every rank, shape mismatches raise everywhere.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import cases as C
from tests.distributed import ring_loss_cases as R
from tests.helpers.spawn import spawn_ranks

WORLDS = (2, 3, 4)
SPAWN_TIMEOUT_S = 300
# As tests/distributed/test_distributed.py: the ranks add the same terms in another order (the
# ring keeps candidate gradients in float32 for bf16; its outputs are rounded once).
from tests.distributed.test_distributed import TOL  # noqa: E402

pytestmark = pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)

_RUNS: dict[int, dict] = {}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def world_run(request, tmp_path_factory):
    world = request.param
    if world not in _RUNS:
        seed = int(torch.initial_seed() % (1 << 31))
        tmp = str(tmp_path_factory.mktemp(f"ringloss{world}"))
        _RUNS[world] = {"world": world, "seed": seed, "ranks": spawn_ranks(R.worker, world, tmp, seed, SPAWN_TIMEOUT_S)}
    return _RUNS[world]


def _close(got, ref, dtype, what):
    err = (got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    assert torch.isfinite(got).all() and err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("backend", R.BACKENDS)
@pytest.mark.parametrize("case", R.CASES, ids=R.CASE_NAMES)
def test_ring_loss_equals_one_process_on_concatenated_batch(world_run, case, backend):
    world, seed = world_run["world"], world_run["seed"]
    parts = [C.inputs(case, seed, r) for r in range(world)]
    ref = R.run_case(case, case.merge(parts), backend, group=None)
    got = [rank["cases"][case.name, backend] for rank in world_run["ranks"]]
    dtype = next(iter(ref["grads"].values())).dtype
    tag = f"{case.name}/{backend}/world{world}/seed{seed}"
    assert all(g["rings"] > 0 for g in got), f"{tag}: no ring ran"
    if case.reduction == "none":
        _close(torch.cat([g["loss"] for g in got]), ref["loss"], dtype, f"{tag}: rows")
        scale = 1
    else:
        _close(torch.stack([g["loss"] for g in got]).mean(), ref["loss"], dtype, f"{tag}: mean of rank losses")
        scale = world
    if case.masked and case.reduction == "mean" and world > C.EMPTY_RANK:
        assert got[C.EMPTY_RANK]["loss"].item() == 0.0, f"{tag}: a rank without valid anchors must return 0"
    for name, ref_grad in ref["grads"].items():
        assert ref_grad.abs().max() > 0, f"{tag}: d {name} is all zero: the comparison could not fail"
        sizes = [p[name].shape[0] for p in parts]
        for r, ref_slice in enumerate(ref_grad.split(sizes)):
            _close(got[r]["grads"][name], scale * ref_slice, dtype, f"{tag}: d {name} on rank {r}")
    if case.learn_tau:
        _close(torch.stack([g["tau_grad"] for g in got]).mean(), ref["tau_grad"], dtype, f"{tag}: d tau")


def test_ddp_with_the_ring_equals_one_process(world_run):
    world, seed = world_run["world"], world_run["seed"]
    model = C.ddp_model(seed)
    loss = model(*[torch.cat(xs) for xs in zip(*[C.ddp_inputs(seed, r) for r in range(world)])])
    loss.backward()
    ref = C.param_grads(model)
    ranks = [r["ddp"] for r in world_run["ranks"]]
    assert all(r["rings"] > 0 for r in ranks), "the DDP model's loss ran no ring"
    _close(torch.stack([r["loss"] for r in ranks]).mean(), loss.detach(), torch.float64, "DDP loss")
    for r, got in enumerate(ranks):
        assert set(got["grads"]) == set(ref)
        for name, g in ref.items():
            _close(got["grads"][name], g, torch.float64, f"DDP d {name} on rank {r}")


def _errors(world_run, name):
    return [r["errors"][name] for r in world_run["ranks"]]


def test_mismatched_shapes_raise_on_every_rank(world_run):
    errs = _errors(world_run, "mismatch")
    for err in errs:
        assert err is not None and err[0] == "ValueError", errs
        assert "every rank of the process group must pass the same sizes" in err[1]
        assert f"rank {world_run['world'] - 1}:" in err[1]
    assert len({e[1] for e in errs}) == 1


@pytest.mark.parametrize("name", ["invalid-on-rank-0", "invalid-mnrl-directions"])
def test_one_rank_failing_validation_stops_all_ranks(world_run, name):
    first, *others = _errors(world_run, name)
    assert first is not None and first[0] in ("TypeError", "ValueError") and "rank(s)" not in first[1], first
    for err in others:
        assert err is not None and err[0] == "RuntimeError" and "rank(s) [0] rejected their inputs" in err[1], err


def test_labels_without_any_positive_raise_on_every_rank(world_run):
    for err in _errors(world_run, "labels-no-positive"):
        assert err is not None and err[0] == "ValueError" and "no label repeats" in err[1], err


def test_unknown_cross_device_is_refused(world_run):
    for err in _errors(world_run, "bad-choice"):
        assert err is not None and err[0] == "ValueError" and "cross_device" in err[1], err


@pytest.mark.parametrize(("name", "says"), [("fused-with-dims", "matryoshka"), ("fused-rows", "reduction")])
def test_a_fused_strategy_the_ring_cannot_run_is_refused(world_run, name, says):
    for err in _errors(world_run, name):
        assert err is not None and err[0] == "ValueError" and "strategy='fused'" in err[1] and says in err[1], err


def test_non_finite_contract(world_run):
    for r, got in enumerate(world_run["ranks"]):
        res = got["nonfinite"]
        assert res["valid-nan"].isnan(), f"rank {r}: a NaN in a valid candidate of rank 0 must reach every rank"
        for strategy in ("auto", "recompute"):  # auto: the own block by the gradient-in-forward sweep
            grad = res[f"valid-nan-grad-{strategy}"]
            assert grad.isnan().all(), f"rank {r} ({strategy}): a NaN candidate must reach every gradient"
        (loss_p, grad_p), (loss_z, grad_z) = res["padded"], res["zeroed"]
        assert torch.isfinite(loss_p) and torch.isfinite(grad_p).all(), f"rank {r}"
        # a padded slot is never read: the same sums whatever it holds, bitwise
        torch.testing.assert_close(loss_p, loss_z, rtol=0, atol=0)
        torch.testing.assert_close(grad_p, grad_z, rtol=0, atol=0)
        assert grad_p[0, 1].abs().max() == 0, f"rank {r}: a padded slot's gradient must be exactly 0"


def test_second_derivative_raises_and_says_why(world_run):
    for r, got in enumerate(world_run["ranks"]):
        d_a, err = got["second-order"]
        assert torch.isfinite(d_a).all() and d_a.abs().max() > 0, f"rank {r}"
        assert err is not None and err[0] == "RuntimeError" and "cross_device='ring'" in err[1], err
