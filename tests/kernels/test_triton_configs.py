"""The Triton config table: one place, read once, written only by the tuning command.

No GPU and no interpreter needed: these are the table's plumbing (files, validation,
lookups, overrides) and the planners that read it (forward splits, dS chunks).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from benchmarks.triton_tools import tune  # noqa: E402
from fastcl import config  # noqa: E402
from fastcl.kernels import configs, plan  # noqa: E402


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "table.json"
    with config.override(triton={"table": str(path)}):
        yield path


def test_every_role_has_a_default_for_every_arch_and_dtype_class():
    for role in configs.ROLES:
        for arch in configs.ARCHS:
            for dclass in configs.DCLASSES:
                for d in (64, 768):
                    c = configs.lookup(role, arch, dclass, d)
                    assert c.dclass == dclass and c.num_warps in (1, 2, 4, 8) and c.source == "default"


def test_a_tuned_table_overrides_the_default_and_round_trips(table):
    want = configs.cfg(4, 3, 2, BM=64, BN=128, BK=32, GROUP_M=8)
    k = configs.key("ds", "sm90", "16", "large")
    configs.write_table(table, {k: want}, {"device": "test"})
    assert json.loads(table.read_text())["note"] == {"device": "test"}
    configs.reload()  # the file was read (empty) by an earlier lookup: read it again
    got = configs.lookup("ds", "sm90", "16", 768)
    assert (got.meta, got.num_warps, got.num_stages, got.occupancy) == (want.meta, 4, 3, 2)
    assert got.source.endswith(k)
    assert configs.lookup("ds", "sm90", "16", 128).source == "default"  # the small d class is untouched
    assert configs.lookup("ds", "sm80", "16", 768).source == "default"


@pytest.mark.parametrize(
    "body, match",
    [
        ("not json", "cannot read"),
        ('{"cfgs": {}}', "expected"),
        ('{"configs": {"ds/sm90/16": {"meta": {"BM": 64}}}}', "bad key"),
        ('{"configs": {"ds/sm90/16/large": {"meta": {"BM": 48}}}}', "power of two"),
        ('{"configs": {"ds/sm90/16/large": {"meta": {"BM": 64}, "num_warps": 3}}}', "out of range"),
    ],
)
def test_a_malformed_table_is_an_error_never_ignored(table, body, match):
    table.write_text(body)
    configs.reload()
    with pytest.raises(ValueError, match=match):
        configs.lookup("ds", "sm90", "16", 768)


def test_override_applies_inside_the_block_only():
    k = configs.key("mm", "sm80", "16", "large")
    forced = configs.cfg(4, 2, BM=64, BN=64, BK=32, GROUP_M=8)
    before = configs.lookup("mm", "sm80", "16", 768)
    with configs.override({k: forced}):
        assert configs.lookup("mm", "sm80", "16", 768).meta == forced.meta
    assert configs.lookup("mm", "sm80", "16", 768) == before


def test_candidates_start_with_the_current_entry_and_are_at_most_eight():
    for role in ("fwd", "ds", "mm", "mm_split"):
        for arch in ("sm80", "sm90"):
            cands = configs.candidates(role, arch, "16")
            assert cands[0] == configs._default(role, arch, "16", "large")
            assert 2 <= len(cands) <= 8 and len(set(cands)) == len(cands)


def test_the_tuner_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit) as exc:
        tune.main([])
    assert exc.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_forward_splits_fill_the_device_in_whole_waves():
    # SupMPN B=4096 (32 row tiles of 128), N=40960 (320 column tiles of 128), 132 SMs
    splits, per = plan.forward_splits(32, 320, 132, "sm90")
    assert splits * per >= 320 and plan.cdiv(320, per) == splits
    waves = plan.cdiv(32 * splits, 132)
    assert waves * (per + 1) <= plan.cdiv(32, 132) * 321  # never worse than one split
    assert plan.forward_splits(1, 1, 132, "sm90") == (1, 1)
    assert plan.forward_splits(4, 0, 132, "sm90")[0] == 0
    s, p = plan.forward_splits(2, 1000, 132, "sm90")
    assert s >= 60  # two row tiles alone would leave most SMs idle


@pytest.mark.parametrize(
    "rows, n, d, elt", [(4096, 20480, 768, 2), (16384, 16384, 768, 2), (4096, 20480, 768, 4), (7, 100, 16, 2)]
)
def test_chunks_are_even_aligned_and_bounded(rows, n, d, elt):
    align = 128
    w = plan.chunk_width(rows, n, d, elt, align, "sm90")
    assert w % align == 0
    chunks = plan.chunks((n, 0), (w, align))
    assert sum(c1 - c0 for _, c0, c1 in chunks) == n
    assert rows * w * elt <= max(plan.ds_chunk_bytes(), rows * plan.MIN_CHUNK * elt) or len(chunks) == 1
    assert len(chunks) == plan.cdiv(n, w)
    # even: the last chunk is not a sliver (at most one alignment step short of the others)
    if len(chunks) > 1:
        assert chunks[-1][2] - chunks[-1][1] > w - align * len(chunks)
