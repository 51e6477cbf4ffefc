"""Small constant tensors a loss call needs every step (the tags of an unmasked candidate grid,
a Python-float temperature, the reduction weights of an unmasked batch), made once per shape,
dtype and device and reused.

Why: each is one to four tiny ATen ops, and on a GPU each op is a kernel launch; a SupMPN
step issued nine of them beside its 28 Triton kernels (docs/triton.md, "A step, launch by
launch"). Reused tensors also keep their addresses, which a captured CUDA graph needs.

The cached tensors are never written to (the callers build new tensors from them). Nothing is
cached while ``torch.compile`` traces, under ``inference_mode`` (its tensors cannot enter
autograd later) or when the factory returns a tensor subclass (a fake or functional tensor
of a tracing mode), so a cached value is always a plain eager tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

MAX_ENTRIES = 64  # least recently used entries beyond this are dropped
_cache: OrderedDict[Hashable, Tensor] = OrderedDict()


def constant(key: Hashable, make: Callable[[], Tensor]) -> Tensor:
    """``make()``'s tensor for ``key`` (which must name everything the tensor depends on:
    shape, dtype, device), made on the first call and returned on later ones."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return make()
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    t = make()
    if type(t) is Tensor and not t.requires_grad:
        _cache[key] = t
        if len(_cache) > MAX_ENTRIES:
            _cache.popitem(last=False)
    return t


def clear() -> None:
    """Drop every cached tensor (tests; freeing device memory)."""
    _cache.clear()
