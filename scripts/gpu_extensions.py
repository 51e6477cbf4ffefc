"""The primitive's extensions on a GPU: a SigLIP-shaped sigmoid loss and a GIST-filtered LSE loss,
one training step (forward + backward) per backend, CUDA events, best of ``--reps``.

* ``siglip``: ``B`` image/text pairs (``d`` features, bf16), every text a candidate of every
  image, the pair's ``z = +1`` (``contract.Sigmoid``; B = 16384, d = 768 by default);
* ``gist``: SupMPN's layout at ``--gist-B`` anchors (``P = Q = 5``) with a guide filter
  (``contract.Filter``, a 384-wide fp32 guide, GIST's absolute margin 0.1), on the fused head step.

Prints ms per step and the Triton kernels' share (profiler) per backend; ``--json FILE`` keeps
the numbers. ``--device cpu --impls torch`` with small sizes is a dry run of the script itself.

    python scripts/gpu_extensions.py [--B 16384] [--d 768] [--gist-B 4096] [--impls triton,torch]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: the repository root (benchmarks.harness)

from benchmarks.harness.timing import best_ms  # noqa: E402
from fastcl.ops import contrastive, sigmoid  # noqa: E402
from fastcl.ops.contract import TAG_ALL, Filter, OwnPositives  # noqa: E402
from fastcl.ops.head import SIGMOID_HEAD  # noqa: E402


def _siglip(B: int, d: int, dt, dev, backend: str):
    g = torch.Generator(device=dev).manual_seed(0)
    img = torch.randn(B, d, generator=g, device=dev).to(dt).requires_grad_()
    txt = torch.randn(B, d, generator=g, device=dev).to(dt).requires_grad_()
    tags = (torch.full((B,), TAG_ALL, dtype=torch.int32, device=dev), torch.empty(0, dtype=torch.int32, device=dev))
    tau = torch.tensor(0.1, device=dev, requires_grad=True)
    bias = torch.tensor(-10.0, device=dev, requires_grad=True)
    w = torch.full((B,), 1.0 / B, device=dev)
    empty = txt.new_empty((0, d))

    def step():
        for x in (img, txt, tau, bias):
            x.grad = None
        spec = contrastive.LossSpec(
            SIGMOID_HEAD, tags, "mean", w, cosine=True, eps=1e-8, positives=OwnPositives(0, 1), backend=backend
        )
        loss = sigmoid.sigmoid_loss(img, (txt, empty), tau, bias, spec)
        loss.backward()

    return step


def _gist(B: int, d: int, dt, dev, backend: str, P: int = 5, Q: int = 5, gd: int = 384):
    g = torch.Generator(device=dev).manual_seed(1)
    anchor = torch.randn(B, d, generator=g, device=dev).to(dt).requires_grad_()
    b0 = torch.randn(B * P, d, generator=g, device=dev).to(dt).requires_grad_()
    b1 = torch.randn(B * Q, d, generator=g, device=dev).to(dt).requires_grad_()
    ga, g0, g1 = (torch.randn(n, gd, generator=g, device=dev) for n in (B, B * P, B * Q))
    own = torch.arange(B, dtype=torch.int32, device=dev).repeat_interleave(P)
    tags = (own, torch.full((B * Q,), TAG_ALL, dtype=torch.int32, device=dev))
    pos_sim = torch.nn.functional.cosine_similarity(ga, g0[::P], dim=-1)
    flt = Filter(pos_sim - 0.1, ga, (g0, g1))
    tau = torch.tensor(0.05, device=dev)
    w = torch.full((B,), 1.0 / B, device=dev)

    def step():
        for x in (anchor, b0, b1):
            x.grad = None
        spec = contrastive.LossSpec(
            "softplus", tags, "mean", w, cosine=True, eps=1e-8, positives=OwnPositives(0, P), filter=flt,
            backend=backend,
        )  # fmt: skip
        loss = contrastive.contrastive_loss(anchor, (b0, b1), tau, spec)
        loss.backward()

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=16384)
    p.add_argument("--gist-B", type=int, default=4096)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impls", default="triton,torch")
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dt, dev = getattr(torch, args.dtype), torch.device(args.device)
    out: dict = {"args": vars(args), "ms": {}}
    for case, make, B in (("siglip", _siglip, args.B), ("gist", _gist, args.gist_B)):
        for impl in args.impls.split(","):
            try:
                step = make(B, args.d, dt, dev, impl)
                step()  # warm (compile, scratch)
                ms = best_ms(step, args.reps, dev.type)
            except Exception as exc:  # one failing case must not hide the others' numbers
                print(f"{case} B={B} d={args.d} {args.dtype} {impl}: FAILED {type(exc).__name__}: {exc}", flush=True)
                continue
            out["ms"][f"{case}/{impl}"] = ms
            print(f"{case} B={B} d={args.d} {args.dtype} {impl}: {ms:.3f} ms per step", flush=True)
            if dev.type == "cuda" and impl == "triton":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:6]:
                    if e.device_time_total > 0:
                        print(f"    {e.key[:60]:60s} {e.device_time_total / 1e3:8.3f} ms {e.count:4d}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
