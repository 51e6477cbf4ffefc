"""Checkpoints with exact, crash-safe resume: model, optimiser, scheduler, scaler, RNG, progress.

Layout of ``OUTPUT/checkpoint-STEP/``:

``state.pt``       rank 0: model, optimiser, scheduler, scaler, progress, config
``rng-RANK.pt``    each rank's Python/NumPy/torch/CUDA RNG states
``complete.json``  written last, by rank 0 once every rank's files are on disk: the size and
                   SHA-256 of each file. A folder without it, or whose files do not match it,
                   is *incomplete* (killed mid-write, truncated, corrupted) and never resumed.

Every file is written atomically (temporary file, fsync, ``os.replace``, fsync of the
folder; :mod:`fastcl._fsio`), so a kill leaves either the previous version or the new one.
``--resume auto`` takes the newest complete checkpoint, warning about each newer one it
skips and why; an explicit ``--resume FOLDER`` must be complete. The data position needs no
state: the epoch order is a function of (seed, epoch) and the batch index of the step (see
:func:`fastcl.trainers.loop.epoch_order`).

Resuming with options that change the training trajectory (method, batch size, lr, seed,
loss options, ...) is refused with the list of differences unless ``--allow-config-change``
(see :func:`config_differences`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from fastcl._fsio import atomic_write, atomic_write_text, file_digest, fsync_dir
from fastcl.trainers.config import SetupError

PREFIX = "checkpoint-"
MANIFEST = "complete.json"
STATE = "state.pt"
_FORMAT = 1

# Options that may differ between a checkpoint and the run resuming it: where things live,
# how the run reports, and how long it goes on. Every other option (method, batch size, lr,
# seed, precision, data, loss and pooling options, any a recipe adds) must match.
RESUME_MAY_CHANGE = frozenset(
    {
        "output_dir",
        "resume",
        "device",
        "progress",
        "tensorboard",
        "log_steps",
        "eval_steps",
        "eval_batch_size",
        "save_steps",
        "save_total_limit",
        "max_steps",
        "epochs",
        "data_dir",
        "chunk_size",
        "preset",
        "list_presets",
        "allow_config_change",
        "overwrite",
        "command",
    }
)
_PATH_OPTIONS = ("model", "train_file")


class CheckpointError(SetupError):
    """A checkpoint cannot be resumed from; the message names the file and what is wrong."""


def rng_file(rank: int) -> str:
    return f"rng-{rank}.pt"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- writing


def save_checkpoint(
    folder: Path, *, rank: int, model, optimizer, scheduler, scaler, progress: dict, cfg, run_id: str | None = None
) -> dict:
    """Write this rank's files of a checkpoint (call on every rank; rank 0 writes the model).

    ``run_id``: the run it belongs to (:mod:`fastcl.trainers.run`), kept in ``state.pt``.

    Returns ``{file name: {"size", "sha256"}}`` of what was written, for :func:`mark_complete`
    (which rank 0 calls once every rank has returned from here).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0 and (folder / MANIFEST).exists():
        # Rewriting a folder (a run resumed from an earlier step reaches this step again):
        # it is incomplete from now until mark_complete lists the new files.
        (folder / MANIFEST).unlink()
        fsync_dir(folder)
    rng = rng_state()
    written = {rng_file(rank): atomic_write(folder / rng_file(rank), lambda f: torch.save(rng, f))}
    if rank == 0:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "progress": progress,
            "config": vars(cfg),
            "run_id": run_id,
        }
        written[STATE] = atomic_write(folder / STATE, lambda f: torch.save(state, f))
    return written


def mark_complete(
    folder: Path, *, world_size: int, step: int, written: dict | None = None, run_id: str | None = None
) -> None:
    """Rank 0, after every rank's :func:`save_checkpoint`: list the files, making the folder complete.

    ``written``: the digests :func:`save_checkpoint` returned (under DDP, gathered from every
    rank); a file without one is hashed from disk. ``run_id``: the run the checkpoint belongs
    to, recorded in the manifest (:func:`manifest_run_id`).
    """
    folder = Path(folder)
    written = written or {}
    files = {}
    for name in (STATE, *(rng_file(r) for r in range(world_size))):
        if name in written:
            files[name] = written[name]
            continue
        path = folder / name
        if not path.is_file():
            raise RuntimeError(f"{path} was not written; checkpoint {folder} stays incomplete")
        files[name] = file_digest(path)
    manifest = {"format": _FORMAT, "step": step, "world_size": world_size, "run_id": run_id, "files": files}
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


