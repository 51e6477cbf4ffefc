"""Loss workloads shared by the benchmarks and the memory tests.

:func:`loss_step` builds random inputs for one loss and returns a callable doing one
forward + backward, for any backend (fastcl's) or the eager reference.

The sentence-embedding losses (SupMPN, SupCon, MNRL, InfoNCE) take raw embeddings and
:data:`TEMPERATURE`; the image–text losses (CLIP, SigLIP: ``benchmarks.harness.image_text``)
take normalised features and open_clip's scale and bias as inputs; GIST
(``benchmarks.harness.gist``) takes the model's and the guide's embeddings. :func:`hyper`
gives the keyword arguments a loss takes beside its inputs.
"""

from __future__ import annotations

import torch

import fastcl.losses as L
from benchmarks.harness import gist, image_text
from fastcl import reference as R

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
TEMPERATURE = 0.05  # the sentence-embedding losses'

# name -> (fastcl function, oracle, input layout)
LOSSES = {
    "supmpn": (L.supmpn_loss, R.supmpn, "structured"),
    "supcon": (L.supcon_loss, R.supcon, "structured"),
    "mnrl": (L.mnrl_loss, R.mnrl, "pair"),
    "infonce": (L.infonce_loss, R.infonce, "two_views"),
    # the oracles below are float64-exact in row blocks (any size); the functions fix the
    # losses' hyper-parameters (open_clip's scale and bias are inputs)
    "clip": (image_text.fastcl_clip, image_text.clip_oracle, "image_text"),
    "siglip": (image_text.fastcl_siglip, image_text.siglip_oracle, "image_text"),
    "gist": (gist.fastcl_gist, gist.gist_oracle, "gist"),
}
SENTENCE_LOSSES = ("supmpn", "supcon", "mnrl", "infonce")
IMAGE_TEXT_LOSSES = ("clip", "siglip")


def hyper(loss: str) -> dict:
    """Keyword arguments of ``loss``'s fastcl function and oracle beside its inputs."""
    return {"temperature": TEMPERATURE} if loss in SENTENCE_LOSSES else {}


def first(inputs: dict) -> torch.Tensor:
    """The inputs' first tensor (its dtype and device are the case's)."""
    return next(v for v in inputs.values() if v is not None)


def make_inputs(
    loss: str, B: int, P: int, Q: int, d: int, dtype: str = "float32", device: str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random inputs named as the loss's arguments (the embeddings are leaves that require grad)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = DTYPES[dtype]

    def emb(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt).requires_grad_()

    layout = LOSSES[loss][2]
    if layout == "structured":
        return {"anchor": emb(B, d), "positives": emb(B, P, d), "negatives": emb(B, Q, d) if Q else None}
    if layout == "pair":
        return {"anchor": emb(B, d), "positive": emb(B, d), "negatives": emb(B, Q, d) if Q else None}
    if layout == "image_text":
        return image_text.make_inputs(loss, B, d, dt, device, gen)
    if layout == "gist":
        return gist.make_inputs(B, Q, d, dt, device, gen)
    return {"anchor": emb(B, d), "positive": emb(B, d)}


def loss_fn(loss: str, backend: str):
    """``f(**inputs) -> loss``: fastcl's loss on ``backend``, or the eager oracle for ``"eager"``."""
    fused, oracle, _ = LOSSES[loss]
    kw = hyper(loss)
    if backend == "eager":
        return lambda **t: oracle(**t, **kw)
    return lambda **t: fused(**t, **kw, backend=backend)


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
