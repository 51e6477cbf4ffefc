"""Input validation for the public losses: clear errors before any compute.

Shape, dtype and device checks read only metadata. Two checks need tensor *values*:
``temperature`` given as a tensor (checked when it lives on the CPU) and "some anchor has
a valid positive" (checked whenever ``pos_mask`` is given; for a CUDA mask this is the one
host sync of a loss call). ``FASTCL_CHECK_FINITE=1`` additionally checks that every
embedding is finite (a sync per tensor; off by default).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from .ops.contract import FLOAT_DTYPES, compute_dtype
REDUCTIONS = ("mean", "sum", "none")
SIMILARITIES = ("cos", "dot")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {tuple(choices)}")


def check_embeddings(**tensors: Tensor | None) -> None:
    """Each named tensor is a floating tensor; all share one dtype and device."""
    present = {k: v for k, v in tensors.items() if v is not None}
    for name, t in present.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    dtypes = {t.dtype for t in present.values()}
    if len(dtypes) > 1:
        got = ", ".join(f"{k}: {v.dtype}" for k, v in present.items())
        raise TypeError(f"all embeddings must share one dtype ({got}); cast them, e.g. with .float()")
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        got = ", ".join(f"{k}: {v.device}" for k, v in present.items())
        raise ValueError(f"all embeddings must be on one device ({got})")
    if os.environ.get("FASTCL_CHECK_FINITE") == "1":
        for name, t in present.items():
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains inf or NaN (FASTCL_CHECK_FINITE=1)")


def check_rank(name: str, t: Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")


def check_mask(name: str, mask: Tensor | None, shape: tuple[int, ...], device: torch.device) -> None:
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must have dtype torch.bool (False marks padding), got {mask.dtype}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the embeddings are on {device}")


def check_some_positive(pos_mask: Tensor | None) -> None:
    if pos_mask is not None and not bool(pos_mask.any()):
        raise ValueError("no anchor has a valid positive (pos_mask is all False): the loss is undefined")


def as_temperature(temperature, like: Tensor) -> Tensor:
    """A 0-d tensor on ``like``'s device in the compute dtype; differentiable if given one."""
    dtype = compute_dtype(like.dtype)
    if isinstance(temperature, Tensor):
        if temperature.dim() != 0:
            raise ValueError(f"temperature must be a float or a 0-d tensor, got shape {tuple(temperature.shape)}")
        if not temperature.is_floating_point():
            raise TypeError(f"temperature tensor must be floating point, got {temperature.dtype}")
        if temperature.device.type == "cpu" and not bool(temperature.detach() > 0):
            raise ValueError(f"temperature must be > 0, got {temperature.item()}")
        return temperature.to(device=like.device, dtype=dtype)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float or a 0-d tensor, got {type(temperature).__name__}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return torch.full((), float(temperature), dtype=dtype, device=like.device)
