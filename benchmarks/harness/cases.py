"""Loss workloads shared by the benchmarks and the memory tests.

:func:`loss_step` builds random inputs for one loss and returns a callable doing one
forward + backward, for any backend (fastcl's) or the eager reference.
"""

from __future__ import annotations

import torch

import fastcl.losses as L
from fastcl import reference as R

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# name -> (fastcl function, oracle, input layout)
LOSSES = {
    "supmpn": (L.supmpn_loss, R.supmpn, "structured"),
    "supcon": (L.supcon_loss, R.supcon, "structured"),
    "mnrl": (L.mnrl_loss, R.mnrl, "pair"),
    "infonce": (L.infonce_loss, R.infonce, "two_views"),
}


def make_inputs(
    loss: str, B: int, P: int, Q: int, d: int, dtype: str = "float32", device: str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random leaf tensors (requires_grad) named as the loss's arguments."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = DTYPES[dtype]

    def emb(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt).requires_grad_()

    layout = LOSSES[loss][2]
    if layout == "structured":
        return {"anchor": emb(B, d), "positives": emb(B, P, d), "negatives": emb(B, Q, d) if Q else None}
    if layout == "pair":
        return {"anchor": emb(B, d), "positive": emb(B, d), "negatives": emb(B, Q, d) if Q else None}
    return {"anchor": emb(B, d), "positive": emb(B, d)}


def loss_fn(loss: str, backend: str):
    """``f(**inputs) -> loss``: fastcl's loss on ``backend``, or the eager oracle for ``"eager"``."""
    fused, oracle, _ = LOSSES[loss]
    if backend == "eager":
        return lambda **t: oracle(**t, temperature=0.05)
    return lambda **t: fused(**t, temperature=0.05, backend=backend)


def loss_step(
    loss: str, backend: str, B: int, P: int = 1, Q: int = 0, d: int = 128, dtype: str = "float32", device: str = "cpu"
):
    """Build inputs, return a zero-argument callable running forward + backward once.

    ``backend`` is any implementation of ``benchmarks.harness.peers.IMPLS``: ``"eager"``, a fastcl
    backend, ``"compile"`` or a peer (``"st-mnrl"``, ``"pml-ntxent"``, ...).
    """
    from benchmarks.harness.peers import build

    inputs = make_inputs(loss, B, P, Q, d, dtype, device)
    forward = build(backend, loss, inputs)
    leaves = [t for t in inputs.values() if t is not None]

    def step():
        for t in leaves:
            t.grad = None
        forward().backward()

    return step
