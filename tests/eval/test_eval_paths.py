"""``fastcl eval`` / ``plot-similarity``: bad paths fail before the model loads, with one line;
results are written atomically and never lost to a late write error."""

from __future__ import annotations

import json
import os

import pytest

from fastcl.__main__ import main
from fastcl._fsio import check_model_path, looks_like_path
from tests.helpers.eval import save_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading the model means the checks came too late."""
    from fastcl.eval.encode import Encoder

    def refuse(*a, **k):
        pytest.fail("the model was loaded before the paths were checked")

    monkeypatch.setattr(Encoder, "from_pretrained", refuse)


@pytest.mark.parametrize(
    "model",
    ["/nonexistent/fastcl-model", "./no-such-model", "~/no-such-fastcl-model", "runs/a/final", "my models/bert"],
)
def test_missing_local_model_path(model, tmp_path, no_model_load):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", model, "--tasks", "stsb", "--data-dir", str(tmp_path)])
    assert str(e.value) == f"fastcl eval: --model {model}: model path not found"


def test_model_folder_without_config(tmp_path, no_model_load):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="config.json missing"):
        main(["eval", "--model", str(tmp_path / "empty"), "--tasks", "stsb", "--data-dir", str(tmp_path)])


def test_hub_ids_stay_allowed():
    for name in (
        "bert-base-uncased",
        "sentence-transformers/all-MiniLM-L6-v2",
        "princeton-nlp/sup-simcse-bert-base-uncased",
    ):
        assert not looks_like_path(name)
        check_model_path(name)  # no error: transformers resolves it


@pytest.mark.parametrize("kind", ["under_file", "is_dir"])
def test_bad_output_path_fails_before_the_model_loads(tiny_model, tmp_path, no_model_load, kind):
    blocker = tmp_path / "blocker"
    blocker.write_text("x\n")
    out = blocker / "results.json" if kind == "under_file" else tmp_path
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", str(tiny_model), "--tasks", "stsb", "--data-dir", str(tmp_path), "--output", str(out)])
    msg = str(e.value)
    assert msg.startswith("fastcl eval: --output") and "\n" not in msg
    assert (f"{blocker} is a file" if kind == "under_file" else "is a directory") in msg


def test_plot_similarity_checks_paths_first(tmp_path, no_model_load):
    sentences = tmp_path / "s.txt"
    sentences.write_text("a b\nc d\n")
    with pytest.raises(SystemExit, match="model path not found"):
        main(
            ["plot-similarity", "--model", "./missing", "--sentences", str(sentences), "--out", str(tmp_path / "f.png")]
        )
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="is a file"):
        main(
            [
                "plot-similarity",
                "--model",
                "bert-base-uncased",
                "--sentences",
                str(sentences),
                "--out",
                str(tmp_path / "file" / "f.png"),
            ]
        )


@pytest.mark.data
def test_results_survive_a_late_write_error(tiny_model, data_dir, tmp_path, capsys, monkeypatch):
    """The output folder was fine when checked but the write fails after the evaluation (disk
    full, folder removed): the previous file is untouched and the results go to a fallback file."""
    import fastcl._fsio as fsio

    out = tmp_path / "results.json"
    out.write_text('{"old": true}\n')
    real = fsio.atomic_write

    def disk_full(path, write):
        def write_then_fail(f):
            write(f)
            raise OSError(28, "No space left on device")

        return real(path, write_then_fail)

    monkeypatch.setattr(fsio, "atomic_write", disk_full)
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_model),
            "--pooling",
            "mean",
            "--tasks",
            "stsb",
            "--data-dir",
            str(data_dir),
            "--output",
            str(out),
            "--device",
            "cpu",
            "--quiet",
        ]
    )
    assert rc == 1
    assert out.read_text() == '{"old": true}\n'  # atomic: no half-written file
    assert not [p for p in tmp_path.iterdir() if p.name != "results.json"], "temporary file left behind"
    err = capsys.readouterr().err
    assert f"could not write {out}" in err and "No space left on device" in err
    fallback = err.split("the results were saved to ")[1].split(" instead")[0]
    with open(fallback) as f:
        res = json.load(f)
    os.remove(fallback)
    assert isinstance(res["stsb"], float) and res["config"]["tasks"] == ["stsb"]


@pytest.mark.data
def test_results_written_atomically(tiny_model, data_dir, tmp_path):
    out = tmp_path / "new" / "dir" / "results.json"  # missing folders are created
    assert (
        main(
            [
                "eval",
                "--model",
                str(tiny_model),
                "--pooling",
                "mean",
                "--tasks",
                "stsb",
                "--data-dir",
                str(data_dir),
                "--output",
                str(out),
                "--device",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    assert isinstance(json.loads(out.read_text())["stsb"], float)
    assert [p.name for p in out.parent.iterdir()] == ["results.json"]
