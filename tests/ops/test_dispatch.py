"""Backend choice: argument > FASTCL_BACKEND > automatic; explicit failures say why."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fastcl.losses as L
from fastcl import config
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
    monkeypatch.setattr(config, "_current", config.get())  # the configuration before, restored after
    monkeypatch.setenv("FASTCL_BACKEND", "reference")
    config.reload()  # the environment is read once, by fastcl.config
    L.infonce_loss(torch.randn(2, 3), torch.randn(2, 3))
    assert calls == ["reference"]
    calls.clear()
    L.infonce_loss(torch.randn(2, 3), torch.randn(2, 3), backend="torch")  # argument wins
    assert calls == ["torch"]


def test_env_var_with_unknown_backend_errors(monkeypatch):
    monkeypatch.setenv("FASTCL_BACKEND", "nope")
    with pytest.raises(config.ConfigError, match="FASTCL_BACKEND='nope'"):
        config.from_environment()


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (None, TypeError, "backend must be a string"),
        ("cuda", dispatch.BackendUnavailableError, "'cuda' backend was removed.*triton"),
        ("nope", dispatch.BackendUnavailableError, "unknown backend 'nope'"),
    ],
)
def test_bad_backend_arguments(bad, error, match):
    with pytest.raises(error, match=match):
        L.infonce_loss(torch.randn(2, 3), torch.randn(2, 3), backend=bad)


def test_a_refused_cpp_setting_is_not_a_silent_fallback(monkeypatch):
    """A knob the C++ library refuses when it loads (``cpp.gemm="own"`` without its AVX-512
    build; the refusal is simulated here, the real one: tests/kernels/test_cpp_gemm_tile.py)
    raises under ``backend="auto"`` too, instead of moving the call to another backend."""
    from fastcl.ops import _cpp

    if dispatch.unavailable("cpp") is not None:
        pytest.skip(f"cpp unavailable: {dispatch.unavailable('cpp')}")

    def refuse():
        raise config.ConfigError("fastcl: cpp.gemm='own' needs the AVX-512 build (simulated)")

    monkeypatch.setattr(_cpp, "_follow_config", refuse)
    with pytest.raises(config.ConfigError, match="AVX-512"):
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


def test_a_loss_spec_names_its_backend_until_it_is_chosen():
    """``LossSpec.backend`` is the name asked for until ``choose`` puts the backend there; the
    autograd Functions read ``impl``, which refuses an unchosen one, and ``row_weights``, which
    refuses unset weights (the ring forms and ``fused_loss`` set them)."""
    from fastcl.ops.contract import empty_block
    from fastcl.ops.contrastive import LossSpec

    a, b0 = torch.randn(3, 4), torch.randn(5, 4)
    b1, t1 = empty_block(a)
    spec = LossSpec("cross_entropy", (torch.full((5,), -1, dtype=torch.int32), t1), backend="reference")
    with pytest.raises(RuntimeError, match="not chosen"):
        _ = spec.impl
    with pytest.raises(RuntimeError, match="weights"):
        _ = spec.row_weights
    chosen = spec.choose(spec.problem(a, b0, b1))
    assert chosen.impl is dispatch.get("reference") and chosen.choose(chosen.problem(a, b0, b1)) is chosen
