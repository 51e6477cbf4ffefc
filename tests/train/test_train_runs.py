"""Runs that cannot be lost or mixed, and bad input refused in one line
before any model loads.

The first half drives :func:`fastcl.trainers.run.plan_run` on folders built by hand (a tiny
``nn.Linear``'s checkpoints, no training); the second half goes through ``fastcl train``
end to end on a tiny random BERT: run A finishes, run B is refused over it, replaces it with
``--overwrite``, is killed and resumed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest
import torch

from fastcl.__main__ import main as cli
from fastcl.trainers import checkpoint as ckpt
from fastcl.trainers.config import SetupError
from fastcl.trainers.run import RunConflictError, RunPlan, plan_run, run_files

# --------------------------------------------------------------------------- folders by hand


def _cfg(**over) -> argparse.Namespace:
    base = dict(
        method="supmpn",
        batch_size=8,
        lr=1e-3,
        seed=1,
        output_dir="out",
        max_steps=10,
        epochs=1,
        model="m",
        resume=None,
        overwrite=False,
        allow_config_change=False,
    )
    return argparse.Namespace(**{**base, **over})


def _checkpoint(out: Path, step: int, run_id: str | None, mark: bool = True) -> Path:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    folder = out / f"checkpoint-{step}"
    written = ckpt.save_checkpoint(
        folder, rank=0, model=model, optimizer=opt, scheduler=None, scaler=None,
        progress={"step": step, "best_score": None, "best_step": None}, cfg=_cfg(), run_id=run_id,
    )  # fmt: skip
    if mark:
        ckpt.mark_complete(folder, world_size=1, step=step, written=written, run_id=run_id)
    return folder


def _run_folder(out: Path, run_id: str | None, steps=(2, 4), log=True) -> Path:
    """What a run leaves: run.json (when it has an id), checkpoints, a log, a config, a summary."""
    out.mkdir(parents=True, exist_ok=True)
    if run_id is not None:
        (out / "run.json").write_text(json.dumps({"run_id": run_id}))
    for s in steps:
        _checkpoint(out, s, run_id)
    if log:
        (out / "log.jsonl").write_text("".join(json.dumps({"step": s, "run_id": run_id}) + "\n" for s in steps))
    (out / "config.json").write_text(json.dumps(vars(_cfg())))
    return out


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with the SHA-256 of its bytes: equal snapshots, untouched files."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_fresh_start_over_another_run_is_refused_and_touches_nothing(tmp_path):
    out = _run_folder(tmp_path / "run", "A")
    before = _snapshot(out)
    with pytest.raises(RunConflictError, match=r"already holds run A \(checkpoint-2/, checkpoint-4/.*--overwrite"):
        plan_run(_cfg(), out, 10)
    assert _snapshot(out) == before
    # a folder with nothing but an older fastcl's log is another run's too
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "log.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(RunConflictError, match=r"a run without a run id .*log\.jsonl"):
        plan_run(_cfg(), legacy, 10)
    # files that are not a run's do not count
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.txt").write_text("mine\n")
    assert plan_run(_cfg(), tmp_path / "notes", 10).replace == []


def test_overwrite_replaces_every_file_of_the_old_run_and_only_those(tmp_path):
    out = _run_folder(tmp_path / "run", "A")
    (out / "final").mkdir()
    (out / "final" / "config.json").write_text("{}")
    (out / ".log.jsonl.x1y2.tmp").write_text("partial")  # an interrupted atomic write
    (out / "data.csv").write_text("the user's own file\n")
    plan = plan_run(_cfg(overwrite=True), out, 10)
    assert plan.run_id != "A" and plan.resume_from is None and plan.start_step == 0
    assert {p.name for p in plan.replace} == {
        "run.json", "log.jsonl", "config.json", "checkpoint-2", "checkpoint-4", "final", ".log.jsonl.x1y2.tmp"
    }  # fmt: skip
    assert any("--overwrite: removing run A's files" in n for n in plan.notes)
    plan.apply()
    assert sorted(p.name for p in out.iterdir()) == ["data.csv", "run.json"]
    assert json.loads((out / "run.json").read_text())["run_id"] == plan.run_id


def test_overwrite_removes_run_json_first(tmp_path, monkeypatch):
    """A removal killed midway leaves no run.json: the folder then claims no run, so --resume
    auto refuses it instead of continuing the half-removed old run."""
    out = _run_folder(tmp_path / "run", "A")
    plan = plan_run(_cfg(overwrite=True), out, 10)
    import shutil

    def killed(path, *a, **k):
        raise KeyboardInterrupt("killed during --overwrite")

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        plan.apply()
    assert not (out / "run.json").exists() and (out / "checkpoint-2").is_dir()
    monkeypatch.undo()
    with pytest.raises(RunConflictError, match="without a run id"):
        plan_run(_cfg(resume="auto"), out, 10)


def test_resume_auto_continues_only_its_own_run_and_says_from_where(tmp_path):
    out = _run_folder(tmp_path / "run", "B", steps=(2, 4))
    _checkpoint(out, 6, "B", mark=False)  # killed while writing checkpoint-6
    with pytest.warns(RuntimeWarning, match="checkpoint-6/complete.json missing"):
        plan = plan_run(_cfg(resume="auto"), out, 10)
    assert (plan.run_id, plan.resume_from, plan.start_step) == ("B", out / "checkpoint-4", 4)
    assert plan.notes == [f"continuing run B from {out / 'checkpoint-4'} (step 4 of 10)"]
    assert not plan.new_run_file and not plan.replace
    # a checkpoint of another run in the folder: refused, never resumed or pruned
    _checkpoint(out, 8, "A")
    before = _snapshot(out)
    with pytest.raises(RunConflictError, match=r"checkpoint-8 belongs to run A, not to run B"):
        plan_run(_cfg(resume="auto"), out, 10)
    assert _snapshot(out) == before


def test_resume_auto_refuses_files_without_a_run_id(tmp_path):
    """An older fastcl's run (no run.json, checkpoints without ids), or only another run's log."""
    out = _run_folder(tmp_path / "old", None)
    with pytest.raises(RunConflictError, match=r"without a run id .*--resume DIR into a new --output-dir"):
        plan_run(_cfg(resume="auto"), out, 10)
    only_log = tmp_path / "log-only"
    only_log.mkdir()
    (only_log / "log.jsonl").write_text('{"step": 3, "run_id": "A"}\n')
    with pytest.raises(RunConflictError, match="without a run id"):
        plan_run(_cfg(resume="auto"), only_log, 10)
    # an explicit --resume of the old checkpoint into a new folder continues it as a new run
    plan = plan_run(_cfg(resume=str(out / "checkpoint-4")), tmp_path / "new", 10)
    assert plan.start_step == 4 and plan.new_run_file and plan.run_id


def test_resume_auto_of_a_run_without_checkpoints_restarts_it_with_its_options(tmp_path):
    out = _run_folder(tmp_path / "run", "B", steps=())  # killed before its first checkpoint
    plan = plan_run(_cfg(resume="auto"), out, 10)
    assert (plan.run_id, plan.resume_from, plan.start_step) == ("B", None, 0)
    assert "has no checkpoint yet: starting it again from step 0" in plan.notes[0]
    with pytest.raises(ckpt.CheckpointError, match=r"different options \(--lr: checkpoint 0.001, now 0.5\)"):
        plan_run(_cfg(resume="auto", lr=0.5), out, 10)
    # nothing at all in the folder: a new run
    fresh = plan_run(_cfg(resume="auto"), tmp_path / "empty", 10)
    assert fresh.run_id != "B" and fresh.new_run_file and "no run in" in fresh.notes[0]


def test_a_checkpoint_past_the_last_step_is_refused_one_at_it_is_finished(tmp_path):
    out = _run_folder(tmp_path / "run", "A", steps=(2, 4))
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint-4 is at step 4, past the 3 steps of --max-steps 3"):
        plan_run(_cfg(resume="auto", max_steps=3), out, 3)
    with pytest.raises(ckpt.CheckpointError, match=r"past the 3 steps of --epochs 1 \(3 steps\)"):
        plan_run(_cfg(resume="auto", max_steps=None), out, 3)
    done = plan_run(_cfg(resume="auto", max_steps=4), out, 4)
    assert done.finished and "is finished" in done.notes[0] and done.start_step == 4
    assert not plan_run(_cfg(resume="auto"), out, 10).finished


def test_explicit_resume_into_another_runs_folder(tmp_path):
    a = _run_folder(tmp_path / "a", "A")
    b = _run_folder(tmp_path / "b", "B")
    with pytest.raises(RunConflictError, match=r"holds run B .* belongs to run A"):
        plan_run(_cfg(resume=str(a / "checkpoint-2")), b, 10)
    # --overwrite replaces B's files and continues A's run there
    plan = plan_run(_cfg(resume=str(a / "checkpoint-2"), overwrite=True), b, 10)
    assert plan.run_id == "A" and plan.start_step == 2 and {p.name for p in plan.replace} >= {"checkpoint-4"}
    # but never by removing the very checkpoint it resumes
    with pytest.raises(SetupError, match="--overwrite would remove"):
        plan_run(_cfg(resume=str(b / "checkpoint-2"), overwrite=True), b, 10)
    # into its own folder, an earlier checkpoint of the same run
    own = plan_run(_cfg(resume=str(a / "checkpoint-2")), a, 10)
    assert own.run_id == "A" and not own.replace and not own.new_run_file
    # and into a new folder, the same run goes on there
    moved = plan_run(_cfg(resume=str(a / "checkpoint-4")), tmp_path / "c", 10)
    assert moved.run_id == "A" and moved.new_run_file


def test_overwrite_with_resume_auto_is_contradictory(tmp_path):
    with pytest.raises(SetupError, match="give one of them"):
        plan_run(_cfg(resume="auto", overwrite=True), _run_folder(tmp_path / "run", "A"), 10)


@pytest.mark.parametrize(
    "name, kind, message",
    [
        ("log.jsonl", "dir", "is a directory, where the run writes its log.jsonl"),
        ("summary.json", "dir", "is a directory, where the run writes its summary.json"),
        ("final", "file", "is a file, where the run writes its final/ folder"),
        ("checkpoint-3", "file", "is a file, where the run writes its checkpoint-3/ folder"),
    ],
)
def test_a_name_the_run_writes_taken_by_the_wrong_kind_is_refused(tmp_path, name, kind, message):
    out = tmp_path / "run"
    out.mkdir()
    (out / name).mkdir() if kind == "dir" else (out / name).write_text("x")
    for cfg in (_cfg(), _cfg(overwrite=True), _cfg(resume="auto")):  # never removed, even by --overwrite
        with pytest.raises(SetupError, match=message):
            plan_run(cfg, out, 10)
    assert (out / name).exists()


def test_prune_never_deletes_another_runs_checkpoint(tmp_path):
    _checkpoint(tmp_path, 2, "A")
    for s in (4, 6, 8):
        _checkpoint(tmp_path, s, "B")
    ckpt.prune(tmp_path, keep=2, run_id="B")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-6", "checkpoint-8"]


def test_run_files_lists_what_a_run_writes(tmp_path):
    out = _run_folder(tmp_path / "run", "A", steps=(2,))
    (out / "machine.txt").write_text("x")
    assert [p.name for p in run_files(out)] == ["checkpoint-2", "config.json", "log.jsonl", "run.json"]
    assert run_files(tmp_path / "missing") == []
    assert isinstance(plan_run(_cfg(), tmp_path / "missing", 10), RunPlan)


# --------------------------------------------------------------------------- end to end


METHOD = "supmpn"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    from tests.helpers.train import make_samples, make_tiny_bert

    root = tmp_path_factory.mktemp("runs")
    return {"model": make_tiny_bert(root / "tiny"), **make_samples(data_dir, root / "data", nli_rows=120)}


def _argv(setup, out, **extra) -> list[str]:
    opts = dict(
        model=setup["model"],
        train_file=setup["nli"],
        output_dir=out,
        batch_size=8,
        eval_steps=0,
        log_steps=1,
        progress="false",
        tensorboard="false",
        seed=1,
        max_steps=4,
        save_steps=2,
    )
    opts.update(extra)
    argv = ["train", METHOD]
    for k, v in opts.items():
        if v is True:
            argv.append(f"--{k.replace('_', '-')}")
        elif v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the refusals must come before it."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", refuse)


def _status(argv: list[str]) -> int:
    """The exit status of ``fastcl ARGV`` (argparse's errors end in ``SystemExit(2)``)."""
    try:
        return cli(argv)
    except SystemExit as e:
        return e.code


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _run_id(out: Path) -> str:
    return json.loads((out / "run.json").read_text())["run_id"]


def _crash_at(step: int, argv: list[str]) -> None:
    """``fastcl train`` killed during ``step`` (after the checkpoints before it)."""
    from fastcl.cli.train import parse
    from fastcl.trainers.loop import train

    recipe, cfg = parse(argv[1:])
    real_loss = recipe.loss

    def crash(model, batch, ctx):
        if ctx.step == step:
            raise KeyboardInterrupt("simulated kill")
        return real_loss(model, batch, ctx)

    recipe.loss = crash
    with pytest.raises(KeyboardInterrupt):
        train(recipe, cfg)


@pytest.mark.slow
@pytest.mark.data
def test_a_run_is_never_lost_or_mixed(setup, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    # run A trains to the end (checkpoints 2 and 4)
    assert cli(_argv(setup, out, seed=1)) == 0
    a = _run_id(out)
    assert json.loads((out / "summary.json").read_text())["run_id"] == a
    assert {r["run_id"] for r in _records(out)} == {a}
    assert ckpt.manifest_run_id(out / "checkpoint-4") == a and ckpt.read_state(out / "checkpoint-4")["run_id"] == a
    capsys.readouterr()

    # run B without --resume: refused in one line, before any model, A's files untouched
    before = _snapshot(out)
    with monkeypatch.context() as m:
        import transformers

        m.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("model loaded"))
        assert cli(_argv(setup, out, seed=2, max_steps=6)) == 2
    line = _err_line(capsys)
    assert f"already holds run {a}" in line and "--overwrite" in line and "--resume auto" in line
    assert _snapshot(out) == before

    # run B with --overwrite, killed during step 3 (checkpoint-2 written): A's files are gone
    _crash_at(3, _argv(setup, out, seed=2, max_steps=6, overwrite=True))
    b = _run_id(out)
    assert b != a
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "config.json", "log.jsonl", "run.json"]
    assert ckpt.manifest_run_id(out / "checkpoint-2") == b and {r["run_id"] for r in _records(out)} == {b}
    capsys.readouterr()

    # --resume auto continues B from its own step 2, saying so
    assert cli(_argv(setup, out, seed=2, max_steps=6, resume="auto")) == 0
    err = capsys.readouterr().err
    assert f"continuing run {b} from {out / 'checkpoint-2'} (step 2 of 6)" in err
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["run_id"], summary["steps"], summary["start_step"]) == (b, 6, 2)
    assert [r["step"] for r in _records(out)] == [1, 2, 3, 4, 5, 6] and {r["run_id"] for r in _records(out)} == {b}
    assert {ckpt.manifest_run_id(p) for p in ckpt.checkpoints(out)} == {b}

    # again: the run is finished, nothing is trained or rewritten
    before = _snapshot(out)
    assert cli(_argv(setup, out, seed=2, max_steps=6, resume="auto")) == 0
    assert f"run {b} is finished" in capsys.readouterr().err
    assert _snapshot(out) == before
    # with fewer steps than its checkpoint: reported, not used
    assert cli(_argv(setup, out, seed=2, max_steps=5, resume="auto")) == 2
    assert "checkpoint-6 is at step 6, past the 5 steps of --max-steps 5" in _err_line(capsys)
    assert _snapshot(out) == before


