"""One rank of tests/distributed/test_clip_distributed.py: open_clip's losses against fastcl's.

Each rank draws its own float64 features (seeded by rank) and computes, with gradients for
the features, ``logit_scale`` and ``logit_bias``:

* open_clip's ``SigLipLoss(rank, world_size)`` (``dist_impl`` "bidir" and "gather") and
  fastcl's drop-in with the ring and with the gather, per backend;
* open_clip's ``ClipLoss`` in all four ``local_loss`` x ``gather_with_grad`` modes and
  fastcl's drop-in in the same mode (plus the ring for the local, gathered-with-grad mode);
* errors: a batch size that differs on one rank, a bad ``logit_scale`` on one rank only;
  every rank must raise (never hang) and the group must stay usable.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers.open_clip import open_clip_loss
from tests.helpers.spawn import run_rank

B, D = 5, 8
TIMEOUT_S = 120
BACKENDS = ("torch",)
CLIP_MODES = [(True, True), (True, False), (False, True), (False, False)]  # (local_loss, gather_with_grad)


def features(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    img = F.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=-1)
    txt = F.normalize(torch.randn(B, D, generator=g, dtype=torch.float64) + 0.7 * img, dim=-1)
    return img, txt


def _run(fn, img, txt):
    leaves = [img.clone().requires_grad_(), txt.clone().requires_grad_()]
    t = torch.tensor(math.exp(2.0), dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    loss = fn(*leaves, t, b)
    grads = torch.autograd.grad(loss, [*leaves, t, b], allow_unused=True)
    return loss.detach(), [None if g is None else g.detach() for g in grads]


def _errors(rank: int, world: int) -> dict:
    from fastcl.integrations import open_clip as foc

    out = {}
    img, txt = features(7, rank)
    short = img[: B - 1] if rank == 1 else img  # rank 1 passes one row fewer
    for name, call in (
        ("sizes", lambda: foc.SigLipLoss(rank=rank, world_size=world)(short, txt[: short.shape[0]], 2.0, 0.0)),
        (
            "scale",
            lambda: foc.SigLipLoss(rank=rank, world_size=world, dist_impl="gather")(
                img, txt, -1.0 if rank == 0 else 2.0, 0.0
            ),
        ),
        (
            "clip_sizes",
            lambda: foc.ClipLoss(True, True, rank=rank, world_size=world)(short, txt[: short.shape[0]], 2.0),
        ),
    ):
        try:
            call()
            out[name] = None
        except Exception as exc:  # the parent checks the type and message per rank
            out[name] = (type(exc).__name__, str(exc))
    dist.barrier()  # the group is still usable after every error
    out["usable"] = True
    return out


def body(rank: int, world: int, seed: int) -> dict:
    from fastcl.integrations import open_clip as foc

    oc = open_clip_loss()
    assert oc is not None, "open-clip-torch is not installed"
    img, txt = features(seed, rank)
    out: dict = {"siglip": {}, "clip": {}}
    for impl in ("bidir", "gather"):
        out["siglip"]["open_clip", impl] = _run(oc.SigLipLoss(rank=rank, world_size=world, dist_impl=impl), img, txt)
    for backend in BACKENDS:
        for impl in ("bidir", "gather"):
            loss = foc.SigLipLoss(rank=rank, world_size=world, dist_impl=impl, backend=backend)
            out["siglip"][backend, impl] = _run(loss, img, txt)
    for mode in CLIP_MODES:
        out["clip"]["open_clip", mode] = _run(oc.ClipLoss(*mode, rank=rank, world_size=world), img, txt)
        for backend in BACKENDS:
            loss = foc.ClipLoss(*mode, rank=rank, world_size=world, backend=backend)
            out["clip"][backend, mode, "gather"] = _run(loss, img, txt)
            if mode == (True, True):
                ring = foc.ClipLoss(*mode, rank=rank, world_size=world, backend=backend, cross_device="ring")
                out["clip"][backend, mode, "ring"] = _run(ring, img, txt)
    out["errors"] = _errors(rank, world)
    return out


def worker(rank: int, world: int, store: str, tmp: str, seed: int) -> None:
    run_rank(rank, world, store, tmp, lambda: body(rank, world, seed), timeout_s=TIMEOUT_S)
