"""Ranks that disagree on a distributed loss's settings all raise, naming each rank's
settings, and the group stays usable: no hang until the group's timeout, no abort inside gloo
(gather on one rank and ring on another hung for 30 minutes; ``ring_pieces`` differing by
rank killed a rank with SIGABRT; different dims or losses were silently accepted)."""

from __future__ import annotations

import pytest

from tests.distributed import settings_worker as W
from tests.helpers.spawn import spawn_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(W.worker, 2, str(tmp_path_factory.mktemp("settings")), 0, 120)


@pytest.mark.parametrize("case", ["cross_device", "ring_pieces", "dims", "loss", "reduction"])
def test_disagreeing_ranks_all_raise(ranks, case):
    for r, out in enumerate(ranks):
        assert out[case] is not None, f"rank {r} accepted {case} that differs across ranks"
        kind, text = out[case]
        assert kind == "ValueError" and "different settings" in text, f"rank {r}: {kind}: {text}"
        assert "rank 0:" in text and "rank 1:" in text


def test_agreeing_ranks_run(ranks):
    """The same call with the same settings runs (after the failed ones: the worker's barrier
    after every case shows the group stayed usable)."""
    assert all(out["agree"] is None for out in ranks)


def test_the_labels_ring_refuses_a_fused_strategy_it_cannot_run(ranks):
    for r, out in enumerate(ranks):
        kind, text = out["labels_ring_fused_reference"]
        assert kind == "ValueError" and "strategy='fused' needs" in text, f"rank {r}: {kind}: {text}"
