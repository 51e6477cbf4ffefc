"""Which run an output folder holds, and what a start may do with it.

A *run* is one training trajectory: started once, then possibly interrupted and resumed any
number of times. Its id is chosen at its start and kept in ``run.json`` in the output folder;
every checkpoint (``complete.json`` and ``state.pt``), every ``log.jsonl`` record and
``summary.json`` carry it too. An output folder holds one run at most, never parts of two:

=====================  ==================================================================
start                  what happens
=====================  ==================================================================
no ``--resume``        the folder must hold no run's files (checkpoints, log, config,
                       summary, ``final/``, ``best/``, ``tb/``, ``run.json``); otherwise the
                       start is refused, naming the run and its files. ``--overwrite``
                       removes them (once the model has loaded, before anything is written)
                       and starts a new run.
``--resume auto``      continues the folder's run (``run.json``) from its newest intact
                       checkpoint, saying from which step; with no checkpoint yet, starts it
                       again from step 0 under the same options (``config.json``). A folder
                       without any run's files: a new run. Files of a run without an id
                       (an older fastcl), or checkpoints of another run: refused.
``--resume DIR``       continues DIR's run: in DIR's own folder, or in an ``--output-dir``
                       that holds no run's files (or the same run's, or with ``--overwrite``).
=====================  ==================================================================

A checkpoint at the last step is a finished run: nothing is trained again (the summary is
rewritten only if it is missing). A checkpoint *beyond* the last step (``--max-steps`` or
``--epochs`` lowered) is refused: training from it would report steps the options exclude.

Every check here reads files only; a refused start changes nothing on disk.
"""

from __future__ import annotations

import argparse
import datetime
import json
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from fastcl._fsio import atomic_write_text, fsync_dir
from fastcl.trainers import checkpoint as ckpt
from fastcl.trainers.config import SetupError

RUN_FILE = "run.json"
LOG_FILE = "log.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
# what a run writes into its output folder: files, folders (+ checkpoint-STEP folders)
RUN_FILES = (RUN_FILE, LOG_FILE, CONFIG_FILE, SUMMARY_FILE)
RUN_DIRS = ("final", "best", "tb")


class RunConflictError(SetupError):
    """The output folder holds another run (or parts of one) that this start would mix with."""


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-xxxxxx``: sortable by start time, unique by its random suffix."""
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def _is_checkpoint(path: Path) -> bool:
    return ckpt._step_of(path) is not None


def check_layout(output_dir: Path) -> None:
    """Refuse a folder where a name the run writes is taken by the wrong kind of entry (a
    ``log.jsonl`` that is a folder, a ``final`` that is a file, ...): found at the start, not
    when the write fails hours later. Such entries are never fastcl's and never removed."""
    if not output_dir.is_dir():
        return
    for name in RUN_FILES:
        p = output_dir / name
        if p.exists() and not p.is_file():
            raise SetupError(
                f"--output-dir {output_dir}: {p} is a directory, where the run writes its {name}: move it away "
                "or choose another --output-dir"
            )
    for p in sorted(output_dir.iterdir()):
        if (p.name in RUN_DIRS or _is_checkpoint(p)) and not p.is_dir():
            raise SetupError(
                f"--output-dir {output_dir}: {p} is a file, where the run writes its {p.name}/ folder: move it away "
                "or choose another --output-dir"
            )


def run_files(output_dir: Path) -> list[Path]:
    """The entries of ``output_dir`` that a run writes (sorted; none when it does not exist)."""
    if not output_dir.is_dir():
        return []
    out = []
    for p in sorted(output_dir.iterdir()):
        if p.name in RUN_FILES or p.name in RUN_DIRS or _is_checkpoint(p):
            out.append(p)
        elif p.name.endswith(".tmp") and any(p.name.startswith(f".{n}.") for n in RUN_FILES):
            out.append(p)  # left by an interrupted atomic write of one of them
    return out


