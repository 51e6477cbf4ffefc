"""Share of the GEMM floor of the cpp backend's extensions (the sigmoid reduction, the guide filter).

Times the backend's gradient-in-forward sweep (``CppLSE.fused``: forward and every gradient) on
two problems, interleaved round by round with their floors (the GEMMs a fused step needs, by
``torch.mm`` on the same shapes, in the same process), and prints the minimum over the rounds and
floor / step:

* ``siglip``: SigLIP's pairwise sigmoid, ``B`` images against ``N = B`` texts (block 0, image i's
  text is its pair: ``OwnPositives(0, 1)``), cosine, ``tau = 0.1``, bias -10; floor: ``A C^T``,
  ``X C``, ``X^T A``.
* ``gist``: an MNRL/InfoNCE step filtered by a guide model (GIST: a candidate whose guide cosine
  exceeds the guide's cosine of the anchor's own positive minus 0.1 leaves the row), guide width
  ``g``; floor: the three model GEMMs and the guide's ``A_g C_g^T``.
* ``plain``: the same InfoNCE step without a filter, the plain LSE's share for comparison.

With ``--threads 1`` the times are CPU seconds (``time.process_time``: other processes on a
loaded machine cost little), otherwise wall seconds. ``--env name=VAR=value`` adds a variant of
the step with ``fastcl.config`` knobs read from that environment (e.g. ``mkl=FASTCL_CPP_GEMM=mkl``).

    python scripts/bench_cpp_extensions.py --B 4096 --d 768 --g 384 [--threads 1] [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: the repository root (benchmarks.harness)

from benchmarks.harness.timing import interleave  # noqa: E402
from fastcl import config  # noqa: E402
from fastcl.ops import dispatch  # noqa: E402
from fastcl.ops.contract import TAG_ALL, Filter, LSEProblem, OwnPositives, Sigmoid, empty_block  # noqa: E402
from fastcl.ops.head import SIGMOID_HEAD, HeadInputs  # noqa: E402


def problem(case: str, B: int, d: int, g: int, seed: int = 0) -> LSEProblem:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(B, d, generator=gen)
    c = a + torch.randn(B, d, generator=gen)  # each anchor's own positive / pair, at row i of block 0
    empty, empty_tags = empty_block(a)
    tags = (torch.full((B,), TAG_ALL, dtype=torch.int32), empty_tags)
    pos = OwnPositives(0, 1)
    if case == "siglip":
        return LSEProblem(a, (c, empty), tags, positives=pos, sigmoid=Sigmoid(torch.tensor(-10.0)))
    if case == "plain":
        return LSEProblem(a, (c, empty), tags, positives=pos)
    ga = torch.randn(B, g, generator=gen)
    gc = ga + torch.randn(B, g, generator=gen)
    unit_a, unit_c = torch.nn.functional.normalize(ga, dim=1), torch.nn.functional.normalize(gc, dim=1)
    threshold = (unit_a * unit_c).sum(1) - 0.1  # the guide's cosine of (i, pos_i) minus the margin
    filt = Filter(threshold, ga, (gc, empty.new_empty(0, g)))
    return LSEProblem(a, (c, empty), tags, positives=pos, filter=filt)


def step(prob: LSEProblem, tau: torch.Tensor):
    impl = dispatch.get("cpp")
    why = impl.unavailable()  # builds and loads the library (first use)
    if why:
        raise SystemExit(why)
    B = prob.num_anchors
    w = torch.full((B,), 1.0 / B)
    kind = SIGMOID_HEAD if prob.sigmoid is not None else "cross_entropy"
    head = HeadInputs(kind, None, None, None, w)  # the kernel forms the own positives' logits
    return lambda: impl.fused(prob, tau, head)


def floor(prob: LSEProblem):
    a, c = prob.anchor, prob.blocks[0]
    x = torch.empty(a.shape[0], c.shape[0])
    f = prob.filter
    guide = (
        None if f is None or f.guide_anchor is None or f.guide_blocks is None else (f.guide_anchor, f.guide_blocks[0])
    )

    def run():
        torch.mm(a, c.T, out=x)
        torch.mm(x, c)
        torch.mm(x.T, a)
        if guide is not None:
            torch.mm(guide[0], guide[1].T, out=x)

    return run


def with_env(env: dict[str, str], fn):
    """``fn`` run with ``env`` in os.environ and fastcl.config re-read around it."""
    if not env:
        return fn

    def run():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        config.reload()
        try:
            fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            config.reload()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="siglip,gist")
    ap.add_argument("--B", type=int, default=4096)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--g", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--env", action="append", default=[], help="name=VAR=value: a variant of the step")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    variants = {"cpp": {}}
    for spec in args.env:
        name, _, assign = spec.partition("=")
        var, _, value = assign.partition("=")
        variants.setdefault(name, {})[var] = value
    tau = torch.tensor(0.1)
    for case in args.cases.split(","):
        prob = problem(case, args.B, args.d, args.g)
        fns = {"floor": floor(prob)} | {n: with_env(e, step(prob, tau)) for n, e in variants.items()}
        res = interleave(fns, min_rounds=args.rounds, max_rounds=args.rounds, budget_s=0.0, clock=clock)
        best = {n: res.minimum(n) for n in fns}
        names = list(fns)
        load = os.getloadavg()[0]
        unit = "CPU s" if clock is time.process_time else "s"
        row = ", ".join(f"{n} {best[n]:.3f} {unit}" for n in names)
        shares = ", ".join(f"{n} {best['floor'] / best[n]:.1%}" for n in names[1:])
        print(
            f"{case} B={args.B} N={args.B} d={args.d}{f' g={args.g}' if case == 'gist' else ''}, "
            f"{torch.get_num_threads()} thread(s), load {load:.1f}: {row}; share of the floor: {shares}",
            flush=True,
        )


if __name__ == "__main__":
    main()
