"""``benchmarks.harness.ring_blocks`` (the ring's per-block primitive against one call) runs on the
CPU at a tiny size and reports what a GPU lease records."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness.ring_blocks import main, ring_blocks_throughput
from tests.helpers.backends import require


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_ring_blocks_throughput_tiny(backend):
    require(backend)
    out = ring_blocks_throughput(
        B=6, P=2, Q=1, d=16, world=3, dtype="float32", device="cpu", backend=backend, budget_s=0.05
    )
    assert out["backend"] == backend and out["world"] == 3 and out["pieces"] == 2  # ring_pieces' default
    assert out["blocks_s"] > 0 and out["single_s"] > 0 and out["single_fused_s"] > 0
    assert out["share"] == pytest.approx(out["single_s"] / out["blocks_s"])
    assert out["rounds"] >= 3


def test_command_line_prints_one_json_line_per_world(capsys):
    main(["--B", "4", "--P", "1", "--Q", "0", "--d", "8", "--world", "1", "2", "--dtype", "float64",
          "--device", "cpu", "--backend", "torch", "--budget-s", "0.01", "--pieces", "3"])  # fmt: skip
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["world"] for r in lines] == [1, 2] and {r["pieces"] for r in lines} == {3}
