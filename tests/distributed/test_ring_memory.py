"""The ring's per-rank extra memory does not grow with the world size, while the gather's does.

Measured per rank (``ring_memory_worker``) at W = 2, 3 and 4 with the same per-rank batch.
(SigLIP's sigmoid ring too: its texts travel.) The ring cuts each rank's candidates into pieces (``FASTCL_RING_PIECES``, default 2) and
chains its rounds, so a ring of two holds as many pieces in flight as a larger one: the peak
must stay within 10 % from W = 2 to 4 (the ring's target) and vary by less than a quarter of
one rank's candidates (the gather adds two blocks per rank, candidates and gradients; noise
here is ~0.1 MiB). What travels is pieces, not blocks: with four pieces instead of two the
peak falls by at least a block. The gather's peak must grow by more than 10 % plus two blocks
between W = 2 and 4, which shows the measurement sees growth (the test can fail).
"""

from __future__ import annotations

import pytest

from fastcl.config import Config
from tests.distributed import ring_memory_worker as M
from tests.helpers.spawn import spawn_ranks

SPAWN_TIMEOUT_S = 180
DEFAULT_PIECES = Config().ring_pieces
RUNS = ((2, DEFAULT_PIECES), (3, DEFAULT_PIECES), (4, DEFAULT_PIECES), (2, 4), (4, 4))  # (world, pieces)
BLOCK = M.B * (M.P + M.Q) * M.D * 8  # bytes of one rank's candidates (float64)
pytestmark = pytest.mark.timeout(len(RUNS) * SPAWN_TIMEOUT_S + 60)


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned ranks' glibc at start
    try:
        out = {}
        for world, pieces in RUNS:
            mp.setenv("FASTCL_RING_PIECES", str(pieces))
            tmp = str(tmp_path_factory.mktemp(f"ringmem{world}-{pieces}"))
            ranks = spawn_ranks(M.worker, world, tmp, 0, SPAWN_TIMEOUT_S)
            out[world, pieces] = {mode: max(r[mode] for r in ranks) for mode in M.MODES}
        return out
    finally:
        mp.undo()


def _mib(peaks, mode):
    return ", ".join(f"W={w} pieces={k}: {p[mode] / 2**20:.2f} MiB" for (w, k), p in peaks.items())


def test_ring_extra_peak_is_constant_in_world_size(peaks):
    ring = {w: peaks[w, DEFAULT_PIECES]["ring"] for w in (2, 3, 4)}
    why = f"ring extra peak per rank changed with W ({_mib(peaks, 'ring')})"
    assert max(ring.values()) <= 1.10 * min(ring.values()), why
    assert max(ring.values()) - min(ring.values()) <= BLOCK / 4, why
    assert ring[2] >= 2 * BLOCK, f"a ring step held less than two blocks ({_mib(peaks, 'ring')}): not measured?"


def test_ring_holds_pieces_not_blocks(peaks):
    for world in (2, 4):
        fewer, more = peaks[world, DEFAULT_PIECES]["ring"], peaks[world, 4]["ring"]
        assert more <= fewer - BLOCK, f"W={world}: four pieces did not save a block ({_mib(peaks, 'ring')})"
    assert peaks[4, 4]["ring"] <= 1.10 * peaks[2, 4]["ring"], _mib(peaks, "ring")


def test_gather_extra_peak_grows_with_world_size(peaks):
    gather = {w: peaks[w, DEFAULT_PIECES]["gather"] for w in (2, 4)}
    assert gather[4] > 1.10 * gather[2] + 2 * BLOCK, f"gather: {_mib(peaks, 'gather')}"


SIGLIP_BLOCK = M.B_SIGLIP * M.D * 8  # bytes of one rank's texts (float64)


def test_siglip_ring_extra_peak_is_constant_in_world_size(peaks):
    """The sigmoid ring (SigLIP's texts in pieces) holds as much at W = 4 as at W = 2; its gather
    grows by two blocks per rank (texts and their gradients), which shows the meter sees it."""
    ring = {w: peaks[w, DEFAULT_PIECES]["siglip_ring"] for w in (2, 3, 4)}
    why = f"SigLIP ring extra peak per rank changed with W ({_mib(peaks, 'siglip_ring')})"
    assert max(ring.values()) <= 1.10 * min(ring.values()), why
    gather = {w: peaks[w, DEFAULT_PIECES]["siglip_gather"] for w in (2, 4)}
    assert gather[4] > 1.10 * gather[2] + 2 * SIGLIP_BLOCK, f"SigLIP gather: {_mib(peaks, 'siglip_gather')}"
