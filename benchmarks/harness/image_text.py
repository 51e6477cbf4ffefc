"""CLIP and SigLIP in the loss grid: inputs, open_clip's loss as the peer, fastcl's call and the
float64 oracles.

The inputs are what open_clip's losses receive from a model: L2-normalised image and text
features ``[B, d]`` (leaves that require grad), the exponentiated scale ``logit_scale`` and,
for SigLIP, ``logit_bias`` (0-d leaves that require grad, as the model's parameters are).
fastcl runs on them with ``similarity="dot"``, which is open_clip's math exactly. The values
are open_clip's initialisations: CLIP ``logit_scale = 1 / 0.07``; SigLIP ``logit_scale = 10``,
``logit_bias = -10``.

* ``eager`` is open_clip's own ``ClipLoss`` / ``SigLipLoss`` (one process: the full ``[B, B]``
  logits, CLIP's in both directions, SigLIP's with a ``[B, B]`` label matrix), loaded from the
  installed package's ``loss.py`` (:func:`open_clip_loss`: the package's ``__init__`` imports
  torchvision, which does not load beside the CPU torch; ``scripts/setup.sh`` installs
  open-clip-torch ``--no-deps``);
* ``compile`` is ``torch.compile`` of that module (one dynamic-shape graph per loss and process);
* the float64 oracles (:func:`clip_oracle`, :func:`siglip_oracle`) are open_clip's math in
  float64, in row blocks so that no ``[B, B]`` float64 matrix is held (B = 16384 would take
  2 GiB per copy): CLIP's column log-sum-exps merge block by block.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

OPEN_CLIP_VERSION = "3.3.0"  # scripts/setup.sh installs this one
CLIP_LOGIT_SCALE = 1 / 0.07  # open_clip's init_logit_scale = log(1 / 0.07), exponentiated
SIGLIP_LOGIT_SCALE = 10.0  # open_clip's SigLIP init: init_logit_scale = log(10)
SIGLIP_LOGIT_BIAS = -10.0  # init_logit_bias = -10
ORACLE_ROWS = 1024  # float64 rows per block of the oracles


@functools.cache
def open_clip_loss() -> ModuleType | None:
    """open_clip's ``loss`` module (its own ``loss.py``, which needs only torch), or None when
    open-clip-torch is not installed."""
    spec = importlib.util.find_spec("open_clip")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "loss.py"
    name = "benchmarks_open_clip_loss"
    loader = importlib.util.spec_from_file_location(name, path)
    if loader is None or loader.loader is None:
        return None
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module  # importable by name: torch.compile's tracer looks it up
    loader.loader.exec_module(module)
    return module


def open_clip_missing() -> str | None:
    """Why open_clip's loss cannot be the peer here (None: it can)."""
    if importlib.util.find_spec("open_clip") is None:
        return (
            "open_clip's loss is the peer of CLIP/SigLIP and open-clip-torch is not installed "
            f"(pip install --no-deps open_clip_torch=={OPEN_CLIP_VERSION}; scripts/setup.sh does)"
        )
    return None


def make_inputs(loss: str, B: int, d: int, dt: torch.dtype, device, gen: torch.Generator) -> dict[str, Tensor]:
    """Unit image and text features ``[B, d]`` in ``dt`` and the scale (and SigLIP's bias) as
    float32 0-d leaves, every one requiring grad."""

    def unit():
        x = torch.randn(B, d, generator=gen, device=device, dtype=torch.float32)
        return F.normalize(x, dim=-1).to(dt).requires_grad_()

    def scalar(v: float) -> Tensor:
        return torch.tensor(v, device=device, dtype=torch.float32).requires_grad_()

    out = {"image_features": unit(), "text_features": unit()}
    if loss == "clip":
        out["logit_scale"] = scalar(CLIP_LOGIT_SCALE)
    else:
        out["logit_scale"] = scalar(SIGLIP_LOGIT_SCALE)
        out["logit_bias"] = scalar(SIGLIP_LOGIT_BIAS)
    return out


# ---------------------------------------------------------------------------------------
# fastcl (similarity="dot": the features arrive normalised, as open_clip's do)
# ---------------------------------------------------------------------------------------


