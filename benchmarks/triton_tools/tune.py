"""Tune the config table on this GPU: ``python -m benchmarks.triton_tools.tune``.

For each tile role (``fwd``, ``ds``, ``mm``) and each requested dtype and feature width, the
candidates of ``configs.candidates`` (at most eight, the current entry first) are timed
inside a whole loss step (SupMPN P = Q = 5, forward and backward, every other role at its
current entry), with CUDA events, the minimum over interleaved rounds. The winners are
printed beside each candidate's time and, with ``--write``, stored in the arch's table
(``kernels/tuned/<arch>.json``, or ``--out``) with the device and versions they were measured
on. This is the only place where fastcl benchmarks a config: a training step reads the table
and never times anything (docs/triton.md, "Config tables").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness.timing import best_ms
from fastcl.kernels import configs
from fastcl.kernels._common import arch_of, dtype_class

ROLES = ("fwd", "ds", "mm")


def _step(B: int, d: int, dtype: torch.dtype, device: str = "cuda", P: int = 5, Q: int = 5):
    import fastcl.losses as L

    gen = torch.Generator(device=device).manual_seed(0)
    a, p, n = (torch.randn(*s, device=device, generator=gen).to(dtype) for s in ((B, d), (B, P, d), (B, Q, d)))
    leaves = [x.requires_grad_() for x in (a, p, n)]

    def run():
        for x in leaves:
            x.grad = None
        L.supmpn_loss(*leaves, temperature=0.05, backend="triton").backward()

    return run


def _time(fn, rounds: int) -> float:
    """Minimum milliseconds of ``fn`` over ``rounds`` CUDA-event-timed calls."""
    return best_ms(fn, rounds, "cuda")


def tune(
    B: int, d: int, dtype: torch.dtype, rounds: int = 10, roles=ROLES, log=print, device: str = "cuda", timer=_time
) -> dict[str, configs.Config]:
    """The fastest candidate of each role at this shape (``{key: Config}``); ``timer(fn,
    rounds)`` gives a step's time (CUDA events; the tests pass their own)."""
    arch, dclass = arch_of(torch.device(device)), dtype_class(dtype)
    step = _step(B, d, dtype, device)
    winners: dict[str, configs.Config] = {}
    for role in roles:
        key = configs.key(role, arch, dclass, configs.d_class(d))
        cands = configs.candidates(role, arch, dclass)
        times = {}
        for c in cands:  # compile and warm each once (outside the timed rounds)
            with configs.override({**winners, key: c}):
                try:
                    t0 = time.perf_counter()
                    step()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    log(f"  {key} {c.describe()}: compiled in {time.perf_counter() - t0:.1f} s")
                except Exception as exc:  # a candidate that cannot run here is skipped, loudly
                    log(f"  {key} {c.describe()}: FAILED {type(exc).__name__}: {exc}")
                    continue
                times[c] = float("inf")
        for _ in range(rounds):  # interleaved rounds: every candidate once per round
            for c in times:
                with configs.override({**winners, key: c}):
                    times[c] = min(times[c], timer(step, 1))
        if not times:
            raise RuntimeError(f"no candidate of {key} ran")
        best = min(times, key=times.get)
        for c, t in sorted(times.items(), key=lambda kv: kv[1]):
            log(f"{key} {c.describe():40s} {t:8.3f} ms{'  <- best' if c == best else ''}")
        winners[key] = best
    return winners


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.triton_tools.tune", description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=4096, help="anchors of the SupMPN step timed (P = Q = 5)")
    parser.add_argument("--d", default="768", help="comma list of feature widths (one per d class)")
    parser.add_argument("--dtypes", default="bfloat16", help="comma list of bfloat16,float16,float32")
    parser.add_argument("--roles", default=",".join(ROLES))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--write", action="store_true", help="store the winners in the arch's table")
    parser.add_argument("--out", default=None, help="table file to write (default: kernels/tuned/<arch>.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("tuning needs a CUDA device")
    arch = arch_of(torch.device("cuda"))
    out = Path(args.out) if args.out else configs.TUNED_DIR / f"{arch}.json"
    entries = configs.read_table(out) if out.is_file() else {}
    for dt in args.dtypes.split(","):
        for d in (int(x) for x in args.d.split(",")):
            entries.update(tune(args.B, d, getattr(torch, dt), args.rounds, tuple(args.roles.split(","))))
    if args.write:
        import triton

        note = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "shape": f"supmpn B={args.B} P=Q=5 d={args.d}",
        }
        configs.write_table(out, entries, note)
        print(f"wrote {out}")
    else:
        print(json.dumps({k: c.to_json() for k, c in entries.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