# --------------------------------------------------------------------------- finding


def _step_of(folder: Path) -> int | None:
    suffix = folder.name[len(PREFIX) :]
    return int(suffix) if folder.name.startswith(PREFIX) and suffix.isdigit() else None


def _folders(output_dir: Path) -> list[Path]:
    """Every ``checkpoint-STEP`` folder, complete or not, oldest first."""
    found = [p for p in Path(output_dir).glob(PREFIX + "*") if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=_step_of)


def checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoints marked complete in ``output_dir``, oldest first (files not re-hashed)."""
    return [p for p in _folders(output_dir) if (p / MANIFEST).is_file()]


def manifest_run_id(folder: Path) -> str | None:
    """The run id recorded in ``folder``'s ``complete.json`` (None: written before checkpoints
    carried one). Raises :class:`CheckpointError` when the manifest is missing or unreadable."""
    path = Path(folder) / MANIFEST
    try:
        run_id = json.loads(path.read_text()).get("run_id")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is missing, unreadable or malformed: {e}") from e
    return run_id if isinstance(run_id, str) and run_id else None


def problem(folder: Path) -> str | None:
    """Why ``folder`` is not a complete, intact checkpoint (naming the file), or ``None``.

    Checks the manifest, then each file it lists: present, of the recorded size, and of the
    recorded SHA-256 (reads every byte once).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder} does not exist or is not a directory"
    manifest = folder / MANIFEST
    if not manifest.is_file():
        where = f" ({STATE} is there)" if (folder / STATE).exists() else ""
        return (
            f"{manifest} missing{where}: the checkpoint was interrupted before all its files were "
            "written, or comes from a fastcl without complete-checkpoint markers"
        )
    try:
        info = json.loads(manifest.read_text())
        files = info["files"]
        if not isinstance(files, dict) or STATE not in files:
            raise ValueError(f"no entry for {STATE}")
        expected = {name: (int(d["size"]), str(d["sha256"])) for name, d in files.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{manifest} is unreadable or malformed: {e}"
    for name, (size, sha) in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{path} missing (listed in {MANIFEST})"
        actual = path.stat().st_size
        if actual != size:
            what = "truncated" if actual < size else "longer than written"
            return f"{path} is {what}: {actual} bytes, {size} expected"
        if file_digest(path)["sha256"] != sha:
            return f"{path} is corrupt: its SHA-256 differs from the one recorded in {MANIFEST}"
    return None


def resolve_resume(resume: str | None, output_dir: Path) -> Path | None:
    """``None``, ``"auto"`` (newest complete checkpoint in ``output_dir``, or None) or a folder.

    ``auto`` skips incomplete or damaged newer checkpoints with a ``RuntimeWarning`` naming the
    file and the problem; if checkpoint folders exist but none is intact, raises
    :class:`CheckpointError` listing each (starting over silently would discard them).
    """
    if resume is None:
        return None
    if resume == "auto":
        skipped = []
        for folder in reversed(_folders(output_dir)):
            why = problem(folder)
            if why is None:
                for reason in skipped:
                    warnings.warn(
                        f"--resume auto: skipping {reason}; resuming from {folder}", RuntimeWarning, stacklevel=2
                    )
                return folder
            skipped.append(why)
        if skipped:
            raise CheckpointError(
                f"--resume auto: no complete checkpoint in {output_dir}: "
                + "; ".join(skipped)
                + ". Move these folders away, or start over with --overwrite."
            )
        return None
    folder = Path(resume).expanduser()
    why = problem(folder)
    if why is not None:
        raise CheckpointError(f"--resume {resume}: {why}")
    return folder


# --------------------------------------------------------------------------- reading


def _load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a damaged file surfaces as many different exception types
        raise CheckpointError(f"{path} cannot be loaded: {type(e).__name__}: {e}") from e


def read_state(folder: Path) -> dict:
    """The contents of ``state.pt`` (on the CPU)."""
    return _load(Path(folder) / STATE)


def _normalise(key: str, value):
    if key in _PATH_OPTIONS and value is not None:
        return os.path.abspath(os.path.expanduser(str(value)))
    return value


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def config_differences(saved: dict, cfg) -> list[str]:
    """``--option: checkpoint X, now Y`` for each trajectory-changing option that differs.

    Options in :data:`RESUME_MAY_CHANGE` are not compared; nor are options one side does not
    have (added or removed by a different fastcl version).
    """
    now = vars(cfg)
    out = []
    for key in sorted(set(saved) & set(now) - RESUME_MAY_CHANGE):
        old, new = _normalise(key, saved[key]), _normalise(key, now[key])
        if old != new:
            out.append(f"{_flag(key)}: checkpoint {saved[key]!r}, now {now[key]!r}")
    return out


def check_config(folder: Path, state: dict, cfg) -> list[str]:
    """Refuse (``CheckpointError``) to resume ``state`` under different options unless
    ``cfg.allow_config_change``; then the differences are returned and warned about."""
    diffs = config_differences(state.get("config") or {}, cfg)
    if not diffs:
        return []
    listing = "; ".join(diffs)
    if not getattr(cfg, "allow_config_change", False):
        raise CheckpointError(
            f"--resume: {folder} was trained with different options ({listing}); resume with the "
            "checkpoint's values, or pass --allow-config-change to continue with the new ones"
        )
    warnings.warn(
        f"--allow-config-change: resuming {folder} with changed options: {listing}", RuntimeWarning, stacklevel=2
    )
    return diffs


def _rescale_lr(optimizer, scheduler, ratio: float) -> None:
    """Make a changed ``--lr`` take effect: the optimiser and scheduler states carry the old one."""
    for group in optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]


