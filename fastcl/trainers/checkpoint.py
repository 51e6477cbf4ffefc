"""Checkpoints with exact resume: model, optimiser, scheduler, scaler, RNG states, progress.

Layout: ``OUTPUT/checkpoint-STEP/state.pt`` (rank 0: model, optimiser, scheduler, scaler,
progress, config) and ``rng-RANK.pt`` (each rank's Python/NumPy/torch/CUDA RNG states).
The data position needs no state: the epoch order is a function of (seed, epoch) and the
batch index of the step (see :func:`fastcl.trainers.loop.epoch_order`).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

PREFIX = "checkpoint-"


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


def save_checkpoint(folder: Path, *, rank: int, model, optimizer, scheduler, scaler, progress: dict, cfg) -> None:
    """Write this rank's part of a checkpoint (call on every rank; rank 0 writes the model)."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), folder / f"rng-{rank}.pt")
    if rank == 0:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "progress": progress,
            "config": vars(cfg),
        }
        tmp = folder / "state.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(folder / "state.pt")  # a checkpoint without state.pt is incomplete


def checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    found = [p for p in Path(output_dir).glob(PREFIX + "*") if (p / "state.pt").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def resolve_resume(resume: str | None, output_dir: Path) -> Path | None:
    """``None``, ``"auto"`` (latest complete checkpoint in ``output_dir``, or None) or a folder."""
    if resume is None:
        return None
    if resume == "auto":
        found = checkpoints(output_dir)
        return found[-1] if found else None
    folder = Path(resume)
    if not (folder / "state.pt").is_file():
        raise FileNotFoundError(f"--resume {resume}: no checkpoint there (expected {folder / 'state.pt'})")
    return folder


def load_checkpoint(folder: Path, *, rank: int, model, optimizer, scheduler, scaler) -> dict:
    """Restore everything but the RNG (restore it last with :func:`load_rng`); returns progress."""
    state = torch.load(folder / "state.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    return state["progress"]


def load_rng(folder: Path, rank: int) -> None:
    path = folder / f"rng-{rank}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: the checkpoint was written by fewer ranks than this run has")
    set_rng_state(torch.load(path, map_location="cpu", weights_only=False))


def prune(output_dir: Path, keep: int) -> None:
    """Delete all but the last ``keep`` checkpoints (``keep=0`` keeps all)."""
    if keep <= 0:
        return
    for old in checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
