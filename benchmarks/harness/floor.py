"""The GEMM floor of one benchmark case: the three products a gradient-in-forward step needs.

A fused contrastive step with the gradient computed in the forward pass does, per block
of anchor rows, three matrix products and some row passes:

* ``S = A_blk · Cᵀ``      ``[h, d] x [d, N]``  (the logits of the block),
* ``dA_blk = X · C``      ``[h, N] x [N, d]``  (X: the block's logit gradients, from S),
* ``dC += Xᵀ · A_blk``    ``[N, h] x [h, d]``  (accumulated over blocks into ``[N, d]``).

The floor is the time of those three GEMMs alone at the case's shape (``B`` anchors,
``N`` candidates, width ``d``, its dtype and device), measured in the same run and the
same interleaved rounds as the implementations (``benchmarks.harness.timing``). An
implementation's **share of the floor** is ``floor / its time``: 100 % would mean the
row passes and everything else cost nothing.

Like a fused step, the floor never holds ``[B, N]``: it works in row blocks of
``rows = max_elements // N`` anchors (the whole batch when ``B x N`` fits), reusing one
``[rows, N]`` buffer for S and X. No one block height is best for every shape, so the
floor is the faster of two (:func:`floor_plans`), both timed in the same rounds. Where the whole step would be long (beyond
``max_flops``), only the first ``timed_blocks`` full blocks run and the time is scaled
by ``B / (rows * timed_blocks)`` (``FloorPlan.scale``); every block streams the whole
``[N, d]`` candidates and accumulator, so per-block time is what the full pass repeats.

Two variants of the same blocked step (:func:`floor_step`'s keywords):

* the **symmetric floor** (``recompute=True``, names ``sym-floor``, ``sym-floor1``): CLIP's
  logit-free symmetric step (``fastcl.ops.symmetric``) needs both directions' LSEs before any
  gradient, so it cannot form the gradient in its forward pass: a forward sweep of
  ``S = A_blk · Cᵀ`` (rows' and columns' LSEs), then the backward sweep recomputing ``S`` and
  forming ``X · C`` and ``Xᵀ · A``. Four GEMMs, the minimum for a symmetric step that never
  holds the ``[B, B]`` logits; the three-GEMM floor stays the grid's common reference.
* the **guided floor** (``guide_d=g``): GIST's step also needs its guide model's similarities,
  one forward ``[h, g] x [g, N]`` product per block (no gradient), beside the model's three.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.harness.cases import DTYPES

# the S / X block buffer: at most 2^26 elements (256 MiB in float32), like a fused step's
# row block it is independent of B
FLOOR_MAX_ELEMENTS = 2**26
# beyond 2^38 FLOPs (~3 s at 100 GFLOP/s) time a prefix of the blocks and scale
FLOOR_MAX_FLOPS = 2**38
# per device type: a GPU runs ~1000x the FLOPs in the same time and wants taller blocks
FLOOR_LIMITS = {
    "cpu": {"max_elements": FLOOR_MAX_ELEMENTS, "max_flops": FLOOR_MAX_FLOPS},
    "cuda": {"max_elements": 2**28, "max_flops": 2**47},
}


def floor_flops(B: int, N: int, d: int, *, recompute: bool = False, guide_d: int | None = None) -> int:
    """The three GEMMs: ``3 * 2 * B * N * d`` (four with ``recompute``; and ``2 B N g`` for a guide)."""
    return (8 if recompute else 6) * B * N * d + 2 * B * N * (guide_d or 0)


@dataclass(frozen=True)
class FloorPlan:
    B: int
    N: int
    d: int
    rows: int  # anchor rows per block
    blocks: int  # blocks covering B (the last may be shorter)
    timed_blocks: int  # blocks actually run per step

    @property
    def timed_rows(self) -> int:
        return min(self.B, self.rows * self.timed_blocks)

    @property
    def scale(self) -> float:
        """Multiply a measured step by this to get the floor of the whole batch."""
        return self.B / self.timed_rows

    @property
    def buffer_elements(self) -> int:
        return self.rows * self.N


def plan_floor(
    B: int, N: int, d: int, max_elements: int = FLOOR_MAX_ELEMENTS, max_flops: int = FLOOR_MAX_FLOPS
) -> FloorPlan:
    """Block height and how many blocks to time (see the module docstring)."""
    if min(B, N, d) < 1:
        raise ValueError(f"floor of an empty problem: B={B}, N={N}, d={d}")
    rows = max(1, min(B, max_elements // N))
    blocks = -(-B // rows)
    timed = blocks
    if floor_flops(B, N, d) > max_flops and blocks > 1:
        # only full blocks are timed when scaling (timed < blocks: none is the short last one)
        timed = max(1, min(blocks, max_flops // floor_flops(rows, N, d)))
    return FloorPlan(B, N, d, rows, blocks, timed)


def floor_plans(
    B: int, N: int, d: int, max_elements: int = FLOOR_MAX_ELEMENTS, max_flops: int = FLOOR_MAX_FLOPS
) -> list[FloorPlan]:
    """The blockings the floor is the best of: tall blocks (``max_elements``) and, where that
    differs, blocks 8 times shorter. Which one wins depends on the shape: at d = 768 every
    block repacks C and short blocks lose (N = 81920: 2.4 s at 512 rows, 3.3 s at 102); at
    d = 128 with large N the tall ``[rows, N]`` block leaves the cache (B = 4096, N = 40960:
    476 ms at 256 rows, 547 ms at 1024). Timing both keeps the floor a floor."""
    tall = plan_floor(B, N, d, max_elements, max_flops)
    short = plan_floor(B, N, d, max(N, max_elements // 8), max_flops)
    return [tall] if short.rows == tall.rows else [tall, short]


def named_floor_plans(B: int, N: int, d: int, prefix: str = "floor", **limits) -> dict[str, FloorPlan]:
    """:func:`floor_plans` by their step names in an interleaved loop: ``floor``, ``floor1``
    (``prefix``: ``sym-floor``, ``sym-floor1`` for the symmetric floor)."""
    return {f"{prefix}{i or ''}": plan for i, plan in enumerate(floor_plans(B, N, d, **limits))}


def fastest_floor(plans: dict[str, FloorPlan], samples: dict[str, list[float]]) -> tuple[str, float] | None:
    """``(name, seconds)`` of the fastest timed blocking, its minimum round scaled to the
    whole batch (``FloorPlan.scale``); None when none of them was timed."""
    timed = {n: min(samples[n]) * plan.scale for n, plan in plans.items() if samples.get(n)}
    if not timed:
        return None
    best = min(timed, key=timed.get)
    return best, timed[best]


def floor_step(
    plan: FloorPlan,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    *,
    recompute: bool = False,
    guide_d: int | None = None,
):
    """A zero-argument callable running the plan's GEMMs once; returns ``(dA, dC)``.

    ``recompute``: a forward sweep of ``S`` over the blocks first (the symmetric floor);
    ``guide_d``: a guide product ``[h, guide_d] x [guide_d, N]`` per block (the guided floor;
    its output in ``step.guide``). Inputs are random (GEMM time does not depend on the
    values); the outputs are the real products so tests can check them (:func:`floor_reference`).
    """
    dt = DTYPES[dtype]
    g = torch.Generator(device=device).manual_seed(seed)
    rows_total = plan.timed_rows
    a = torch.randn(rows_total, plan.d, generator=g, device=device, dtype=torch.float32).to(dt)
    c = torch.randn(plan.N, plan.d, generator=g, device=device, dtype=torch.float32).to(dt)
    s = torch.empty(plan.rows, plan.N, device=device, dtype=dt)
    da = torch.empty_like(a)
    dc = torch.empty_like(c)
    ct = c.t()
    if guide_d:
        ag = torch.randn(rows_total, guide_d, generator=g, device=device, dtype=torch.float32).to(dt)
        cg = torch.randn(plan.N, guide_d, generator=g, device=device, dtype=torch.float32).to(dt)
        gs = torch.empty(plan.rows, plan.N, device=device, dtype=dt)
        cgt = cg.t()

    def step():
        dc.zero_()
        if recompute:  # the forward pass: S per block (its LSEs), nothing kept
            for r0 in range(0, rows_total, plan.rows):
                r1 = min(r0 + plan.rows, rows_total)
                torch.mm(a[r0:r1], ct, out=s[: r1 - r0])
        for r0 in range(0, rows_total, plan.rows):
            r1 = min(r0 + plan.rows, rows_total)
            blk, x = a[r0:r1], s[: r1 - r0]
            if guide_d:  # the guide's similarities of the block: its false-negative filter
                torch.mm(ag[r0:r1], cgt, out=gs[: r1 - r0])
            torch.mm(blk, ct, out=x)  # S = A_blk C^T; a fused step turns S into X in place
            torch.mm(x, c, out=da[r0:r1])  # dA_blk = X C
            dc.addmm_(x.t(), blk)  # dC += X^T A_blk
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        return da, dc

    step.inputs = (a, c)  # for tests
    if guide_d:
        step.guide = (ag, cg, gs)
    return step


def floor_reference(a: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`floor_step` computes, in float64 in one piece: ``(A Cᵀ C, (A Cᵀ)ᵀ A)``."""
    a64, c64 = a.double(), c.double()
    s = a64 @ c64.t()
    return s @ c64, s.t() @ a64


def share_of_floor(floor_s: float | None, seconds: float | None) -> float | None:
    """``floor / seconds`` (1.0 = at the floor); None when either is unknown."""
    if not floor_s or not seconds:
        return None
    return floor_s / seconds
