"""Cross-device negatives, gather against ring, on the CPU with gloo.

SupMPN (``P`` positives and ``Q`` negatives per anchor, ``B`` anchors per rank, width ``d``),
or SigLIP with ``--bench-ring-loss siglip`` (``B`` image–text pairs per rank), on ``W`` = 2
and 4 processes, ``cross_device="gather"`` and ``"ring"`` in the same processes
(``benchmarks.harness.ring_cpu``: values checked equal first): time per step (the slowest rank's,
minimum of interleaved rounds), bytes sent per rank in one step, extra peak RSS per rank
(the largest rank's). The targets: the ring's extra memory per rank constant in ``W``
(within 10 % from W = 2 to 4) and its CPU step within 1.2x of the gather's at W = 4 for
SupMPN B = 1024, d = 768, and (issue [clip]) the SigLIP ring's extra memory per rank within
10 % from W = 2 to 4 at B = 1024. docs/distributed.md explains the trade-off; its table of numbers
is filled from this benchmark on an idle machine.

    pytest benchmarks/bench_ring.py --benchmark-only
    python -m benchmarks.bench_ring                      # the same (defaults), JSON lines on stdout

It spawns its own processes and takes minutes at the default case, so the main job
(``pytest benchmarks --benchmark-only``) skips it unless this file is named on the command
line or ``--bench-ring`` is given.

Options (``benchmarks/options.py``): ``--bench-ring-worlds`` (default ``2,4``),
``--bench-ring-case`` (default ``B=1024,P=5,Q=5,d=768``), ``--bench-ring-loss``
(``supmpn`` or ``siglip``), ``--bench-ring-dtype``
(``float32``), ``--bench-ring-backend`` (``auto``: cpp where it builds),
``--bench-ring-rounds`` (5 timed rounds after one warm-up), ``--bench-ring-threads`` (intra-op
threads per rank; default the usable cores divided by ``W``). At the default case one step at
W = 4 is a few seconds on 16 cores; with fewer cores use a smaller case, e.g.
``--bench-ring-case B=256``. ``python -m benchmarks.bench_ring`` runs the defaults.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import options
from benchmarks.harness import ring_cpu
from benchmarks.harness.timing import replay

_RUNS: dict[int, dict] = {}


def measure(world: int) -> dict:
    """One spawn per world size, both modes inside (cached for the module)."""
    o = options.CURRENT
    if world not in _RUNS:
        _RUNS[world] = ring_cpu.run(
            world=world, loss=o.ring_loss, dtype=o.ring_dtype, backend=o.ring_backend, rounds=o.ring_rounds, threads=o.ring_threads,
            **o.ring_case,
        )  # fmt: skip
    return _RUNS[world]


def _selected(config) -> bool:
    """This file named on the command line, or ``--bench-ring``."""
    return options.CURRENT.ring or any("bench_ring" in str(a) for a in config.args)


@pytest.mark.parametrize("mode", ring_cpu.MODES)
@pytest.mark.parametrize("world", options.CURRENT.ring_worlds, ids=lambda w: f"W{w}")
def test_cross_device_step(request, benchmark, bench_record, bench_skip, world, mode):
    o = options.CURRENT
    case = " ".join(f"{k}={v}" for k, v in o.ring_case.items())
    if o.ring_loss == "siglip":  # image and text features only
        case = " ".join(f"{k}={v}" for k, v in o.ring_case.items() if k in ("B", "d"))
    workload = f"{o.ring_loss}-{o.ring_dtype} {case} W={world} (per rank)"
    if not _selected(request.config):
        bench_skip(workload, mode, "multi-process: run pytest benchmarks/bench_ring.py, or pass --bench-ring")
    result = measure(world)
    got = result["modes"][mode]
    bench_record(
        benchmark,
        workload=workload,
        impl=mode,
        min_s=got["min_s"],
        spread=got["spread"],
        peak_mib=got["extra_peak_mib"],
        sent_bytes=got["sent_bytes"],
        world=world,
        threads=result["threads"],
        rounds=len(got["samples_s"]),
        stopped="rounds",
    )
    replay(benchmark, got["samples_s"])


if __name__ == "__main__":
    for w in options.CURRENT.ring_worlds:
        print(json.dumps(measure(w)))