def read_run_id(output_dir: Path) -> str | None:
    """The id in ``run.json`` (None when there is no such file)."""
    path = output_dir / RUN_FILE
    if not path.is_file():
        return None
    try:
        run_id = json.loads(path.read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SetupError(f"{path} is unreadable or malformed ({type(e).__name__}: {e}): move it away") from e
    if not isinstance(run_id, str) or not run_id:
        raise SetupError(f"{path}: run_id must be a non-empty string, got {run_id!r}")
    return run_id


def checkpoint_run_ids(output_dir: Path) -> dict[Path, str | None]:
    """The run id of every checkpoint folder with a readable ``complete.json`` (None: written
    before checkpoints carried one). Incomplete folders are left out (``resolve_resume``
    reports them)."""
    out = {}
    for folder in ckpt._folders(output_dir):
        try:
            out[folder] = ckpt.manifest_run_id(folder)
        except ckpt.CheckpointError:
            continue
    return out


def _listing(paths: list[Path], limit: int = 4) -> str:
    names = [p.name + ("/" if p.is_dir() else "") for p in paths]
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _whose(run_id: str | None) -> str:
    return f"run {run_id}" if run_id else "a run without a run id (no run.json)"


@dataclass
class RunPlan:
    """What :func:`plan_run` decided: every check has passed, nothing is written yet."""

    run_id: str
    output_dir: Path
    resume_from: Path | None = None  # the checkpoint to load (None: start at step 0)
    resume_state: dict | None = None  # its state.pt, read once
    start_step: int = 0
    total_steps: int = 0
    replace: list[Path] = field(default_factory=list)  # another run's files, removed by --overwrite
    new_run_file: bool = True  # write run.json (a new run, or a run continued in a new folder)
    finished: bool = False  # the checkpoint is at the last step: nothing to train
    notes: list[str] = field(default_factory=list)  # what the start does, one line each

    def apply(self) -> None:
        """Remove the files ``--overwrite`` replaces (``run.json`` first, so that an interrupted
        removal leaves no folder that claims a run), then write ``run.json``. Rank 0 only, after
        the model has loaded."""
        ordered = sorted(self.replace, key=lambda p: p.name != RUN_FILE)
        for p in ordered:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        if ordered:
            fsync_dir(self.output_dir)
        if self.new_run_file:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            record = {"run_id": self.run_id, "created": datetime.datetime.now().isoformat(timespec="seconds")}
            if self.resume_from is not None:
                record["continued_from"] = str(self.resume_from)
            atomic_write_text(self.output_dir / RUN_FILE, json.dumps(record, indent=1) + "\n")


def _refuse_foreign_checkpoints(output_dir: Path, run_id: str) -> None:
    for folder, other in checkpoint_run_ids(output_dir).items():
        if other != run_id:
            raise RunConflictError(
                f"{folder} belongs to {_whose(other)}, not to run {run_id} that {output_dir} holds (run.json): "
                "the folder mixes runs; move that checkpoint away"
            )


def _check_against_config_file(output_dir: Path, cfg) -> None:
    """A run restarted from step 0 (no checkpoint yet) must keep its recorded options."""
    path = output_dir / CONFIG_FILE
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SetupError(f"{path} is unreadable or malformed ({type(e).__name__}: {e}): move it away") from e
    now = json.loads(json.dumps(vars(cfg), default=str))  # compare as config.json records values
    diffs = ckpt.config_differences(saved if isinstance(saved, dict) else {}, argparse.Namespace(**now))
    if diffs and not getattr(cfg, "allow_config_change", False):
        raise ckpt.CheckpointError(
            f"--resume auto: the run in {output_dir} was started with different options ({'; '.join(diffs)}); "
            "resume with its values, or pass --allow-config-change"
        )


def _steps_phrase(cfg, total: int) -> str:
    if cfg.max_steps is not None:
        return f"--max-steps {cfg.max_steps}"
    return f"--epochs {cfg.epochs} ({total} steps)"


def plan_run(cfg, output_dir: Path, total_steps: int) -> RunPlan:
    """Decide what this start does in ``output_dir`` (see the module docstring); raise
    :class:`SetupError` (a :class:`RunConflictError` or ``CheckpointError``) when it may not.

    Reads files only. ``total_steps``: the optimiser steps the options ask for.
    """
    output_dir = Path(output_dir)
    overwrite = bool(getattr(cfg, "overwrite", False))
    resume = cfg.resume
    check_layout(output_dir)
    present = run_files(output_dir)
    folder_run = read_run_id(output_dir)
    where = f"--output-dir {output_dir}"

    if resume is None:
        if present and not overwrite:
            raise RunConflictError(
                f"{where} already holds {_whose(folder_run)} ({_listing(present)}): continue it with "
                "--resume auto, replace it with --overwrite, or choose another --output-dir"
            )
        plan = RunPlan(new_run_id(), output_dir, total_steps=total_steps, replace=present)
        if present:
            plan.notes.append(
                f"--overwrite: removing {_whose(folder_run)}'s files from {output_dir} ({_listing(present)})"
            )
        plan.notes.append(f"starting run {plan.run_id} in {output_dir} ({total_steps} steps)")
        return plan

    if overwrite and resume == "auto":
        raise SetupError(
            "--overwrite replaces the run in --output-dir and --resume auto continues it: give one of them"
        )

    if resume == "auto":
        if not present:
            plan = RunPlan(new_run_id(), output_dir, total_steps=total_steps)
            plan.notes.append(
                f"--resume auto: no run in {output_dir} yet: starting run {plan.run_id} ({total_steps} steps)"
            )
            return plan
        if folder_run is None:
            raise RunConflictError(
                f"--resume auto: {output_dir} holds files of a run without a run id ({_listing(present)}; written by "
                "an older fastcl, or copied in), so its checkpoints cannot be told from another run's: resume one "
                "explicitly with --resume DIR into a new --output-dir, or replace them with --overwrite"
            )
        _refuse_foreign_checkpoints(output_dir, folder_run)
        chosen = ckpt.resolve_resume("auto", output_dir)
        plan = RunPlan(folder_run, output_dir, total_steps=total_steps, new_run_file=False)
        if chosen is None:  # the run never reached a checkpoint: it starts again, same run, same options
            _check_against_config_file(output_dir, cfg)
            plan.notes.append(
                f"--resume auto: run {folder_run} in {output_dir} has no checkpoint yet: starting it again from step 0"
            )
            return plan
        return _continue(plan, chosen, cfg)

    # an explicit checkpoint folder
    folder = Path(resume).expanduser()
    why = ckpt.problem(folder)
    if why is not None:
        raise ckpt.CheckpointError(f"--resume {resume}: {why}")
    its_run = ckpt.manifest_run_id(folder)
    same_run = folder_run is not None and folder_run == its_run
    if present and same_run and not overwrite:  # the folder's own run, from a checkpoint the user picked
        _refuse_foreign_checkpoints(output_dir, folder_run)
        plan = RunPlan(folder_run, output_dir, total_steps=total_steps, new_run_file=False)
        return _continue(plan, folder, cfg)
    if present and not overwrite:
        raise RunConflictError(
            f"{where} holds {_whose(folder_run)} ({_listing(present)}) and --resume {resume} belongs to "
            f"{_whose(its_run)}: resume into another --output-dir, or replace its files with --overwrite"
        )
    if present and folder.resolve().parent == output_dir.resolve():
        raise SetupError(
            f"--overwrite would remove {folder}, the checkpoint --resume names: choose another --output-dir"
        )
    # DIR's run goes on in a folder of its own (a checkpoint without a run id: as a new run)
    plan = RunPlan(its_run or new_run_id(), output_dir, total_steps=total_steps, replace=present)
    if present:
        plan.notes.append(f"--overwrite: removing {_whose(folder_run)}'s files from {output_dir} ({_listing(present)})")
    return _continue(plan, folder, cfg)


def _continue(plan: RunPlan, folder: Path, cfg) -> RunPlan:
    """Read the checkpoint, refuse one of other options or beyond the last step, say what happens."""
    state = ckpt.read_state(folder)
    ckpt.check_config(folder, state, cfg)
    step = int((state.get("progress") or {}).get("step", 0))
    total = plan.total_steps
    if step > total:
        raise ckpt.CheckpointError(
            f"--resume: {folder} is at step {step}, past the {total} steps of {_steps_phrase(cfg, total)}: "
            "nothing to train from it; raise the step count, or resume an earlier checkpoint with --resume DIR"
        )
    plan.resume_from, plan.resume_state, plan.start_step = folder, state, step
    if step == total:
        plan.finished = True
        plan.notes.append(
            f"run {plan.run_id} is finished: {folder} is at its last step ({step} of {total}); nothing to train"
        )
    else:
        plan.notes.append(f"continuing run {plan.run_id} from {folder} (step {step} of {total})")
    return plan
