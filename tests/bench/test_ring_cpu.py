"""``benchmarks.harness.ring_cpu`` (benchmarks/bench_ring.py's measurement) runs at a tiny size: two
gloo ranks, both modes, values checked equal inside, bytes as the module docstring counts them."""

from __future__ import annotations

import pytest

from benchmarks.harness import ring_cpu

pytestmark = pytest.mark.timeout(300)


def test_two_ranks_tiny():
    B, P, Q, d = 4, 2, 1, 8
    out = ring_cpu.run(world=2, B=B, P=P, Q=Q, d=d, dtype="float64", backend="torch", rounds=2, threads=1)
    assert out["world"] == 2 and out["threads"] == 1 and set(out["modes"]) == {"gather", "ring"}
    block = B * (P + Q) * d * 8  # one rank's candidates, float64
    for mode, got in out["modes"].items():
        assert len(got["samples_s"]) == 2 and got["min_s"] == min(got["samples_s"]) > 0, mode
        assert got["extra_peak_mib"] >= 0
    # gather: all-gather + reduce-scatter of one block each (W - 1 = 1), plus small int handshakes
    assert 2 * block <= out["modes"]["gather"]["sent_bytes"] < 2 * block + 1024
    # ring: the block out and back (W - 1 = 1 hop each) and its float64 accumulator home (W = 2 hops)
    assert 4 * block <= out["modes"]["ring"]["sent_bytes"] < 4 * block + 4096
