"""Resume through the training loop and CLI: fallback past a damaged checkpoint, refused option
changes, a log without duplicate steps, and bad output paths refused before any compute."""

from __future__ import annotations

import json

import pytest

from fastcl.__main__ import main as cli
from fastcl.cli.train import parse
from fastcl.trainers.loop import train
from tests.helpers.train import make_samples, make_tiny_bert
from tests.train.test_train import _argv, _assert_same_tensors, _options, _state

METHOD = "supmpn"  # sampled negatives and dropout: any replayed randomness shows


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("resume")
    return {"model": make_tiny_bert(root / "tiny"), **make_samples(data_dir, root / "data", nli_rows=120)}


def _records(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _crash_at(step, opts):
    recipe, cfg = parse(_argv(METHOD, opts))
    real_loss = recipe.loss

    def crash(model, batch, ctx):
        if ctx.step == step:
            raise KeyboardInterrupt("simulated interruption")
        return real_loss(model, batch, ctx)

    recipe.loss = crash
    with pytest.raises(KeyboardInterrupt):
        train(recipe, cfg)


@pytest.mark.data
def test_resume_auto_skips_damaged_newest_checkpoint_and_logs_each_step_once(setup, tmp_path):
    opts = _options(setup, METHOD, tmp_path / "full", max_examples=40, max_steps=6, save_steps=2)
    train(*parse(_argv(METHOD, opts)))

    opts["output_dir"] = tmp_path / "cut"
    _crash_at(5, opts)  # checkpoints 2 and 4 written, steps 1-5 logged
    newest = tmp_path / "cut" / "checkpoint-4" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # e.g. the disk filled up
    with pytest.warns(RuntimeWarning, match=f"skipping {newest} is truncated.*resuming from .*checkpoint-2"):
        train(*parse(_argv(METHOD, {**opts, "resume": "auto"})))

    full, resumed = _state(tmp_path / "full" / "checkpoint-6"), _state(tmp_path / "cut" / "checkpoint-6")
    _assert_same_tensors(full["model"], resumed["model"], "model")
    _assert_same_tensors(full["optimizer"], resumed["optimizer"], "optimizer")

    # steps 3-5 were logged by the crashed run and again after the resume: only once now
    def timeless(out):
        return [{k: v for k, v in r.items() if k not in ("elapsed_s", "run_id")} for r in _records(out)]

    assert [r["step"] for r in _records(tmp_path / "cut")] == [1, 2, 3, 4, 5, 6]
    assert timeless(tmp_path / "cut") == timeless(tmp_path / "full")
    # one run: the crashed start and its resume share the id, every record carries it
    run_id = json.loads((tmp_path / "cut" / "run.json").read_text())["run_id"]
    assert {r["run_id"] for r in _records(tmp_path / "cut")} == {run_id}
    # checkpoint-4 was rewritten by the resumed run and is intact again
    from fastcl.trainers.checkpoint import problem

    assert problem(tmp_path / "cut" / "checkpoint-4") is None


@pytest.mark.data
def test_resume_refuses_changed_options_and_allows_them_explicitly(setup, tmp_path, capsys):
    out = tmp_path / "run"
    opts = _options(setup, METHOD, out, max_examples=16, max_steps=1, lr=1e-3, schedule="constant")
    assert cli(["train", *_argv(METHOD, opts)]) == 0
    capsys.readouterr()

    changed = {**opts, "resume": "auto", "max_steps": 2, "lr": 2e-3, "seed": 7, "batch_size": 4}
    assert cli(["train", *_argv(METHOD, changed)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for text in (
        "--batch-size: checkpoint 8, now 4",
        "--lr: checkpoint 0.001, now 0.002",
        "--seed: checkpoint 1, now 7",
        "--allow-config-change",
    ):
        assert text in err, err
    assert not (out / "checkpoint-2").exists()

    # another method over the same output folder
    other = {**opts, "resume": "auto", "max_steps": 2}
    assert cli(["train", *_argv("simcse-sup", other)]) == 2
    assert "--method: checkpoint 'supmpn', now 'simcse-sup'" in capsys.readouterr().err

    # explicitly allowed: continues, with the new learning rate in effect
    with pytest.warns(RuntimeWarning, match="--allow-config-change: .*--lr"):
        assert (
            cli(
                [
                    "train",
                    *_argv(METHOD, {**opts, "resume": "auto", "max_steps": 2, "lr": 2e-3}),
                    "--allow-config-change",
                ]
            )
            == 0
        )
    state = _state(out / "checkpoint-2")
    assert state["progress"]["step"] == 2
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == pytest.approx(
        [2e-3] * len(state["optimizer"]["param_groups"])
    )
    assert [r["lr"] for r in _records(out) if "loss" in r] == pytest.approx([1e-3, 2e-3])


@pytest.mark.parametrize("kind", ["file", "under_file"])
def test_output_dir_that_is_a_file_fails_before_compute(setup, tmp_path, capsys, monkeypatch, kind):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder\n")
    out = blocker if kind == "file" else blocker / "run"
    import fastcl.trainers.loop as loop

    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("training started"))
    opts = _options(setup, METHOD, out, max_examples=8, max_steps=1)
    assert cli(["train", *_argv(METHOD, opts)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--output-dir" in err, err
    assert ("exists and is not a directory" if kind == "file" else f"{blocker} is a file") in err


def test_resume_of_a_missing_folder_is_one_line(setup, tmp_path, capsys):
    opts = _options(setup, METHOD, tmp_path / "x", max_examples=8, max_steps=1, resume=tmp_path / "nope")
    assert cli(["train", *_argv(METHOD, opts)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--resume" in err and "does not exist" in err, err
