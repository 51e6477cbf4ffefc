"""``python -m fastcl eval`` / ``plot-similarity`` end to end with a tiny random BERT."""

from __future__ import annotations

import json

import pytest

from fastcl.__main__ import main
from fastcl.cli.eval import parse_tasks
from tests.helpers.eval import save_tiny_model


def test_parse_tasks():
    assert parse_tasks("sts12, STS-X".replace("STS-X", "stsb")) == ["sts12", "stsb"]
    assert parse_tasks("sts")[-1] == "sickr" and len(parse_tasks("all")) == 14
    assert parse_tasks("mr,transfer,mr")[:2] == ["mr", "cr"]
    with pytest.raises(ValueError, match="unknown task"):
        parse_tasks("sts12,sts17")
    with pytest.raises(ValueError, match="empty"):
        parse_tasks(" , ")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-bert"))


@pytest.mark.data
def test_eval_cli_writes_scores_and_details(tiny_model, data_dir, tmp_path, capsys):
    out = tmp_path / "res" / "results.json"
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_model),
            "--pooling",
            "avg_first_last",
            "--tasks",
            "sts16,stsb,trec",
            "--data-dir",
            str(data_dir),
            "--output",
            str(out),
            "--aggregation",
            "wmean",
            "--transfer-config",
            "test",
            "--device",
            "cpu",
            "--quiet",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    for task in ("sts16", "stsb", "trec"):
        assert isinstance(res[task], float) and -100 <= res[task] <= 100
    d = res["details"]["sts16"]
    assert d["n_pairs"] == 1186 and len(d["subsets"]) == 5 and d["aggregation"] == "wmean"
    assert res["sts16"] == pytest.approx(d["wmean"]) and d["subsets"]["postediting"]["n"] == 244
    assert res["avg_sts"] == pytest.approx((res["sts16"] + res["stsb"]) / 2)
    assert res["details"]["trec"]["n"] == {"train": 5452, "test": 500}
    assert res["config"]["pooling"] == "avg_first_last" and res["config"]["tasks"] == ["sts16", "stsb", "trec"]
    printed = capsys.readouterr().out
    assert "STS16" in printed and "TREC" in printed and "STS16 | STS-B | Avg." in printed


def test_eval_cli_rejects_bad_arguments(tiny_model, tmp_path):
    with pytest.raises(SystemExit, match="unknown task"):
        main(["eval", "--model", str(tiny_model), "--tasks", "sts99", "--data-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="dev"):
        main(["eval", "--model", str(tiny_model), "--tasks", "sts12", "--split", "dev", "--data-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="data directory"):
        main(["eval", "--model", str(tiny_model), "--tasks", "sts12", "--data-dir", str(tmp_path / "missing")])


def test_plot_similarity_cli(tiny_model, tmp_path, capsys):
    sentences = tmp_path / "s.txt"
    sentences.write_text(
        "# a comment\nA man plays a guitar.\n\nSomeone is playing music.\nThe stock market fell today.\n"
    )
    fig = tmp_path / "fig" / "sim.png"
    assert (
        main(
            [
                "plot-similarity",
                "--model",
                str(tiny_model),
                "--sentences",
                str(sentences),
                "--out",
                str(fig),
                "--pooling",
                "mean",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and fig.stat().st_size > 5000
    assert "3 sentences" in capsys.readouterr().out
    sentences.write_text("only one\n")
    with pytest.raises(SystemExit, match="at least 2"):
        main(["plot-similarity", "--model", str(tiny_model), "--sentences", str(sentences), "--out", str(fig)])


def test_cosine_matrix_and_plot_checks(tmp_path):
    import torch

    from fastcl.eval.plot import cosine_matrix, plot_similarity
    from fastcl.testing import assert_roundoff

    sim = cosine_matrix(torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]))
    want = torch.tensor([[1, 0, 0.5**0.5], [0, 1, 0.5**0.5], [0.5**0.5, 0.5**0.5, 1]], dtype=torch.float64)
    # float64: a norm and a dot product of d = 2 coordinates of unit size
    assert_roundoff(torch.from_numpy(sim), want, torch.float64, terms=2 * 2, magnitude=1.0)
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        plot_similarity(["a", "b"], sim, tmp_path / "x.png")
