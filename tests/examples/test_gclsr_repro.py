"""examples/gclsr/: the results-table writer, the row definitions of repro.sh and the step-0
model script (a whole smoke run of repro.sh is in test_examples.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

GCLSR = Path(__file__).resolve().parents[2] / "examples" / "gclsr"


def _table_module():
    spec = importlib.util.spec_from_file_location("gclsr_table", GCLSR / "table.py")
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
    script = (GCLSR / "repro.sh").read_text()
    assert 'base) echo "--pwva-p 0 --attention false --group-size 4096"' in script
    assert "--preset paper" in script
    from fastcl.gclsr.recipe import PAPER

    assert PAPER["proj_dim"] == 4096  # one group of all features = no grouping
    subprocess.run(["bash", "-n", str(GCLSR / "repro.sh")], check=True)


def test_init_script_rebuilds_the_seeded_model_and_measures_movement(tmp_path):
    """examples/gclsr/init_model.py: the step-0 model is the seeded constructor's, it reloads as an
    encoder, and the relative change is |W_best - W_init| / |W_init| per weight matrix."""
    import torch

    from fastcl.gclsr.model import GCLSRModel
    from fastcl.gclsr.recipe import CONFIG_FILE, WEIGHTS_FILE, load_pretrained

    vectors = tmp_path / "vectors.txt"
    vectors.write_text("the 0.1 0.2 0.3 0.4\ncat 0.5 -0.1 0.0 0.2\nsat -0.3 0.1 0.2 0.0\n")
    config = {
        "word_vectors": str(vectors),
        "seed": 7,
        "dim": 4,
        "max_words": 8,
        "region_sizes": [1, 2],
        "filters": 3,
        "proj_dim": 8,
        "pred_hidden": 4,
        "attention": True,
    }
    torch.manual_seed(7)
    init = GCLSRModel(4, region_sizes=[1, 2], filters=3, proj_dim=8, pred_hidden=4, attention=True)
    trained = {k: v.clone() for k, v in init.state_dict().items()}
    w = trained["backbone.convs.0.weight"]
    trained["backbone.convs.0.weight"] = w * 1.25  # moved by exactly 25 % of its norm
    best = tmp_path / "run" / "best"
    best.mkdir(parents=True)
    torch.save(trained, best / WEIGHTS_FILE)
    (best / CONFIG_FILE).write_text(json.dumps(config))

    spec = importlib.util.spec_from_file_location("gclsr_init_model", GCLSR / "init_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "init"
    assert mod.main(["--run", str(tmp_path / "run"), "--output", str(out)]) == 0

    saved = torch.load(out / WEIGHTS_FILE)
    for name, value in init.state_dict().items():
        assert torch.equal(saved[name], value), name
    moved = json.loads((out / "relative_change.json").read_text())
    # written rounded to 4 decimals: float32's round-off of the norms (~1e-7) cannot show
    assert moved["backbone.convs.0.weight"] == 0.25
    assert moved["backbone.convs.1.weight"] == 0.0
    emb = load_pretrained(out).encode(["the cat sat"])
    assert emb.shape == (1, 6) and torch.isfinite(torch.as_tensor(emb)).all()
