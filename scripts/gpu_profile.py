"""Where a fused loss step spends its GPU time: torch.profiler over a few fwd + bwd steps.

Prints, per backend, the wall time of a step, the summed kernel time, the number of kernel
launches and the kernels that take most of it (name, calls, total ms). Run on a CUDA machine:

    python scripts/gpu_profile.py --loss supmpn --B 4096 --P 5 --Q 5 --d 768 --backends triton,compile
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: the repository root (benchmarks.harness)

from benchmarks.harness.cases import make_inputs  # noqa: E402
from benchmarks.harness.peers import build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--loss", default="supmpn")
    p.add_argument("--B", type=int, default=4096)
    p.add_argument("--P", type=int, default=5)
    p.add_argument("--Q", type=int, default=5)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backends", default="triton")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    inputs = make_inputs(args.loss, args.B, args.P, args.Q, args.d, args.dtype, "cuda")
    leaves = [v for v in inputs.values() if v is not None]

    for name in args.backends.split(","):
        fn = build(name, args.loss, inputs)

        def step(fn=fn):
            for v in leaves:
                v.grad = None
            fn().backward()

        for _ in range(2):  # compile and autotune outside the profile
            step()
        # wall time: each step alone (synchronised), min and median of 10; the mean of a few
        # back-to-back steps read 11-24 ms for the same step on the H100
        walls = []
        for _ in range(10):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
        walls.sort()
        wall, wall_median = walls[0], walls[len(walls) // 2]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in kernels) / 1e3 / args.steps
        calls = sum(e.count for e in kernels) // args.steps
        print(f"== {name}: {args.loss} B={args.B} P={args.P} Q={args.Q} d={args.d} {args.dtype}")
        print(
            f"   step {wall * 1e3:.2f} ms wall (min of 10; median {wall_median * 1e3:.2f}), "
            f"{total:.2f} ms in {calls} kernel launches"
        )
        for e in sorted(kernels, key=lambda e: -e.device_time_total)[: args.top]:
            ms = e.device_time_total / 1e3 / args.steps
            print(f"   {ms:8.3f} ms {e.count // args.steps:5d}x  {e.key[:110]}")
        # memory: peak beyond the inputs, and which ops allocate most (one step)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as mem:
            step()
            torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        print(f"   peak {peak:.1f} MiB beyond the inputs; largest allocating ops (self, one step):")
        usage = lambda e: getattr(e, "self_device_memory_usage", getattr(e, "self_cuda_memory_usage", 0))  # noqa: E731
        for e in sorted(mem.key_averages(), key=lambda e: -usage(e))[:8]:
            if usage(e) > 0:
                print(f"   {usage(e) / 2**20:8.1f} MiB {e.count:5d}x  {e.key[:100]}")


if __name__ == "__main__":
    main()
