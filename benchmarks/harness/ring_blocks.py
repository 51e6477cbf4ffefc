"""The cost of splitting: the ring's per-block primitive against one call, on one device.

``cross_device="ring"`` runs the backend's ``forward`` and ``backward`` once per rank's
candidate block (``fastcl.ops.ring``) instead of once on every candidate. This measures
that split without any communication ("simulated hops": the ``W`` blocks already sit on
this device), on the exact code the ring runs per block (``fastcl.ops.blockwise``):

* ``blocks``: what one rank runs: ``forward`` and an online merge for its own block (whole)
  and for each of the ``pieces`` row ranges of the other ``W - 1`` blocks (``ring_pieces``,
  ``fastcl.ops.ring_comm``), then ``backward`` for each with ``g_t = g * exp(lse_t - lse)``;
* ``single``: ``forward`` and ``backward`` once on the concatenated ``W * N`` candidates (the
  recompute strategy, as the ring uses for every block on ``triton`` and for the other
  ranks' blocks elsewhere; a backend with a gradient-in-forward path is also timed as
  ``single_fused``, what the gather mode runs by default).

``share = single / blocks`` (the ring's target on a GPU: >= 0.9). Timing: interleaved rounds,
minimum, CUDA-synchronised (``benchmarks.harness.timing``). From a GPU lease::

    python -m benchmarks.harness.ring_blocks --B 4096 --P 5 --Q 5 --d 768 --world 2 4 8 --dtype bfloat16 [--pieces 2]

or ``ring_blocks_throughput(B=4096, P=5, Q=5, d=768, world=8)`` from a script.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.harness.timing import interleave
from fastcl import config
from fastcl.ops import dispatch
from fastcl.ops.blockwise import Merged, block_grad
from fastcl.ops.contract import TAG_ALL, LSEProblem, OwnPositives, compute_dtype, structured_tags
from fastcl.ops.head import HeadInputs
from fastcl.ops.ring_comm import split as row_ranges


def _blocks(B: int, P: int, Q: int, d: int, world: int, dtype: torch.dtype, device: torch.device, seed: int):
    """One rank's anchors and ``world`` candidate blocks (block 0 holds their own positives)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    anchor = randn(B, d)
    own = structured_tags(B, P, None, device=device, exclude_owner=True)
    other = torch.full((B * P,), TAG_ALL, dtype=torch.int32, device=device)
    neg = torch.full((B * Q,), TAG_ALL, dtype=torch.int32, device=device)
    blocks = [((randn(B * P, d), randn(B * Q, d)), (own if t == 0 else other, neg)) for t in range(world)]
    return anchor, blocks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ring_blocks_throughput(
    *,
    B: int,
    P: int,
    Q: int,
    d: int,
    world: int,
    dtype: str = "bfloat16",
    device: str = "cuda",
    backend: str = "auto",
    budget_s: float = 5.0,
    min_rounds: int = 3,
    seed: int = 0,
    pieces: int | None = None,
) -> dict:
    """Time one rank's loss step split into ``world`` blocks against one call (module docstring).

    Returns a JSON-able dict: the case, the backend, ``blocks_s``, ``single_s`` (and
    ``single_fused_s`` when the backend has a fused path), their spreads and ``share``.
    ``pieces``: row ranges per other rank's block (default ``fastcl.config``'s ``ring_pieces``).
    """
    pieces = config.get().ring_pieces if pieces is None else pieces
    dev, dt = torch.device(device), getattr(torch, dtype)
    anchor, blocks = _blocks(B, P, Q, d, world, dt, dev, seed)
    pos = OwnPositives(0, P)
    cd = compute_dtype(dt)
    tau = torch.tensor(0.05, dtype=torch.float32, device=dev)
    (own, own_tags), others = blocks[0], blocks[1:]
    parts = [LSEProblem(anchor, own, own_tags, positives=pos)]
    for b, t in others:  # the ring's pieces: row ranges of both blocks and their tags alike
        for b0, b1, t0, t1 in row_ranges([b[0], b[1], t[0], t[1]], pieces):
            parts.append(LSEProblem(anchor, (b0, b1), (t0, t1)))
    whole = LSEProblem(
        anchor,
        (torch.cat([b[0] for b, _ in blocks]), torch.cat([b[1] for b, _ in blocks])),
        (torch.cat([t[0] for _, t in blocks]), torch.cat([t[1] for _, t in blocks])),
        positives=pos,
    )
    impl = dispatch.choose(whole, backend=backend)
    g = torch.full((B,), 1.0 / B, dtype=cd, device=dev)
    d_pos = torch.full((B, P), -1.0 / (B * P), dtype=cd, device=dev)

    def split() -> None:
        merged, partials = Merged(), []
        for p in parts:
            lse_t, ml_t = impl.forward(p, tau)
            merged.add(lse_t, ml_t)
            partials.append(lse_t)
        for i, (p, lse_t) in enumerate(zip(parts, partials, strict=True)):
            impl.backward(p, tau, lse_t, block_grad(g, merged.lse, lse_t), d_pos if i == 0 else None)
        _sync(dev)

    def single() -> None:
        lse, _ = impl.forward(whole, tau)
        impl.backward(whole, tau, lse, g, d_pos)
        _sync(dev)

    steps = {"blocks": split, "single": single}
    if impl.fused is not None:
        head = HeadInputs("softplus", torch.zeros((B, P), dtype=cd, device=dev), None, None, g)

        def fused() -> None:
            impl.fused(whole, tau, head)
            _sync(dev)

        steps["single_fused"] = fused
    timed = interleave(steps, budget_s=budget_s, min_rounds=min_rounds)
    if timed.errors:
        name, exc = next(iter(timed.errors.items()))
        raise RuntimeError(f"ring_blocks_throughput: {name} failed: {type(exc).__name__}: {exc}") from exc
    out = dict(B=B, P=P, Q=Q, d=d, world=world, pieces=pieces, dtype=dtype, device=str(dev), backend=impl.name)
    for name in steps:
        out[f"{name}_s"], out[f"{name}_spread"] = timed.minimum(name), timed.spread(name)
    out["share"] = out["single_s"] / out["blocks_s"]
    out["rounds"], out["noisy"] = timed.rounds, timed.noisy()
    return out


def main(argv: list[str] | None = None) -> None:
    """Command line: prints one JSON line per ``--world`` value."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("B", 4096), ("P", 5), ("Q", 5), ("d", 768)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--budget-s", type=float, default=5.0)
    parser.add_argument("--pieces", type=int, default=None, help="row ranges per other block (default: ring_pieces)")
    args = parser.parse_args(argv)
    for world in args.world:
        case = dict(B=args.B, P=args.P, Q=args.Q, d=args.d, dtype=args.dtype, device=args.device)
        run = ring_blocks_throughput(
            world=world, backend=args.backend, budget_s=args.budget_s, pieces=args.pieces, **case
        )
        print(json.dumps(run))


if __name__ == "__main__":
    main()
