"""Quick single-thread CPU timing of the fused backends against the eager reference.

CPU time (``time.process_time``, so other processes on a loaded machine cost little) of
one forward + backward, best of ``--repeat`` after one warm-up, with ``torch`` limited to
one thread; optional extra peak RSS of a fresh process per case (``--memory``). Its recorded
run: benchmarks/results/cpu-2026-11-23/notes.md.

    OMP_NUM_THREADS=1 python scripts/time_cpp.py [--repeat 3] [--memory]
"""

from __future__ import annotations

import argparse
import time

import torch

from fastcl.bench.cases import loss_step
from fastcl.bench.memory import cpu_extra_peak_bytes

CASES = [  # (loss, B, P, Q, d)
    ("supmpn", 1024, 5, 5, 768),
    ("supmpn", 4096, 5, 5, 64),
    ("infonce", 1024, 1, 0, 768),
]
IMPLS = ("eager", "torch", "cpp")


def cpu_seconds(step, repeat: int) -> float:
    step()  # warm-up: builds/loads the backend, first-touch allocations
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        step()
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--memory", action="store_true", help="also the extra peak RSS (fresh process per case)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        "| workload (fp32, fwd+bwd) | "
        + " | ".join(f"{i} s" for i in IMPLS)
        + " | cpp / torch | cpp / eager |"
        + (" peak MiB eager / torch / cpp |" if args.memory else "")
    )
    print("|---" * (len(IMPLS) + 3 + args.memory) + "|")
    for loss, B, P, Q, d in CASES:
        secs = {impl: cpu_seconds(loss_step(loss, impl, B, P, Q, d), args.repeat) for impl in IMPLS}
        row = (
            f"| {loss} B={B} P={P} Q={Q} d={d} | "
            + " | ".join(f"{secs[i]:.3f}" for i in IMPLS)
            + f" | {secs['cpp'] / secs['torch']:.2f} | {secs['cpp'] / secs['eager']:.2f} |"
        )
        if args.memory:
            mib = [
                cpu_extra_peak_bytes("fastcl.bench.cases:loss_step", dict(loss=loss, backend=i, B=B, P=P, Q=Q, d=d))
                / 2**20
                for i in IMPLS
            ]
            row += " " + " / ".join(f"{m:.0f}" for m in mib) + " |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
