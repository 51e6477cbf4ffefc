"""A loss reaches its backend by the short path docs/design.md draws: the family's function,
``fused_loss`` (which runs the ``FusedCall`` the family laid out), the autograd Function and
the backend; no layer in between re-spells the call's settings (they travel in one
``LossSpec``)."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

import fastcl.losses as L
from fastcl.ops import dispatch


def test_supmpn_reaches_the_backend_through_fused_loss_and_the_function():
    target = type(dispatch.get("torch")).fused.__code__
    stack: list[traceback.FrameSummary] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is target and not stack:
            stack.extend(traceback.extract_stack(frame))

    g = torch.Generator().manual_seed(0)
    a, p, n = (torch.randn(4, *s, 8, generator=g, requires_grad=True) for s in ((), (2,), (3,)))
    sys.setprofile(profile)
    try:
        L.supmpn_loss(a, p, n, backend="torch")
    finally:
        sys.setprofile(None)
    fastcl = Path(L.__file__).resolve().parents[1]
    names = [f.name for f in stack]
    path = [
        (f.name, Path(f.filename).name)
        for f in stack[names.index("supmpn_loss") :]
        if Path(f.filename).resolve().is_relative_to(fastcl)
    ]
    assert path == [
        ("supmpn_loss", "supmpn.py"),
        ("fused_loss", "_shared.py"),
        ("forward", "contrastive.py"),
        ("fused", "_torch_impl.py"),
    ], path