# --------------------------------------------------------------------------- bad input


def _log_dir(out: Path) -> None:
    (out / "log.jsonl").mkdir(parents=True)


def _final_file(out: Path) -> None:
    out.mkdir(parents=True)
    (out / "final").write_text("not a folder\n")


# (options, folder preparation, the error line's text, how docs/training.md's table says it)
BAD_INPUT = [
    (dict(precision="fp16"), None, "--precision fp16 needs a CUDA device", None),
    (dict(batch_size=1000), None, "--batch-size 1000 is larger than the 40 training examples", None),
    (dict(batch_size=16, max_examples=10), None, "(--max-examples 10 of 40)", None),
    (dict(output_dir=""), None, "--output-dir is empty", None),
    (dict(train_file=""), None, "--train-file is empty", "likewise `--train-file`"),
    (dict(data_dir=" "), None, "--data-dir is empty", "`--data-dir`"),
    (dict(), _log_dir, "log.jsonl is a directory", None),
    (dict(), _final_file, "final is a file", None),
    (dict(device="cuda:7"), None, "--device cuda:7", "`cuda:7` on fewer GPUs"),
    (dict(device="tpu"), None, "--device 'tpu'", None),
    (dict(lr="inf"), None, "argument --lr: expected a finite number", None),
    (dict(weight_decay="nan"), None, "argument --weight-decay: expected a finite number", "`--weight-decay nan`"),
    (dict(temperature="inf"), None, "argument --temperature: expected a finite number", "`--temperature inf`"),
    (dict(batch_size="x"), None, "argument --batch-size: invalid int value", None),
    (dict(resume="auto", overwrite=True), None, "give one of them", None),
    (
        dict(eval_steps=1, data_dir="/nonexistent/data"),
        None,
        "data directory /nonexistent/data not found",
        "data directory X not found",
    ),
]


def _bad_input_table() -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    return text[text.index("## Bad input") : text.index("## The `Recipe` interface")]


@pytest.mark.parametrize("row", BAD_INPUT, ids=lambda r: r[2])
def test_every_bad_input_case_is_in_the_docs_table(row):
    _, _, message, doc = row
    assert (doc or message) in _bad_input_table()


@pytest.mark.data
@pytest.mark.parametrize("extra, prepare, message, doc", BAD_INPUT, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_is_one_line_exit_2_before_any_model(setup, tmp_path, capsys, no_model, extra, prepare, message, doc):
    out = tmp_path / "run"
    if prepare is not None:
        prepare(out)
    extra = dict(extra)
    argv = _argv(setup, extra.pop("output_dir", out), **extra)
    if "cuda" in str(extra.get("device", "")) and torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    if extra.get("precision") == "fp16" and torch.cuda.is_available():
        argv += ["--device", "cpu"]
    assert _status(argv) == 2
    line = _err_line(capsys)
    assert line.startswith(f"fastcl train {METHOD}: error: ") and message in line, line
    assert not (out / "run.json").exists()
