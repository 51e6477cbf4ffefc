"""Every program in examples/ runs, at a tiny size, on the CPU, and says what it should.

Each runs in its own process exactly as a user would start it (``python examples/X.py``,
``torchrun``, ``bash``), so a broken import, argument or path fails here. The table
:data:`RUNS` names the command of each example; :func:`test_every_example_has_a_run` fails
when an example is added without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# helpers that an example calls (repro.sh runs sts.py and table.py) or that have their own
# tests (init_model.py: test_gclsr_repro.py)
HELPERS = {"gclsr/sts.py", "gclsr/table.py", "gclsr/init_model.py"}


def _run(args: list[str], tmp_path: Path, env: dict | None = None, timeout: int = 300) -> str:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHON": sys.executable, **(env or {})}
    proc = subprocess.run(
        args, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def _py(name: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / name)]


def run_losses_tour(tmp_path, data_dir=None):
    out = _run([*_py("losses_tour.py"), "--tiny"], tmp_path)
    assert "supmpn_loss" in out and "(= the sum over prefixes)" in out


def run_gradcache(tmp_path, data_dir=None):
    out = _run([*_py("gradcache_bert.py"), "--batch", "32", "--chunk-size", "8", "--steps", "1"], tmp_path)
    assert "step 0: loss" in out and "over 32 sentences, 8 per chunk" in out


def run_ddp(tmp_path, data_dir=None):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    out = _run([*torchrun, str(EXAMPLES / "ddp.py"), "--check", "--steps", "2", "--batch", "8"], tmp_path)
    assert "check: max relative difference" in out and "step   1" in out


def run_sentence_transformers(tmp_path, data_dir=None):
    out = _run([*_py("sentence_transformers_train.py"), "--output-dir", "st", "--steps", "1"], tmp_path)
    assert "(1, 384)" in out
    assert (tmp_path / "st" / "final").is_dir()


def run_gist_false_negatives(tmp_path, data_dir=None):
    out = _run([*_py("gist_false_negatives.py"), "--data", "builtin"], tmp_path)
    assert "from built-in paraphrase groups" in out and "the guide filter drops" in out
    assert "MNRL + guide filter" in out and "MNRL + self-margin filter" in out
    from fastcl._paths import data_dir as staged

    if (staged() / "stsb" / "original" / "sts-train.csv.gz").is_file():  # the staged groups too, when present
        out = _run([*_py("gist_false_negatives.py"), "--data", "stsb", "--rows", "8"], tmp_path)
        assert "from STS-B train paraphrase groups" in out and "GIST with its default aa and pp blocks" in out


def run_train_supmpn(tmp_path, data_dir):
    args = ["--max-steps", "1", "--batch-size", "2", "--max-examples", "8", "--no-eval", "--output-dir", "run"]
    _run([*_py("train_supmpn_minilm.py"), *args], tmp_path, env={"FASTCL_DATA_DIR": str(data_dir)})
    report = json.loads((tmp_path / "run" / "real_run.json").read_text())
    assert report["train"]["steps"] == 1 and report["model"] == "all-MiniLM-L6-v2"


def run_gclsr_repro(tmp_path, data_dir):
    # the paper's network with 8 filters per region, both rows, one step each, STS dev sets
    tiny = ["--max-examples", "32", "--max-steps", "1", "--batch-size", "16", "--filters", "8", "--max-words", "16"]
    env = {"FASTCL_DATA_DIR": str(data_dir), "OUT": "out", "STS_SPLIT": "dev"}
    _run(["bash", str(EXAMPLES / "gclsr" / "repro.sh"), *tiny], tmp_path, env=env)
    table = (tmp_path / "out" / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| encoder | STSB | SICK-R | AVG |")
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| averaged word vectors (same vectors)",
        "| GCLSR_base + PWVA + self-att. + GP (paper preset)",
        "| GCLSR_base (no PWVA, no attention, no grouping)",
    ]


slow = pytest.mark.slow


def run_clip_tiny(tmp_path, data_dir=None):
    out = _run([*_py("clip_tiny.py"), "--steps", "40", "--batch", "256"], tmp_path)
    assert "siglip: after 40 steps" in out and "the loss fell" in out, out


RUNS = {  # example -> (run function, needs the staged data, marks)
    "losses_tour.py": (run_losses_tour, False, ()),
    "gradcache_bert.py": (run_gradcache, False, ()),
    "clip_tiny.py": (run_clip_tiny, False, ()),
    "ddp.py": (run_ddp, False, (slow,)),
    "sentence_transformers_train.py": (run_sentence_transformers, False, (slow,)),
    "gist_false_negatives.py": (run_gist_false_negatives, False, (slow,)),
    "train_supmpn_minilm.py": (run_train_supmpn, True, (slow,)),
    "gclsr/repro.sh": (run_gclsr_repro, True, (slow,)),
}


def test_every_example_has_a_run():
    found = {p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*") if p.suffix in (".py", ".sh")}
    assert found - HELPERS == set(RUNS), "add a run for each new example to RUNS (or list it in HELPERS)"
    assert HELPERS <= found


@pytest.mark.parametrize("name", [pytest.param(n, marks=m, id=n) for n, (_, _, m) in RUNS.items()])
def test_example_runs(name, tmp_path, request):
    run, needs_data, _ = RUNS[name]
    data = request.getfixturevalue("data_dir") if needs_data else None
    run(tmp_path, data)
