"""fastcl.config: one typed configuration, read once, invalid values refused loudly, every
knob and every environment variable fastcl's code reads listed in docs/configuration.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fastcl import config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


def test_defaults_and_reading_the_environment(monkeypatch):
    for f in ("FASTCL_STRATEGY", "FASTCL_RING_PIECES", "FASTCL_CPP_TILE", "FASTCL_CPP_GEMM"):
        monkeypatch.delenv(f, raising=False)
    cfg = config.from_environment()
    assert (cfg.strategy, cfg.ring_pieces, cfg.cpp.tile, cfg.cpp.gemm) == ("auto", 2, None, "auto")
    env = {
        "FASTCL_STRATEGY": "recompute",
        "FASTCL_RING_PIECES": "4",
        "FASTCL_CPP_GEMM": "mkl",
        "FASTCL_CPP_TILE": "",
        "FASTCL_TORCH_TILE": "4096",  # torch.tile has no variable (override only): ignored
    }
    cfg = config.from_environment(env)
    assert (cfg.strategy, cfg.ring_pieces, cfg.cpp.tile, cfg.cpp.gemm) == ("recompute", 4, None, "mkl")
    assert cfg.torch.tile == 1 << 22


def test_the_environment_is_read_once(monkeypatch):
    """Changing a variable after the first read changes nothing until ``reload()``."""
    before = config.get()
    monkeypatch.setenv("FASTCL_RING_PIECES", "7")
    assert config.get() is before
    try:
        assert config.reload().ring_pieces == 7
    finally:
        monkeypatch.delenv("FASTCL_RING_PIECES")
        config.reload()
    assert config.get().ring_pieces == 2


@pytest.mark.parametrize("raw", ["abc", "0", "-3", "1e6", "4.5", "0x10", "1_000", " 5", "5 ", "1" * 20])
@pytest.mark.parametrize("name", ["FASTCL_RING_PIECES", "FASTCL_CPP_TILE"])
def test_invalid_integers_are_refused(name, raw):
    with pytest.raises(ValueError, match=f"{name}='{re.escape(raw)}': expected an integer >= 1"):
        config.from_environment({name: raw})


@pytest.mark.parametrize("name, raw", [("FASTCL_STRATEGY", "bogus"), ("FASTCL_CPP_GEMM", "blas")])
def test_invalid_choices_are_refused(name, raw):
    with pytest.raises(ValueError, match=f"{name}='{raw}': expected one of"):
        config.from_environment({name: raw})


def test_override_sets_and_restores():
    before = config.get()
    with config.override(strategy="fused", torch={"tile": 97}, cpp=config.CppOptions(gemm="mkl")) as cfg:
        assert config.get() is cfg
        assert (cfg.strategy, cfg.torch.tile, cfg.cpp.gemm) == ("fused", 97, "mkl")
        with config.override(torch={"tile": 5}):
            assert config.get().torch.tile == 5 and config.get().strategy == "fused"
        assert config.get().torch.tile == 97
    assert config.get() == before


@pytest.mark.parametrize(
    "changes, exc, match",
    [
        ({"strategy": "bogus"}, ValueError, "strategy='bogus'"),
        ({"torch": {"tile": 0}}, ValueError, "tile=0"),
        ({"torch": {"tile": True}}, ValueError, "tile=True"),
        ({"cpp": {"tile": 2.5}}, ValueError, "tile=2.5"),
        ({"torch": {"tiles": 4}}, TypeError, "tiles"),
        ({"tile": 4}, TypeError, "no knob or section 'tile'"),
        ({"cpp": "own"}, TypeError, "mapping of its fields"),
    ],
)
def test_override_refuses_bad_values(changes, exc, match):
    before = config.get()
    with pytest.raises(exc, match=match):
        with config.override(**changes):
            pass
    assert config.get() is before


def test_the_frozen_configuration_cannot_be_changed_in_place():
    with pytest.raises(AttributeError):
        config.get().torch.tile = 3  # type: ignore[misc]


def test_every_knob_is_documented():
    text = DOC.read_text(encoding="utf-8")
    for path, env, _doc, _default in config.knobs():
        cell = f"`{env}`" if env else "override only"
        assert f"| `{path}` | {cell} |" in text, f"docs/configuration.md lacks the row of {path} ({cell})"


def test_at_most_twelve_public_variables():
    """The variables a user of the library may set: the knobs that have one and those read
    where they act (build, data, checks, set-up); the test harness's (docs/configuration.md,
    "Tests and benchmarks") and the test hooks (``_FASTCL_*``) are not the library's interface."""
    text = DOC.read_text(encoding="utf-8")
    harness = set(re.findall(r"`(_?FASTCL_[A-Z0-9_]+)`", text.split("## Tests and benchmarks", 1)[1]))
    setup = set(re.findall(r"\$\{?(FASTCL_[A-Z0-9_]+)", (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")))
    knob_vars = {env for _, env, _, _ in config.knobs() if env}
    public = {n for n in knob_vars | _environment_reads() | setup if not n.startswith("_")} - harness
    assert "FASTCL_BACKEND" in public and "FASTCL_TORCH" in public and "FASTCL_DATA_DIR" in public
    assert len(public) <= 12, sorted(public)


def _environment_reads() -> set[str]:
    """Every FASTCL_* name the product's code reads from the environment."""
    pattern = re.compile(r"(?:environ|getenv|env_int)\W[^\n]*?\b(_?FASTCL_[A-Z0-9_]+)")
    names: set[str] = set()
    sources = [*ROOT.glob("fastcl/**/*.py"), *ROOT.glob("kernels/**/*.py"), *ROOT.glob("csrc/**/*.cpp")]
    sources += [*ROOT.glob("csrc/**/*.h"), ROOT / "scripts" / "setup.sh"]
    for path in sources:
        names.update(pattern.findall(path.read_text(encoding="utf-8")))
    for path in ROOT.glob("fastcl/**/*.py"):  # names kept in constants: ENV_VAR = "FASTCL_DATA_DIR"
        names.update(re.findall(r'^\w*ENV\w* = "(FASTCL_[A-Z0-9_]+)"', path.read_text(encoding="utf-8"), re.M))
    return {n for n in names if not n.startswith("FASTCL_BENCH_")}  # benchmarks: their pytest options


def test_every_environment_variable_is_documented():
    text = DOC.read_text(encoding="utf-8")
    names = _environment_reads()
    assert {"FASTCL_CHECK_FINITE", "FASTCL_DATA_DIR"} <= names
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"read by fastcl but not in docs/configuration.md: {missing}"


def test_no_tuning_knob_is_read_outside_the_configuration():
    """The knobs of fastcl.config are read there only (one defined time), not per call elsewhere."""
    knob_vars = {env for _, env, _, _ in config.knobs() if env}
    pattern = re.compile(r"(?:environ|getenv|env_int)\W[^\n]*?\b(FASTCL_[A-Z0-9_]+)")
    for path in [*ROOT.glob("fastcl/**/*.py"), *ROOT.glob("kernels/**/*.py"), *ROOT.glob("csrc/**/*.[ch]*")]:
        if path.name == "config.py":
            continue
        found = set(pattern.findall(path.read_text(encoding="utf-8"))) & knob_vars
        assert not found, f"{path.relative_to(ROOT)} reads {found} itself"


def test_docs_example_runs():
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    exec(compile(code, "docs/configuration.md", "exec"), {})


def test_module_docstring_example_runs():
    import doctest

    with config.override(cpp={"gemm": "auto"}):  # the example shows the default
        result = doctest.testmod(config, verbose=False)
    assert result.attempted and not result.failed
