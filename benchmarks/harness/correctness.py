"""Correctness at scale: every implementation's loss and gradients against float64.

    python -m benchmarks.harness correctness --device cuda --out results/correctness.json
    python -m benchmarks.harness correctness --device cpu --scale 0.03125   # a CPU dry run

For each workload (loss, B, P, Q, d) and dtype, the float64 oracle on the same (rounded)
inputs gives the reference loss and gradients; each available implementation of
``benchmarks.harness.peers`` is compared with it. fastcl backends must match the value within
``value_tol`` and every gradient within ``grad_rtol`` (``fastcl.testing``, derived from the
dtype's epsilon, the workload's ``B``, ``N``, ``d`` and the logits' size ``1 / tau``; relative
Frobenius error of the gradients) beyond the error of the reference gradient itself rounded to
the input dtype (its storage floor); peers must match the value (their gradients are
reported, not asserted: they are not ours to fix). Exit status 1 if anything fails; the JSON
lists every comparison.

Why the storage floor: gradients come back in the input dtype, and those of a mean over
thousands of anchors are ~1e-8 to 1e-6, below fp16's normal range (6e-5), where fp16 keeps
few digits or none. The first fp16 run on a GPU measured relative errors up to 0.7 for
every implementation alike, sentence-transformers' (which computes in fp32) included; the
exact gradient rounded to fp16 has the same error. No implementation can beat the floor,
so the tolerance is counted above it (bf16's floor is its rounding, ~1.7e-3; fp32's ~3e-8).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.harness import peers
from benchmarks.harness.cases import LOSSES, make_inputs
from benchmarks.harness.metrics import num_candidates
from fastcl.testing import grad_rtol, rel_err

# (loss, B, P, Q, d) at scale 1: the oracle's float64 logits stay a few GiB on an H100
WORKLOADS = [
    ("infonce", 16384, 1, 0, 768),
    ("mnrl", 8192, 1, 1, 768),
    ("supmpn", 2048, 5, 5, 768),
    ("supcon", 2048, 5, 5, 768),
]
# --large: the sizes. The oracle's [B, N] float64 logits would take 34 GiB (InfoNCE)
# and 24 GiB (SupMPN) per buffer there, so the reference is the chunked torch backend in
# float64 instead, itself checked against the oracle at the sizes above.
LARGE_WORKLOADS = [
    ("infonce", 65536, 1, 0, 768),
    ("supmpn", 16384, 5, 5, 768),
]


def _grads(fn, inputs: dict) -> tuple[float, dict]:
    leaves = {k: v for k, v in inputs.items() if v is not None}
    for v in leaves.values():
        v.grad = None
    loss = fn()
    loss.backward()
    return float(loss.detach()), {k: v.grad.detach().clone() for k, v in leaves.items()}


def check_workload(loss: str, B: int, P: int, Q: int, d: int, dtype: str, device: str, impls: list[str]) -> list[dict]:
    """One record per implementation (skipped ones carry the reason)."""
    inputs = make_inputs(loss, B, P, Q, d, dtype, device)
    t64 = {k: (None if v is None else v.detach().double().requires_grad_()) for k, v in inputs.items()}
    fused, oracle, _ = LOSSES[loss]
    n = num_candidates(loss, B, P, Q)
    if B * n <= peers.MAX_EAGER_REFERENCE_ELEMENTS:
        reference = "oracle"
        ref_value, ref_grads = _grads(lambda t=t64: oracle(**t, temperature=peers.TEMPERATURE), t64)
    else:
        reference = "torch-float64"
        run = lambda t=t64: fused(**t, temperature=peers.TEMPERATURE, backend="torch")  # noqa: E731
        ref_value, ref_grads = _grads(run, t64)
    del t64
    dt = inputs["anchor"].dtype
    atol, rtol = peers.value_tolerance(loss, inputs)
    tol = grad_rtol(dt, B=B, N=n, d=d, logit_scale=1 / peers.TEMPERATURE)
    floors = {k: rel_err(g.to(dt), g) for k, g in ref_grads.items()}
    out = []
    for name in impls:
        rec = {
            "loss": loss,
            "B": B,
            "P": P,
            "Q": Q,
            "d": d,
            "dtype": dtype,
            "device": device,
            "impl": name,
            "family": peers.IMPLS[name].family,
            "reference_impl": reference,
            "grad_storage_floor": floors,
            "grad_rtol": tol,
            "value_tol": [atol, rtol],
        }
        why = peers.unavailable(name, loss, device)
        if why:
            out.append({**rec, "status": "skipped", "reason": why})
            continue
        try:
            value, grads = _grads(peers.build(name, loss, inputs), inputs)
        except Exception as exc:  # dispatch refusing the inputs, out of memory: report, go on
            out.append({**rec, "status": "skipped", "reason": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        errs = {k: rel_err(g, ref_grads[k]) for k, g in grads.items()}
        value_ok = abs(value - ref_value) <= atol + rtol * abs(ref_value)
        grads_ok = all(e <= tol + floors[k] for k, e in errs.items())
        ok = value_ok and (grads_ok or rec["family"] != "fastcl")
        out.append(
            {
                **rec,
                "status": "ok" if ok else "FAIL",
                "value": value,
                "reference": ref_value,
                "abs_err": abs(value - ref_value),
                "grad_rel_err": errs,
                "grads_within_tol": grads_ok,
            }
        )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated input dtypes")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every batch size (CPU dry run: 1/32)")
    p.add_argument("--impls", default="", help="comma-separated implementations (default: all)")
    p.add_argument("--out", default=None, help="JSON file for the records")
    p.add_argument("--large", action="store_true", help="also the issue's sizes (InfoNCE B=65536, SupMPN B=16384)")
    p.add_argument(
        "--losses", default="", help="comma-separated losses, checked in this order (default: all, in table order)"
    )


def _line(r: dict) -> str:
    extra = r.get("reason") or (
        f"|dvalue| {r['abs_err']:.2e}, grad rel err (storage floor) "
        + ", ".join(f"{k} {v:.1e} ({r['grad_storage_floor'][k]:.1e})" for k, v in r["grad_rel_err"].items())
    )
    return f"{r['status']:>7}  {r['loss']:<7} B={r['B']:<6} {r['dtype']:<8} {r['impl']:<10} {extra}"


def main(args: argparse.Namespace) -> int:
    impls = [s for s in args.impls.split(",") if s] or [n for n in peers.IMPLS if n != "compile"]
    workloads = WORKLOADS + (LARGE_WORKLOADS if args.large else [])
    if args.losses:
        order = args.losses.split(",")
        unknown = sorted(set(order) - {w[0] for w in workloads})
        if unknown:
            raise SystemExit(f"--losses: no workload for {unknown}; choose from {sorted({w[0] for w in workloads})}")
        workloads = sorted((w for w in workloads if w[0] in order), key=lambda w: order.index(w[0]))
    jobs = [(w, dt) for w in workloads for dt in args.dtypes.split(",")]
    records = []
    # each workload's lines (and the JSON so far) are written as soon as it is done, so a
    # run cut off by a time limit still reports what it checked
    for (loss, B, P, Q, d), dtype in tqdm(jobs, desc="correctness", unit="workload"):
        B = max(2, int(B * args.scale))
        done = check_workload(loss, B, P, Q, d, dtype, args.device, [n for n in impls if loss in peers.IMPLS[n].losses])
        records += done
        for r in done:
            tqdm.write(_line(r))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"device": args.device, "records": records}, indent=1))
    failed = [r for r in records if r["status"] == "FAIL"]
    print(f"{len(records) - len(failed)} of {len(records)} comparisons passed or were skipped; {len(failed)} failed")
    for r in failed:
        print(_line(r))
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
