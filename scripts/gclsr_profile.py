"""Profile GCLSR training steps (paper network) on a small subset: where does the time go?

    OMP_NUM_THREADS=1 FASTCL_DATA_DIR=/path/to/data python scripts/gclsr_profile.py \\
        --sentences 256 --batch-size 128 --steps 2 [--torch-profiler]

Prints the wall time of each phase of a step (collate = word-vector lookup + PWVA,
forward, backward, optimiser) averaged over ``--steps`` (after one warm-up step), and with
``--torch-profiler`` the top operators. Timings on a shared machine are indicative only.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from fastcl.cli.train import parse
from fastcl.trainers.recipe import StepContext


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sentences", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-words", type=int, default=64)
    p.add_argument("--torch-profiler", action="store_true")
    p.add_argument("--eval", action="store_true", help="also time one STS-B dev evaluation")
    args = p.parse_args(argv)

    recipe, cfg = parse(
        [
            "gclsr",
            "--preset",
            "paper",
            "--batch-size",
            str(args.batch_size),
            "--max-examples",
            str(args.sentences),
            "--max-words",
            str(args.max_words),
        ]
    )
    t = time.perf_counter()
    data = recipe.build_dataset(cfg)
    print(f"vectors + tokenise {len(data)} sentences: {time.perf_counter() - t:.2f} s")
    torch.manual_seed(0)
    model = recipe.build_model(cfg)
    opt = recipe.build_optimizer(cfg, model)
    sched = recipe.build_scheduler(cfg, opt, 100)
    n_params = sum(q.numel() for q in model.parameters())
    print(
        f"parameters: {n_params / 1e6:.1f} M (backbone {sum(q.numel() for q in model.backbone.parameters()) / 1e6:.2f} M)"
    )

    phases: dict[str, float] = {}
    cpu = [0.0]  # process CPU seconds per step: less distorted than wall time on a loaded machine

    def step(i: int, record: bool) -> None:
        ctx = StepContext(cfg=cfg, step=i, rng=random.Random(i))
        c0 = time.process_time()
        times = [time.perf_counter()]
        batch = recipe.collate(data[(i * args.batch_size) % len(data) :][: args.batch_size], ctx)
        times.append(time.perf_counter())
        model.train()
        loss, _ = recipe.loss(model, batch, ctx)
        times.append(time.perf_counter())
        loss.backward()
        times.append(time.perf_counter())
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
        if record:
            cpu[0] += (time.process_time() - c0) / args.steps
            for name, a, b in zip(("collate", "forward", "backward", "optimiser"), times, times[1:]):
                phases[name] = phases.get(name, 0.0) + (b - a) / args.steps

    step(0, False)  # warm-up (allocations, lazy init)
    if args.torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(args.steps):
                step(i + 1, True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    else:
        for i in range(args.steps):
            step(i + 1, True)
    total = sum(phases.values())
    print(f"threads {torch.get_num_threads()}, batch {args.batch_size}, max words {args.max_words}")
    for name, v in phases.items():
        print(f"  {name:10s} {v:7.3f} s  ({100 * v / total:4.1f} %)")
    print(f"  {'step':10s} {total:7.3f} s wall, {cpu[0]:.3f} s process CPU")
    if args.eval:
        from fastcl.trainers.loop import _dev_task, evaluate_dev

        t = time.perf_counter()
        score = evaluate_dev(recipe, model, _dev_task(cfg))
        print(f"STS-B dev evaluation: {time.perf_counter() - t:.2f} s (score {score:.2f})")


if __name__ == "__main__":
    main()
