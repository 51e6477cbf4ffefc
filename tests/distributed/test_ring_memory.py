"""The ring's per-rank extra memory does not grow with the world size, while the gather's does.

Measured per rank (``ring_memory_worker``) at W = 2, 3 and 4 with the same per-rank batch. A
ring of two has no block in flight while it works on the other rank's block, so it holds one
block buffer and one gradient accumulator less than any larger ring (W = 2 is the smallest
case, not the constant); from W = 3 on the pipeline is full and the peak must stay within
10 % (the ring's target) and grow by less than a quarter of one rank's candidates (the
gather adds two blocks per rank, candidates and gradients; noise here is ~0.1 MiB). The gather's peak must grow by more than that plus two blocks
between W = 2 and 4, which shows the measurement sees growth (the test can fail).
"""

from __future__ import annotations

import pytest

from tests.distributed import ring_memory_worker as M
from tests.helpers.spawn import spawn_ranks

SPAWN_TIMEOUT_S = 180
WORLDS = (2, 3, 4)
BLOCK = M.B * (M.P + M.Q) * M.D * 8  # bytes of one rank's candidates (float64)
pytestmark = pytest.mark.timeout(len(WORLDS) * SPAWN_TIMEOUT_S + 60)


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned ranks' glibc at start
    try:
        out = {}
        for world in WORLDS:
            tmp = str(tmp_path_factory.mktemp(f"ringmem{world}"))
            ranks = spawn_ranks(M.worker, world, tmp, 0, SPAWN_TIMEOUT_S)
            out[world] = {mode: max(r[mode] for r in ranks) for mode in M.MODES}
        return out
    finally:
        mp.undo()


def _mib(peaks, mode):
    return ", ".join(f"W={w}: {p[mode] / 2**20:.1f} MiB" for w, p in peaks.items())


def test_ring_extra_peak_is_constant_in_world_size(peaks):
    ring = {w: p["ring"] for w, p in peaks.items()}
    assert ring[4] <= 1.10 * ring[3], f"ring extra peak per rank grew with W ({_mib(peaks, 'ring')})"
    assert ring[4] <= ring[3] + BLOCK / 4, f"ring extra peak per rank grew with W ({_mib(peaks, 'ring')})"
    assert ring[2] <= 1.02 * ring[4], f"a ring of two held more than a larger ring ({_mib(peaks, 'ring')})"
    assert ring[2] >= 2 * BLOCK, f"a ring step held less than two blocks ({_mib(peaks, 'ring')}): not measured?"


def test_gather_extra_peak_grows_with_world_size(peaks):
    gather = {w: p["gather"] for w, p in peaks.items()}
    assert gather[4] > 1.10 * gather[2] + 2 * BLOCK, f"gather: {_mib(peaks, 'gather')}"
