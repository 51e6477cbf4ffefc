"""scripts/gclsr_repro.sh's table writer and its row definitions (the runs themselves are
too long for tests; docs/gclsr.md records the smoke run)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _table_module():
    spec = importlib.util.spec_from_file_location("gclsr_table", ROOT / "scripts" / "gclsr_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_row(folder: Path, score: float, args: str) -> None:
    folder.mkdir(parents=True)
    tasks = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")
    (folder / "sts.json").write_text(
        json.dumps(
            {
                "gclsr": {**{t: score for t in tasks}, "avg": score},
                "avg_word_vectors": {**{t: 50.0 for t in tasks}, "avg": 50.0},
            }
        )
    )
    (folder / "timing.json").write_text(json.dumps({"train_s": 10, "sts_s": 2, "args": args}))
    (folder / "summary.json").write_text(json.dumps({"steps": 380, "best_step": 190}))
    (folder / "machine.txt").write_text("start x load average: 0.1\nend y\n")
    (folder / "log.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"step": 10, "loss": -0.1, "std_z": 0.015},
                {"step": 19, "stsb_dev": 70.0, "best_stsb_dev": 70.0},
                {"step": 20, "loss": -0.9, "std_z": 0.014},
            ]
        )
        + "\n"
    )


def test_table_lists_baseline_and_every_row(tmp_path):
    _fake_row(tmp_path / "full", 66.75, "")
    _fake_row(tmp_path / "base", 60.0, "--pwva-p 0 --attention false --group-size 4096")
    assert _table_module().main([str(tmp_path), "full", "base"]) == 0
    text = (tmp_path / "results.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| encoder | STS12 |") and "SICK-R | AVG |" in lines[0]
    assert lines[1].startswith("| averaged word vectors") and "50.00" in lines[1]
    assert "GCLSR_base + PWVA + self-att. + GP" in lines[2] and "66.75 | 190 | 10 |" in lines[2]
    assert lines[3].startswith("| GCLSR_base (no PWVA") and "60.00" in lines[3]
    assert "loss -0.1000 -> -0.9000" in text and "STS-B dev [70.0]" in text
    assert json.loads((tmp_path / "results.json").read_text())["rows"]["base"]["sts"]["avg"] == 60.0


def test_script_rows_are_the_ablations_and_the_script_parses():
    script = (ROOT / "scripts" / "gclsr_repro.sh").read_text()
    assert 'base) echo "--pwva-p 0 --attention false --group-size 4096"' in script
    assert "--preset paper" in script
    from fastcl.gclsr.recipe import PAPER

    assert PAPER["proj_dim"] == 4096  # one group of all features = no grouping
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gclsr_repro.sh")], check=True)
