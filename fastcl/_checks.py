"""Input validation for the public losses: clear errors before any compute.

One rule per argument, applied by every loss before any compute, whatever the backend:

* ``temperature``: a real number (not a bool) or a 0-d floating tensor; its value must be
  finite and > 0 with ``1 / temperature`` finite in the compute dtype (float64 for float64
  embeddings, float32 otherwise): 1e-39 is refused for float32 (its reciprocal overflows)
  but fine for float64. A tensor's value is checked when the tensor lives on the CPU; a
  CUDA temperature is not read (that would be a host sync per call), so a bad value there
  gives NaN rather than an error, on every backend alike.
* ``reduction``, ``similarity`` and ``strategy``: one of their choices, checked on every
  call, with or without grad.

Shape, dtype and device checks read only metadata. "Some anchor has a valid positive"
reads values (checked whenever ``pos_mask`` is given; for a CUDA mask this is the one host
sync of a loss call). ``FASTCL_CHECK_FINITE=1`` additionally checks that every embedding is
finite (a sync per tensor; off by default).
"""

from __future__ import annotations

import functools
import math
import numbers
import os

import torch
from torch import Tensor

from . import config
from .ops.constants import constant
from .ops.contract import FLOAT_DTYPES, compute_dtype

REDUCTIONS = ("mean", "sum", "none")
SIMILARITIES = ("cos", "dot")
STRATEGIES = config.STRATEGIES


def is_real_number(value) -> bool:
    """A real number, Python's or NumPy's (``np.float32(0.05)``, ``np.int64(2)``), but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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


def check_some_positive(
    pos_mask: Tensor | None, why: str = "no anchor has a valid positive (pos_mask is all False)"
) -> None:
    """``ValueError`` when no anchor has a valid positive, for a mask on the CPU. A mask on a
    GPU is not read on the host (that would stall the host until the GPU is done, and cannot
    be captured in a CUDA graph): there the loss of such a batch is NaN instead (the
    reduction's weights are ``0 / 0``, ``fastcl.ops.head.reduction_weights``)."""
    if pos_mask is not None and pos_mask.device.type == "cpu" and not bool(pos_mask.any()):
        raise ValueError(f"{why}: the loss is undefined")


def _temperature_rule(value: float, dtype: torch.dtype) -> None:
    """Finite, > 0, and with a finite reciprocal once cast to ``dtype``."""
    t = torch.tensor(value, dtype=dtype)
    if not (math.isfinite(value) and value > 0 and bool(t > 0) and bool(torch.isfinite(t.reciprocal()))):
        raise ValueError(f"temperature must be finite and > 0 with a finite 1/temperature in {dtype}, got {value!r}")


# Memoised: a training loop passes the same value every step, and the rule is nine small tensor ops.
_cached_temperature_rule = functools.lru_cache(maxsize=64)(_temperature_rule)


def _check_temperature_value(value: float, dtype: torch.dtype) -> None:
    if torch.compiler.is_compiling():  # Dynamo would trace through the cache anyway, with a warning
        _temperature_rule(value, dtype)
    else:
        _cached_temperature_rule(value, dtype)


def check_temperature(temperature, compute_dtype: torch.dtype = torch.float32) -> None:
    """The one rule for ``temperature`` (module docstring); reads a tensor's value on the CPU only."""
    if isinstance(temperature, Tensor):
        if temperature.dim() != 0:
            raise ValueError(f"temperature must be a float or a 0-d tensor, got shape {tuple(temperature.shape)}")
        if not temperature.is_floating_point():
            raise TypeError(f"temperature tensor must be floating point, got {temperature.dtype}")
        if temperature.device.type == "cpu":
            _check_temperature_value(float(temperature.detach()), compute_dtype)
        return
    if not is_real_number(temperature):
        raise TypeError(f"temperature must be a float or a 0-d tensor, got {type(temperature).__name__}")
    _check_temperature_value(float(temperature), compute_dtype)


def as_temperature(temperature, like: Tensor) -> Tensor:
    """A 0-d tensor on ``like``'s device in the compute dtype; differentiable if given one."""
    dtype = compute_dtype(like.dtype)
    check_temperature(temperature, dtype)
    if isinstance(temperature, Tensor):
        return temperature.to(device=like.device, dtype=dtype)
    value = float(temperature)
    key = ("temperature", value, dtype, str(like.device))  # made once per value (fastcl.ops.constants)
    return constant(key, lambda: torch.full((), value, dtype=dtype, device=like.device))
