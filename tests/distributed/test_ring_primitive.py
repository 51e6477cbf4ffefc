"""``cross_device="ring"`` at the primitive: 2-, 3- and 4-process gloo rings equal one process.

One spawn per world size (``tests/distributed/ring_cases.py`` runs every case and backend);
the parent runs ``contrastive_loss`` on the concatenated batch and checks the gather mode's
identities (docs/distributed.md): ``mean_r loss_r == L`` and rank r's gradients are
``W * dL/d(slice r)`` (``reduction="none"``: the rows are the one-process rows and the
gradient that of the global sum); a learnable temperature: ``mean_r dL_r/dtau == dL/dtau``.
Failures run first in the same workers: a rank raising in the middle of the forward or the
backward ring makes every rank raise (the failed one its own error, the others a
``RingFailure`` naming it), shape and dtype mismatches raise on every rank, and a call after
them still works (the group stays usable). The last run cuts each rank's payload into 7
pieces (``FASTCL_RING_PIECES``), more than some blocks have rows: uneven and empty pieces.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import ring_cases as C
from tests.helpers.spawn import spawn_ranks

RUNS = ((2, None), (3, None), (4, None), (3, 7))  # (world, pieces; None: the default)
SPAWN_TIMEOUT_S = 240
from tests.distributed.test_distributed import TOL  # noqa: E402  (the dtype's round-off)

pytestmark = pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)

_RUNS: dict[tuple[int, int | None], dict] = {}


@pytest.fixture(scope="module", params=RUNS, ids=lambda r: f"world{r[0]}" + (f"-pieces{r[1]}" if r[1] else ""))
def world_run(request, tmp_path_factory, monkeypatch_module):
    world, pieces = request.param
    if request.param not in _RUNS:
        seed = int(torch.initial_seed() % (1 << 31))
        if pieces is None:
            monkeypatch_module.delenv("FASTCL_RING_PIECES", raising=False)
        else:
            monkeypatch_module.setenv("FASTCL_RING_PIECES", str(pieces))  # read by the spawned ranks
        tmp = str(tmp_path_factory.mktemp(f"ring{world}"))
        _RUNS[request.param] = {
            "world": world,
            "seed": seed,
            "ranks": spawn_ranks(C.worker, world, tmp, seed, SPAWN_TIMEOUT_S),
        }
    return _RUNS[request.param]


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _close(got, ref, dtype, what):
    err = (got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    assert torch.isfinite(got).all() and err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("backend", C.CASE_BACKENDS)
@pytest.mark.parametrize("case", C.CASES, ids=C.CASE_NAMES)
def test_ring_equals_one_process_on_concatenated_batch(world_run, case, backend):
    world, seed = world_run["world"], world_run["seed"]
    parts = [C.inputs(case, seed, r) for r in range(world)]
    ref = C.run(case, C.concat(parts), backend, group=None)
    got = [rank["cases"][case.name, backend] for rank in world_run["ranks"]]
    tag = f"{case.name}/{backend}/world{world}/seed{seed}"
    if case.reduction == "none":
        _close(torch.cat([g["loss"] for g in got]), ref["loss"], case.dtype, f"{tag}: rows")
        scale = 1
    else:
        _close(torch.stack([g["loss"] for g in got]).mean(), ref["loss"], case.dtype, f"{tag}: mean of rank losses")
        scale = world
    if case.masks and case.reduction == "mean" and world > 2:
        assert got[2]["loss"].item() == 0.0, f"{tag}: a rank without valid anchors returns 0"
    for name, ref_grad in ref["grads"].items():
        assert ref_grad.abs().max() > 0, f"{tag}: d {name} is all zero: the test could not fail"
        for r, ref_slice in enumerate(ref_grad.split([p[name].shape[0] for p in parts])):
            _close(got[r]["grads"][name], scale * ref_slice, case.dtype, f"{tag}: d {name} on rank {r}")
    if case.learn_tau:
        _close(torch.stack([g["tau_grad"] for g in got]).mean(), ref["tau_grad"], case.dtype, f"{tag}: d tau")


@pytest.mark.parametrize("backend", C.BACKENDS)
@pytest.mark.parametrize("case", C.LABEL_CASES, ids=C.LABEL_CASE_NAMES)
def test_labels_ring_equals_one_process(world_run, case, backend):
    """SupCon with labels: positives found on other ranks, a label one rank holds alone, and
    a row whose label occurs once in the global batch (no positive: left out of the mean)."""
    world, seed = world_run["world"], world_run["seed"]
    parts = [C.label_inputs(case, seed, r) for r in range(world)]
    ref = C.run_labels(case, C.concat(parts), backend, group=None)
    got = [rank["labels"][case.name, backend] for rank in world_run["ranks"]]
    tag = f"{case.name}/{backend}/world{world}/seed{seed}"
    _close(torch.stack([g["loss"] for g in got]).mean(), ref["loss"], torch.float64, f"{tag}: mean of rank losses")
    for r, ref_slice in enumerate(ref["grad"].split(C.N_LABELED)):
        _close(got[r]["grad"], world * ref_slice, torch.float64, f"{tag}: d features on rank {r}")
    if case.learn_tau:
        _close(torch.stack([g["tau_grad"] for g in got]).mean(), ref["tau_grad"], torch.float64, f"{tag}: d tau")


def _failures(world_run, name):
    return [r["failures"][name] for r in world_run["ranks"]]


@pytest.mark.parametrize(("name", "method", "bad_rank", "when", "strategy"), C.FAILURES)
def test_a_rank_failing_mid_ring_stops_every_rank_with_its_reason(world_run, name, method, bad_rank, when, strategy):
    errs = _failures(world_run, name)
    ring_pass = "backward" if method == "backward" else "forward"  # the own sweep ends the forward pass
    for r, err in enumerate(errs):
        assert err is not None, f"rank {r} did not raise"
        if r == bad_rank:
            assert err == ("FloatingPointError", f"injected failure in {method} call {when}"), err
        else:
            assert err[0] == "RingFailure", err
            assert f"rank(s) [{bad_rank}] failed during the {ring_pass} pass" in err[1], err
            assert "injected failure" in err[1], err


@pytest.mark.parametrize("name", ["mismatch", "dtype"])
def test_mismatched_shapes_or_dtype_raise_on_every_rank(world_run, name):
    errs = _failures(world_run, name)
    for err in errs:
        assert err is not None and err[0] == "ValueError", errs
        assert "every rank of the process group must pass the same sizes" in err[1]
    assert len({e[1] for e in errs}) == 1, "every rank must raise the same message"


def test_no_valid_positive_anywhere_raises_on_every_rank(world_run):
    for err in _failures(world_run, "no-positive"):
        assert err is not None and err[0] == "ValueError" and "no anchor of any rank" in err[1], err


def test_group_stays_usable_after_the_failures(world_run):
    for r in world_run["ranks"]:
        assert torch.isfinite(r["failures"]["after"]).all()
