"""Each Triton kernel of a warm loss step against cuBLAS at the same GEMM shape (CUDA only).

For one ``triton`` step (SupMPN by default: B = 4096, P = Q = 5, d = 768, bf16) the profiler
gives every kernel's summed device time; each GEMM-shaped kernel is set against the
cuBLAS GEMM of the products it performs, timed with CUDA events in the same process:

* ``_lse_fwd_kernel``: ``A [B, d] @ C^T [d, N]`` (one pass over the logits);
* ``_lse_ds_kernel``: the same product again (the recompute), summed over the chunks;
* ``_mm_kernel``: the two backward products, ``dS^T @ A`` and ``dS @ C``.

Prints ms, TFLOP/s and the share of cuBLAS's rate per kernel, the step's launches and its
wall time with and without a CUDA graph. ``--json FILE`` writes the same numbers.

    python scripts/gpu_kernels.py [--loss supmpn] [--B 4096] [--d 768] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fastcl.graphs import capture_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: the repository root (benchmarks.harness)

from benchmarks.harness.cases import make_inputs  # noqa: E402
from benchmarks.harness.peers import TEMPERATURE, build  # noqa: E402
from benchmarks.harness.timing import best_ms  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--loss", default="supmpn")
    p.add_argument("--B", type=int, default=4096)
    p.add_argument("--P", type=int, default=5)
    p.add_argument("--Q", type=int, default=5)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dt = getattr(torch, args.dtype)
    inputs = make_inputs(args.loss, args.B, args.P, args.Q, args.d, args.dtype, "cuda")
    leaves = [v for v in inputs.values() if v is not None]
    N = sum(
        v.shape[0] * (v.shape[1] if v.dim() == 3 else 1) for k, v in inputs.items() if k != "anchor" and v is not None
    )
    fn = build("triton", args.loss, inputs)

    def step():
        for v in leaves:
            v.grad = None
        fn().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = {e.key: (e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0}

    # cuBLAS at the step's shapes, bf16 in, fp32 accumulation
    a = torch.randn(args.B, args.d, device="cuda", dtype=dt)
    c = torch.randn(N, args.d, device="cuda", dtype=dt)
    ds = torch.randn(args.B, N, device="cuda", dtype=dt) if args.B * N * 2 <= 2**31 else None
    gemm = {"A C^T": best_ms(lambda: a @ c.T, 20)}
    if ds is not None:
        gemm["dS^T A"] = best_ms(lambda: ds.T @ a, 20)
        gemm["dS C"] = best_ms(lambda: ds @ c, 20)
    flops = 2.0 * args.B * N * args.d
    rate = {k: flops / (v * 1e-3) / 1e12 for k, v in gemm.items()}
    out = {"shape": vars(args) | {"N": N}, "cublas_ms": gemm, "cublas_tflops": rate, "kernels": {}}
    print(
        f"{args.loss} B={args.B} N={N} d={args.d} {args.dtype}; cuBLAS A C^T {gemm['A C^T']:.3f} ms ({rate['A C^T']:.0f} TFLOP/s)"
    )
    passes = {"_lse_fwd_kernel": 1, "_lse_ds_kernel": 1, "_mm_kernel": 2}
    for name, (ms, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        row = {"ms": ms, "calls": calls}
        if name in passes:
            tf = passes[name] * flops / (ms * 1e-3) / 1e12
            ref = (
                rate["A C^T"]
                if name != "_mm_kernel"
                else sum(rate.get(k, rate["A C^T"]) for k in ("dS^T A", "dS C")) / 2
            )
            row.update(tflops=tf, share_of_cublas=tf / ref)
            print(f"  {name:28s} {ms:8.3f} ms {calls:4d}x  {tf:6.0f} TFLOP/s  {100 * tf / ref:5.1f}% of cuBLAS")
        else:
            print(f"  {name[:60]:60s} {ms:8.3f} ms {calls:4d}x")
        out["kernels"][name] = row
    eager = best_ms(step, 10)
    replay = capture_step(lambda: fn(), leaves)
    graphed = best_ms(replay, 10)
    out.update(step_ms=eager, graph_step_ms=graphed, launches=sum(c for _, c in kernels.values()))
    print(f"  step {eager:.3f} ms eager, {graphed:.3f} ms as a CUDA graph; {out['launches']} kernel launches")
    print(f"  (temperature {TEMPERATURE})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