def fastcl_clip(image_features, text_features, logit_scale, *, backend: str = "auto") -> Tensor:
    from fastcl.losses import clip_loss

    return clip_loss(image_features, text_features, logit_scale, similarity="dot", backend=backend)


def fastcl_siglip(image_features, text_features, logit_scale, logit_bias, *, backend: str = "auto") -> Tensor:
    from fastcl.losses import siglip_loss

    return siglip_loss(image_features, text_features, logit_scale, logit_bias, similarity="dot", backend=backend)


def clip_path(inputs: dict, backend: str) -> str:
    """Which step fastcl's ``clip_loss`` takes here: ``"symmetric"`` (one forward pass for both
    directions' LSEs and one recompute backward: 4 GEMM passes, ``fastcl.ops.symmetric``) or
    ``"two directions"`` (two directional LSE calls: 6), where the backend computes no column
    statistics."""
    from fastcl.ops import symmetric
    from fastcl.ops.contract import EPS

    taken = symmetric.takes(backend, inputs["image_features"], inputs["text_features"], False, EPS)
    return "symmetric" if taken is not None else "two directions"


# ---------------------------------------------------------------------------------------
# open_clip: eager and compiled
# ---------------------------------------------------------------------------------------


def open_clip_module(loss: str):
    """A fresh ``ClipLoss()`` / ``SigLipLoss()`` of open_clip (one process, its defaults)."""
    module = open_clip_loss()
    if module is None:
        raise RuntimeError(open_clip_missing())
    return module.ClipLoss() if loss == "clip" else module.SigLipLoss()


def open_clip_call(loss: str, module):
    """``f(**inputs) -> loss`` through open_clip's forward signature."""
    if loss == "clip":
        return lambda image_features, text_features, logit_scale: module(image_features, text_features, logit_scale)
    return lambda image_features, text_features, logit_scale, logit_bias: module(
        image_features, text_features, logit_scale, logit_bias
    )


# ---------------------------------------------------------------------------------------
# float64 oracles: open_clip's math in row blocks
# ---------------------------------------------------------------------------------------


def clip_oracle(image_features, text_features, logit_scale, *, rows: int = ORACLE_ROWS) -> Tensor:
    """open_clip's ``ClipLoss`` (one process): ``(CE(t X Yᵀ, i) + CE(t Y Xᵀ, i)) / 2``, the rows'
    and the columns' log-sum-exps gathered over blocks of ``rows`` images (no ``[B, B]``)."""
    x, y, t = image_features, text_features, logit_scale
    B = x.shape[0]
    row_lse = x.new_zeros(())
    col_lse = torch.full((B,), float("-inf"), dtype=x.dtype, device=x.device)
    diag = x.new_zeros(())
    for r0 in range(0, B, rows):
        r1 = min(r0 + rows, B)
        logits = t * x[r0:r1] @ y.T  # [h, B]
        row_lse = row_lse + torch.logsumexp(logits, dim=1).sum()
        col_lse = torch.logaddexp(col_lse, torch.logsumexp(logits, dim=0))
        diag = diag + torch.diagonal(logits, offset=r0).sum()
    return ((row_lse - diag) + (col_lse.sum() - diag)) / (2 * B)


def siglip_oracle(image_features, text_features, logit_scale, logit_bias, *, rows: int = ORACLE_ROWS) -> Tensor:
    """open_clip's ``SigLipLoss`` (one process): ``-sum log sigmoid(z_ij (t x_i·y_j + b)) / B``,
    ``z_ii = 1``, ``z_ij = -1`` otherwise, over blocks of ``rows`` images."""
    x, y, t, b = image_features, text_features, logit_scale, logit_bias
    B = x.shape[0]
    total = x.new_zeros(())
    for r0 in range(0, B, rows):
        r1 = min(r0 + rows, B)
        logits = t * x[r0:r1] @ y.T + b
        pos = torch.diagonal(logits, offset=r0)
        # every pair as a negative, then the pairs' own term swapped for the positive one
        total = total - F.logsigmoid(-logits).sum() + F.logsigmoid(-pos).sum() - F.logsigmoid(pos).sum()
    return total / B