def apply_state(state: dict, *, model, optimizer, scheduler, scaler, cfg=None) -> dict:
    """Restore everything but the RNG (restore it last with :func:`load_rng`); returns progress.

    With ``cfg`` whose ``lr`` differs from the checkpoint's (``--allow-config-change``), every
    learning rate is rescaled by the ratio so that the new ``--lr`` applies.
    """
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    old_lr = (state.get("config") or {}).get("lr")
    if cfg is not None and old_lr and cfg.lr != old_lr:
        _rescale_lr(optimizer, scheduler, cfg.lr / old_lr)
    return state["progress"]


def load_checkpoint(folder: Path, *, rank: int, model, optimizer, scheduler, scaler) -> dict:
    """:func:`read_state` + :func:`apply_state` (no config check); returns progress."""
    return apply_state(read_state(folder), model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)


def load_rng(folder: Path, rank: int) -> None:
    path = Path(folder) / rng_file(rank)
    if not path.is_file():
        raise CheckpointError(f"{path} missing: the checkpoint was written by fewer ranks than this run has")
    set_rng_state(_load(path))


def prune(output_dir: Path, keep: int, run_id: str | None = None) -> None:
    """Keep the last ``keep`` complete checkpoints (``keep=0`` keeps all); delete every
    checkpoint folder older than those, complete or not. With ``run_id``, only that run's
    complete checkpoints count and a complete checkpoint of another run is never deleted."""
    if keep <= 0:
        return
    complete = checkpoints(output_dir)
    if run_id is not None:
        complete = [c for c in complete if manifest_run_id(c) == run_id]
    if len(complete) <= keep:
        return
    oldest_kept = _step_of(complete[-keep])
    for folder in _folders(output_dir):
        if _step_of(folder) >= oldest_kept:
            continue
        if run_id is not None and (folder / MANIFEST).is_file() and manifest_run_id(folder) != run_id:
            continue
        shutil.rmtree(folder, ignore_errors=True)
