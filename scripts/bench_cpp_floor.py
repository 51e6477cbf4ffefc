"""Share of the GEMM floor of the cpp fused kernel on a prefix of anchors at a given N.

Calls ``torch.ops.fastcl.lse_fused`` directly (cross-entropy head, one positive logit per row,
every candidate shared, no fold) on ``B`` anchors against ``N`` candidates of width ``d``,
interleaved round by round with the floor (``benchmarks.harness.floor``) of the same shape and
with any ``--env`` variants of the kernel's knobs (``FASTCL_CPP_TILE``, ``FASTCL_CPP_GEMM`` and
the test hooks ``_FASTCL_TEST_CPP_*``: ``fastcl.config``, re-read around each variant's step, a
few microseconds), so a loaded machine hits all of them alike. Prints min
time and share of the floor.

    python scripts/bench_cpp_floor.py --B 512 --N 40960 --d 768 --env base= --env R128=_FASTCL_TEST_CPP_ROWS=128
    python scripts/bench_cpp_floor.py --loss infonce --B 1024 --P 1 --Q 0 --d 128 --impl cpp --around
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from fastcl import config
from fastcl.ops import _cpp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: the repository root (benchmarks.harness)

from benchmarks.harness.floor import fastest_floor, floor_step, named_floor_plans  # noqa: E402
from benchmarks.harness.timing import interleave  # noqa: E402


def fused_step(B: int, N: int, d: int, n1: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, d, generator=g)
    c0 = torch.randn(N - n1, d, generator=g)
    c1 = torch.randn(n1, d, generator=g)
    t0 = torch.full((N - n1,), -1, dtype=torch.int32)
    t1 = torch.full((n1,), -1, dtype=torch.int32)
    tau = torch.tensor(0.05)
    pos = torch.randn(B, 1, generator=g)
    w = torch.ones(B)
    out = dict(
        lse=torch.empty(B),
        mean_logit=torch.empty(B),
        loss_rows=torch.empty(B),
        d_pos=torch.empty(B, 1),
        d_anchor=torch.empty(B, d),
        d_block0=torch.empty(N - n1, d),
        d_block1=torch.empty(n1, d),
        g_dot_mean_logit=torch.empty(()),
    )

    def step():
        torch.ops.fastcl.lse_fused(
            a, c0, c1, t0, t1, tau, True, 1e-8, "cross_entropy", pos, None, None, w, 0, False, **out
        )
        return out

    return step


def around_the_op(step):
    """``(op, minimal)`` for a ``cpp`` loss step: its own ``lse_fused`` call with the arguments
    it passed (outputs reused), and that call inside a minimal ``torch.autograd.Function`` (fresh
    outputs, ``loss_rows.sum()``, the stored gradients handed back): what any autograd loss
    around the op costs, without fastcl's Python (benchmarks/results/cpu-2026-11-27-amd/notes.md, "Fifth look")."""
    ns, real, seen = torch.ops.fastcl, torch.ops.fastcl.lse_fused, {}

    def spy(*a, **k):
        seen.update(a=a, k=k)
        return real(*a, **k)

    ns.lse_fused = spy
    try:
        step()
    finally:
        ns.lse_fused = real
    args, out = [x.detach() if isinstance(x, torch.Tensor) else x for x in seen["a"]], seen["k"]

    class Minimal(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, c0):
            fresh = {n: torch.empty_like(v) for n, v in out.items()}
            real(a, c0, *args[2:], **fresh)
            ctx.save_for_backward(fresh["d_anchor"], fresh["d_block0"])
            return fresh["loss_rows"].sum()

        @staticmethod
        def backward(ctx, _):
            return ctx.saved_tensors

    a, c0 = (t.clone().requires_grad_() for t in args[:2])

    def minimal():
        a.grad = c0.grad = None
        Minimal.apply(a, c0).backward()

    return (lambda: real(*args, **out)), minimal


def with_env(step, env: dict[str, str]):
    def run():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        config.reload()  # fastcl.config reads the environment only when told to
        try:
            step()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            config.reload()

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, required=True)
    ap.add_argument("--N", type=int, help="candidates of the direct op call (default B * (P + Q))")
    ap.add_argument("--loss", help="time this loss's whole step (benchmarks.harness.cases.loss_step) instead of the op")
    ap.add_argument("--N1", type=int, default=0, help="of the N candidates, how many in the second block")
    ap.add_argument("--P", type=int, default=5)
    ap.add_argument("--Q", type=int, default=5)
    ap.add_argument(
        "--impl",
        action="append",
        default=[],
        help="with --loss: backends to time, repeated or comma-separated (default cpp, torch)",
    )
    ap.add_argument("--d", type=int, required=True)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        help="name=VAR=value[,VAR=value] (name= for defaults): variants of the op, or with --loss of the first --impl",
    )
    ap.add_argument(
        "--around",
        action="store_true",
        help="with --loss: also the op alone with the loss's arguments and inside a minimal autograd Function",
    )
    ap.add_argument("--budget", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--cpu-clock",
        action="store_true",
        help="time.process_time instead of wall time (meaningful at --threads 1 on a loaded machine)",
    )
    args = ap.parse_args()
    args.impl = [name for spec in args.impl for name in spec.split(",") if name]
    torch.set_num_threads(args.threads)
    why = _cpp.CppLSE().unavailable()
    assert why is None, why
    if args.N is None:
        args.N = args.B * (args.P + args.Q)
    plans = named_floor_plans(args.B, args.N, args.d)
    steps = {name: floor_step(p) for name, p in plans.items()}
    if args.loss:
        from benchmarks.harness.cases import loss_step

        for impl in args.impl or ["cpp", "torch"]:
            steps[impl] = loss_step(args.loss, impl, args.B, args.P, args.Q, args.d)
        if args.around:  # a single-block loss (one candidate block): infonce, supcon without negatives
            steps["op"], steps["minimal"] = around_the_op(loss_step(args.loss, "cpp", args.B, args.P, args.Q, args.d))
    # --env variants wrap the op call, or with --loss the first implementation's step
    base = steps[(args.impl or ["cpp"])[0]] if args.loss else fused_step(args.B, args.N, args.d, args.N1)
    for spec in args.env or ([] if args.loss else ["cpp="]):
        name, _, rest = spec.partition("=")
        env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        steps[name] = with_env(base, env)
    load0 = os.getloadavg()[0]
    clock = time.process_time if args.cpu_clock else time.perf_counter
    res = interleave(steps, min_rounds=args.rounds, budget_s=args.budget, clock=clock)
    load1 = os.getloadavg()[0]
    # a long floor times a prefix of its blocks (scale); the floor is its fastest blocking
    seconds = {n: res.minimum(n) * (plans[n].scale if n in plans else 1.0) for n in res.samples}
    _, fl = fastest_floor(plans, res.samples)
    print(
        f"B={args.B} N={args.N} d={args.d} threads={args.threads} clock={'cpu' if args.cpu_clock else 'wall'} rounds={res.rounds} load {load0:.1f}->{load1:.1f}"
    )
    for n, exc in res.errors.items():
        print(f"  {n:12s} failed: {exc!r}")
    for n, m in seconds.items():
        rows = f" ({plans[n].rows} rows)" if n in plans else ""
        print(f"  {n:12s} {m * 1e3:9.1f} ms  spread {res.spread(n) * 100:5.1f}%  share {fl / m * 100:5.1f}%{rows}")


if __name__ == "__main__":
    main()
