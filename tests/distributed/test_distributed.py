"""Cross-device negatives: 2- and 3-process gloo runs equal one process on the concatenated batch.

One spawn per world size (``tests/distributed/cases.py`` runs every case and backend in
it, bounded by ``SPAWN_TIMEOUT_S``); the parent recomputes each case on one process and
checks the identities documented in ``fastcl.distributed``:

* ``mean_r loss_r == L`` (``reduction="mean"``/``"sum"``) and rank r's embedding gradients
  equal ``W * dL/d(slice r)``; a learnable temperature: ``mean_r dL_r/dtau == dL/dtau``;
* ``reduction="none"``: the rows are the one-process rows, and backpropagating
  ``rows.sum()`` on every rank gives each rank the one-process gradient of the global sum;
* DDP: parameter gradients after backward equal the one-process ones.
In the masked cases the ranks have different numbers of valid anchors (3, 2, 0): rank 2 of
the 3-process run has none, and its loss must be exactly 0.
The error scenarios run first in the same workers, so the passing cases also show that the
group stays usable after every error.
"""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L
from fastcl.testing import roundoff
from tests.distributed import cases as C
from tests.helpers.spawn import spawn_ranks

WORLDS = (2, 3)
SPAWN_TIMEOUT_S = 150
# Relative Frobenius error of W ranks against one process on the concatenated batch: the
# same terms added in another order, so the dtype's round-off (fastcl.testing.roundoff) over
# the longest chain here (d = 8 coordinates, up to 4 ranks x 4 rows x 4 candidates, the rows)
# with logits of size 1/tau = 10, relative in the gradients; 16-bit gradients are also summed
# over the ranks in their own dtype (up to 4 terms).
TERMS = 8 + 4 * 4 * 4 + 4 * 4
TOL = {
    torch.float64: roundoff(torch.float64, TERMS, 1 / 0.1),
    torch.float32: roundoff(torch.float32, TERMS, 1 / 0.1),
    torch.bfloat16: roundoff(torch.float32, TERMS, 1 / 0.1) + roundoff(torch.bfloat16, 4),
}

pytestmark = pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)

_RUNS: dict[int, dict] = {}


def _spawn(world: int, tmp: str, seed: int) -> list[dict]:
    """Run ``C.worker`` on ``world`` processes; kill them all if any fails or time runs out."""
    return spawn_ranks(C.worker, world, tmp, seed, SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def world_run(request, tmp_path_factory):
    world = request.param
    if world not in _RUNS:
        seed = int(torch.initial_seed() % (1 << 31))
        ranks = _spawn(world, str(tmp_path_factory.mktemp(f"world{world}")), seed)
        _RUNS[world] = {"world": world, "seed": seed, "ranks": ranks}
    return _RUNS[world]


def _close(got, ref, dtype, what):
    err = (got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    assert torch.isfinite(got).all() and err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("backend", C.BACKENDS)
@pytest.mark.parametrize("case", C.CASES, ids=C.CASE_NAMES)
def test_matches_one_process_on_concatenated_batch(world_run, case, backend):
    world, seed = world_run["world"], world_run["seed"]
    parts = [C.inputs(case, seed, r) for r in range(world)]
    ref = C.run_case(case, case.merge(parts), backend, group=None)
    got = [rank["cases"][case.name, backend] for rank in world_run["ranks"]]
    dtype = parts[0]["anchor"].dtype
    tag = f"{case.name}/{backend}/world{world}/seed{seed}"

    if case.reduction == "none":
        _close(torch.cat([g["loss"] for g in got]), ref["loss"], dtype, f"{tag}: rows")
        scale = 1  # each rank backprops rows.sum(): the gather sums the gradient of the global sum
    else:
        _close(torch.stack([g["loss"] for g in got]).mean(), ref["loss"], dtype, f"{tag}: mean of rank losses")
        scale = world
    if case.masked and case.reduction == "mean" and world > C.EMPTY_RANK:
        assert got[C.EMPTY_RANK]["loss"].item() == 0.0, f"{tag}: a rank without valid anchors must return 0"
    for name, ref_grad in ref["grads"].items():
        sizes = [p[name].shape[0] for p in parts]
        for r, ref_slice in enumerate(ref_grad.split(sizes)):
            _close(got[r]["grads"][name], scale * ref_slice, dtype, f"{tag}: d {name} on rank {r}")
    if case.learn_tau:
        _close(torch.stack([g["tau_grad"] for g in got]).mean(), ref["tau_grad"], dtype, f"{tag}: d tau")


def test_ddp_parameter_gradients_equal_one_process(world_run):
    world, seed = world_run["world"], world_run["seed"]
    model = C.ddp_model(seed)
    parts = [C.ddp_inputs(seed, r) for r in range(world)]
    loss = model(*[torch.cat(xs) for xs in zip(*parts)])
    loss.backward()
    ref = C.param_grads(model)
    assert "loss.log_temperature" in ref
    ranks = [r["ddp"] for r in world_run["ranks"]]
    _close(torch.stack([r["loss"] for r in ranks]).mean(), loss.detach(), torch.float64, "DDP loss")
    for r, got in enumerate(ranks):
        for name, g in ref.items():
            _close(got["grads"][name], g, torch.float64, f"DDP d {name} on rank {r}")


def _errors(world_run, name):
    return [r["errors"][name] for r in world_run["ranks"]]


@pytest.mark.parametrize("name", ["mismatch", "dtype"])
def test_mismatched_shapes_or_dtype_raise_on_every_rank(world_run, name):
    errs = _errors(world_run, name)
    world = world_run["world"]
    for err in errs:
        assert err is not None and err[0] == "ValueError", errs
        assert "every rank of the process group must pass the same sizes" in err[1]
        assert f"rank {world - 1}:" in err[1]
    assert len({e[1] for e in errs}) == 1, "every rank must raise the same message"


def test_no_valid_positive_on_any_rank_raises_everywhere(world_run):
    for err in _errors(world_run, "no-positive"):
        assert err is not None and err[0] == "ValueError" and "no anchor of any rank" in err[1]


@pytest.mark.parametrize("name", ["invalid-on-rank-0", "invalid-nested", "invalid-edacse"])
def test_one_rank_failing_validation_stops_all_ranks(world_run, name):
    first, *others = _errors(world_run, name)
    assert first is not None and first[0] in ("TypeError", "ValueError"), first
    assert "rank(s)" not in first[1]  # rank 0 raises its own, specific error
    for err in others:
        assert err is not None and err[0] == "RuntimeError" and "rank(s) [0] rejected their inputs" in err[1], err


def test_process_group_must_be_a_process_group():
    """Not a ProcessGroup: a TypeError saying so (not "torch.distributed is not initialised")."""
    a, p = torch.randn(4, 8), torch.randn(4, 2, 8)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        L.supmpn_loss(a, p, process_group=object())
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        L.supcon_pool_loss(a, torch.randn(5, 8), torch.zeros(4, 1, dtype=torch.long), process_group=object())
