"""Gather against ring across processes on the CPU (gloo): time per step, bytes sent per rank,
extra peak memory per rank (``benchmarks/bench_ring.py`` records it).

One call spawns ``world`` processes on a file store. Each rank builds its own batch: SupMPN
(``loss="supmpn"``: ``B`` anchors, ``P`` positives and ``Q`` negatives each, width ``d``) or
SigLIP (``loss="siglip"``: ``B`` image and ``B`` text features of width ``d``, a learnable
scale and bias; ``P`` and ``Q`` unused), and, for every mode of ``cross_device``:

1. checks that both modes give the same loss (relative 1e-4; the ring and the gather add
   the same terms in another order);
2. **memory**: extra peak RSS of one forward + backward above the RSS before it
   (``benchmarks.harness.memory.measure_extra_rss``: a warm-up step, then ``VmHWM`` after
   ``clear_refs``; the parent sets ``MALLOC_MMAP_THRESHOLD_`` so freed blocks leave RSS);
   reported as the largest rank's;
3. **bytes**: what one step sends per rank, counted on the calls: point-to-point sends as
   they are; a collective as a bandwidth-optimal (ring) algorithm sends it, ``(W - 1) / W``
   of the gathered or reduced tensor (what gloo and NCCL send for large tensors);
4. **time**: interleaved rounds (the modes alternate, order rotated each round): a barrier,
   then one forward + backward; a step's time is the slowest rank's; the minimum over
   rounds and its spread (``benchmarks.harness.timing.spread``).

Each rank runs ``threads`` intra-op threads (default: the cores this process may use,
divided by ``world``), so the ranks do not oversubscribe the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness.memory import measure_extra_rss
from benchmarks.harness.timing import round_order, spread
from fastcl import distributed

MODES = ("gather", "ring")
LOSSES = ("supmpn", "siglip")
_MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "_FASTCL_TEST_CPP_KEEP_BYTES": "0"}


def _inputs(loss: str, rank: int, B: int, P: int, Q: int, d: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(1000 + rank)
    if loss == "siglip":  # open_clip's initial values: scale 10 (exponentiated), bias -10
        shapes = {"image": (B, d), "text": (B, d)}
        scalars = {"logit_scale": 10.0, "logit_bias": -10.0}
    else:
        shapes = {"anchor": (B, d), "positives": (B, P, d), "negatives": (B, Q, d)}
        scalars = {}
    x = {k: torch.randn(*s, generator=g).to(dtype).requires_grad_() for k, s in shapes.items()}
    x.update({k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in scalars.items()})
    return x


def _step(mode: str, x: dict, backend: str, group) -> torch.Tensor:
    from fastcl import losses

    if "image" in x:
        loss = losses.siglip_loss(
            x["image"], x["text"], x["logit_scale"], x["logit_bias"], backend=backend, process_group=group,
            cross_device=mode,
        )  # fmt: skip
    else:
        loss = losses.supmpn_loss(
            x["anchor"], x["positives"], x["negatives"], temperature=0.05, backend=backend, process_group=group,
            cross_device=mode,
        )  # fmt: skip
    loss.backward()
    for t in x.values():
        t.grad = None
    return loss.detach()


@contextlib.contextmanager
def _count_sent(world: int):
    """Count the bytes this rank sends (module docstring) while inside; yields a 1-item list."""
    sent = [0]
    p2p, gather, scatter = dist.batch_isend_irecv, distributed._all_gather_single, distributed._reduce_scatter_single

    def batch(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return p2p(ops)

    def all_gather(out, local, **kw):
        sent[0] += (world - 1) * local.numel() * local.element_size()
        return gather(out, local, **kw)

    def reduce_scatter(out, full, **kw):
        sent[0] += (world - 1) * out.numel() * out.element_size()
        return scatter(out, full, **kw)

    dist.batch_isend_irecv, distributed._all_gather_single, distributed._reduce_scatter_single = (
        batch,
        all_gather,
        reduce_scatter,
    )
    try:
        yield sent
    finally:
        dist.batch_isend_irecv, distributed._all_gather_single, distributed._reduce_scatter_single = (
            p2p,
            gather,
            scatter,
        )


def _rank(rank: int, world: int, store: str, out_dir: str, case: dict) -> None:
    try:
        torch.set_num_threads(case["threads"])
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
        )
        group = dist.group.WORLD
        dtype = getattr(torch, case["dtype"])
        x = _inputs(case["loss"], rank, case["B"], case["P"], case["Q"], case["d"], dtype)
        modes, backend = case["modes"], case["backend"]
        values = {m: _step(m, x, backend, group) for m in modes}
        ref = values[modes[0]].double()
        for m in modes[1:]:
            err = float((values[m].double() - ref).abs() / ref.abs().clamp_min(1e-30))
            if not err <= 1e-4:
                raise RuntimeError(f"{m} loss differs from {modes[0]}'s by {err:.3g} (relative)")
        out = {m: {} for m in modes}
        for m in modes:
            out[m]["extra_peak_bytes"] = measure_extra_rss(lambda m=m: _step(m, x, backend, group))
            with _count_sent(world) as sent:
                _step(m, x, backend, group)
            out[m]["sent_bytes"] = sent[0]
        samples = {m: [] for m in modes}
        for r in range(case["warmup"] + case["rounds"]):
            for m in round_order(list(modes), r):
                dist.barrier(group)
                t0 = time.perf_counter()
                _step(m, x, backend, group)
                slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                if r >= case["warmup"]:
                    samples[m].append(float(slowest))
        for m in modes:
            out[m]["samples_s"] = samples[m]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier(group)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run(
    *,
    world: int,
    loss: str = "supmpn",
    B: int,
    P: int,
    Q: int,
    d: int,
    dtype: str = "float32",
    backend: str = "auto",
    modes: tuple[str, ...] = MODES,
    rounds: int = 5,
    warmup: int = 1,
    threads: int | None = None,
    timeout_s: float = 1800,
) -> dict:
    """Spawn ``world`` ranks and measure (module docstring); a JSON-able dict per mode with
    ``min_s``, ``spread``, ``samples_s``, ``sent_bytes`` and ``extra_peak_mib`` (largest rank)."""
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}: expected one of {LOSSES}")
    threads = threads or max(1, len(os.sched_getaffinity(0)) // world)
    case = dict(loss=loss, B=B, P=P, Q=Q, d=d, dtype=dtype, backend=backend, modes=list(modes))
    case.update(rounds=rounds, warmup=warmup, threads=threads)
    saved = {k: os.environ.get(k) for k in _MMAP_ENV}
    os.environ.update(_MMAP_ENV)  # read at start by the ranks' glibc and fastcl.config
    try:
        with tempfile.TemporaryDirectory(prefix="fastcl_ring_bench_") as tmp:
            ctx = mp.get_context("spawn")
            store = os.path.join(tmp, "store")
            procs = [ctx.Process(target=_rank, args=(r, world, store, tmp, case), daemon=True) for r in range(world)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                time.sleep(0.05)
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
            errors = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.endswith(".err")]
            if errors or any(p.exitcode != 0 for p in procs):
                codes = [p.exitcode for p in procs]
                raise RuntimeError(f"ring benchmark, {world} ranks, failed (exit codes {codes}):\n" + "\n".join(errors))
            ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result = dict(world=world, **{k: v for k, v in case.items() if k != "modes"}, modes={})
    for m in modes:
        samples = ranks[0][m]["samples_s"]  # every rank holds the same (slowest rank's) times
        result["modes"][m] = dict(
            min_s=min(samples),
            spread=spread(samples),
            samples_s=samples,
            sent_bytes=max(r[m]["sent_bytes"] for r in ranks),
            extra_peak_mib=max(r[m]["extra_peak_bytes"] for r in ranks) / 2**20,
        )
    return result
