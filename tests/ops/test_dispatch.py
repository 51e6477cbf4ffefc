"""Backend choice: argument > FASTCL_BACKEND > automatic; explicit failures say why."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fastcl.losses as L
from fastcl.ops import dispatch
from fastcl.ops.contract import LSEProblem


def test_explicit_unavailable_backend_lists_reasons(monkeypatch):
    import types

    ghost = types.SimpleNamespace(unavailable=lambda: "backend 'ghost' is not part of this build")
    real = dispatch.get
    monkeypatch.setattr(dispatch, "NAMES", (*dispatch.NAMES, "ghost"))
    monkeypatch.setattr(dispatch, "get", lambda name: ghost if name == "ghost" else real(name))
    with pytest.raises(dispatch.BackendUnavailableError, match="not part of this build"):
        L.infonce_loss(torch.randn(2, 3), torch.randn(2, 3), backend="ghost")


def test_env_var_selects_backend(monkeypatch):
    calls = []
    real = dispatch.choose

    def spy(problem, backend="auto"):
        impl = real(problem, backend)
        calls.append(impl.name)
        return impl

    monkeypatch.setattr(dispatch, "choose", spy)
    monkeypatch.setenv("FASTCL_BACKEND", "reference")
    L.infonce_loss(torch.randn(2, 3), torch.randn(2, 3))
    assert calls == ["reference"]
    calls.clear()
    L.infonce_loss(torch.randn(2, 3), torch.randn(2, 3), backend="torch")  # argument wins
    assert calls == ["torch"]


def test_env_var_with_unknown_backend_errors(monkeypatch):
    monkeypatch.setenv("FASTCL_BACKEND", "nope")
    with pytest.raises(dispatch.BackendUnavailableError, match="unknown backend"):
        L.infonce_loss(torch.randn(2, 3), torch.randn(2, 3))


def test_auto_on_cpu_never_picks_gpu_backends():
    prob = LSEProblem(
        torch.randn(3, 4),
        (torch.randn(3, 4), torch.randn(0, 4)),
        (torch.full((3,), -1, dtype=torch.int32), torch.empty(0, dtype=torch.int32)),
    )
    impl = dispatch.choose(prob)
    assert impl.name in ("cpp", "torch")


def test_describe_reports_every_backend():
    status = dispatch.describe()
    assert set(status) == set(dispatch.NAMES)
    assert status["torch"] == "available" and status["reference"] == "available"


def test_info_cli_runs():
    out = subprocess.run([sys.executable, "-m", "fastcl.info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "backends:" in out.stdout and "torch" in out.stdout


def test_import_is_light():
    """Importing fastcl and its losses must not import triton nor build C++ code."""
    code = "import sys, fastcl, fastcl.losses; print('triton' in sys.modules, 'fastcl.ops._cpp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_a_raising_availability_check_is_a_reason(monkeypatch):
    import types

    from fastcl.ops import dispatch

    def boom():
        raise FileNotFoundError("csrc/missing.cpp")

    fake = types.SimpleNamespace(unavailable=boom)
    monkeypatch.setattr(dispatch, "get", lambda name: fake)
    assert "FileNotFoundError" in dispatch.describe()["cpp"]
    assert "FileNotFoundError" in dispatch.reasons("cpp")[0]
