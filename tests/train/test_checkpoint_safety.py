"""Crash-safe checkpoints: atomic files, a completeness marker, fallback to the last intact one.

These tests build checkpoints of a tiny ``nn.Linear`` directly with
:mod:`fastcl.trainers.checkpoint` (no data, no training); the end-to-end resume through the
training loop is in tests/train/test_train_resume.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import warnings

import pytest
import torch

from fastcl._fsio import atomic_write
from fastcl.trainers import checkpoint as ckpt

WORLD = 2  # two ranks' RNG files, written from this one process


def _cfg(**over):
    base = dict(method="supmpn", batch_size=8, lr=1e-3, seed=1, output_dir="out", max_steps=10, model="m")
    return argparse.Namespace(**{**base, **over})


def _write(out, step, world=WORLD, mark=True):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    folder = out / f"checkpoint-{step}"
    written = {}
    for rank in range(world):
        written.update(
            ckpt.save_checkpoint(
                folder,
                rank=rank,
                model=model,
                optimizer=opt,
                scheduler=None,
                scaler=None,
                progress={"step": step},
                cfg=_cfg(),
            )
        )
    if mark:
        ckpt.mark_complete(folder, world_size=world, step=step, written=written)
    return folder


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path):  # same size, one byte changed: only the hash can tell
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": _truncate, "corrupted": _flip, "deleted": os.remove}
EXPECTED = {"truncated": "is truncated", "corrupted": "is corrupt", "deleted": "missing"}


def test_manifest_lists_every_file_with_size_and_hash(tmp_path):
    folder = _write(tmp_path, 2)
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())
    assert manifest["step"] == 2 and manifest["world_size"] == WORLD
    assert set(manifest["files"]) == {"state.pt", "rng-0.pt", "rng-1.pt"}
    for name, d in manifest["files"].items():
        assert d["size"] == (folder / name).stat().st_size and len(d["sha256"]) == 64
    assert ckpt.problem(folder) is None
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], "temporary files left behind"


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("name", ["state.pt", "rng-0.pt", "rng-1.pt"])
def test_auto_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, name, damage):
    _write(tmp_path, 2)
    newest = _write(tmp_path, 4)
    DAMAGE[damage](newest / name)
    with pytest.warns(RuntimeWarning) as record:
        chosen = ckpt.resolve_resume("auto", tmp_path)
    assert chosen == tmp_path / "checkpoint-2"
    message = str(record[0].message)
    assert str(newest / name) in message and EXPECTED[damage] in message, message
    # an explicit --resume of the damaged folder is refused with the same diagnosis
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(newest / name))):
        ckpt.resolve_resume(str(newest), tmp_path)


def test_partial_checkpoint_without_marker_is_skipped(tmp_path):
    """Killed after writing every file but before the marker: incomplete, whatever is inside."""
    _write(tmp_path, 2)
    _write(tmp_path, 4, mark=False)
    with pytest.warns(RuntimeWarning, match=r"checkpoint-4/complete\.json missing"):
        assert ckpt.resolve_resume("auto", tmp_path) == tmp_path / "checkpoint-2"


def test_malformed_marker_is_reported(tmp_path):
    _write(tmp_path, 2)
    (tmp_path / "checkpoint-2" / ckpt.MANIFEST).write_text('{"files": ')
    with pytest.raises(ckpt.CheckpointError, match=r"complete\.json is unreadable"):
        ckpt.resolve_resume("auto", tmp_path)


def test_no_intact_checkpoint_names_each_file_and_problem(tmp_path):
    _truncate(_write(tmp_path, 2) / "state.pt")
    _flip(_write(tmp_path, 4) / "rng-1.pt")
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.resolve_resume("auto", tmp_path)
    text = str(e.value)
    assert "no complete checkpoint" in text
    assert f"{tmp_path / 'checkpoint-2' / 'state.pt'} is truncated" in text
    assert f"{tmp_path / 'checkpoint-4' / 'rng-1.pt'} is corrupt" in text


def test_auto_without_any_checkpoint_starts_fresh(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.resolve_resume("auto", tmp_path) is None
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.resolve_resume(str(tmp_path / "checkpoint-9"), tmp_path)


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """Rewriting a checkpoint folder (a resumed run reaches the step again) and dying in the
    middle of torch.save: the old file is intact, no temporary file remains, and the folder is
    no longer marked complete (its files may now be a mix of two runs)."""
    folder = _write(tmp_path, 2)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        f.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path, 2)
    monkeypatch.setattr(torch, "save", real_save)
    for name in ("state.pt", "rng-0.pt", "rng-1.pt"):
        assert (folder / name).read_bytes() == before[name], name
    assert sorted(p.name for p in folder.iterdir()) == ["rng-0.pt", "rng-1.pt", "state.pt"]
    assert "complete.json missing" in ckpt.problem(folder)


def test_atomic_write_reports_size_and_hash(tmp_path):
    import hashlib

    d = atomic_write(tmp_path / "x.bin", lambda f: f.write(b"hello"))
    assert d == {"size": 5, "sha256": hashlib.sha256(b"hello").hexdigest()}


def test_prune_keeps_the_last_complete_and_drops_older_incomplete(tmp_path):
    _write(tmp_path, 2)
    _write(tmp_path, 4, mark=False)  # older than the two kept: removed
    _write(tmp_path, 6)
    _write(tmp_path, 8)
    _write(tmp_path, 10, mark=False)  # newer than the kept ones (being written): left alone
    ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-6", "checkpoint-8"]


def test_config_differences_name_each_option():
    saved = vars(_cfg(lr=1e-3, seed=1, batch_size=8, method="supmpn", device="cpu", model="./m"))
    now = _cfg(
        lr=2e-3, seed=2, batch_size=16, method="simcse-sup", device="cuda", max_steps=99, model=os.path.abspath("m")
    )
    diffs = ckpt.config_differences(saved, now)
    assert [d.split(":")[0] for d in diffs] == ["--batch-size", "--lr", "--method", "--seed"]
    assert "--lr: checkpoint 0.001, now 0.002" in diffs
