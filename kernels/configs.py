"""The one place for the Triton kernels' launch configurations.

A configuration is chosen per **(role, arch, dtype class, d class)**:

* role: ``rows`` (norm pre-pass), ``head`` (combine + own logits + loss head), ``fwd`` /
  ``ds`` (the logit-tile sweeps), ``mm`` (the backward GEMM), ``prefix_fwd`` / ``prefix_ds``
  (their Matryoshka variants), and each sweep's ``<sweep>_ext`` (with the sigmoid reduction
  or a self filter: a longer epilogue) and ``<sweep>_guide`` (with the guide filter: a second
  dot tile per tile);
* arch: ``sm80`` (A100 and other sm_8x), ``sm90`` (H100/H200), ``interp`` (the Triton
  interpreter: tiny tiles so that small test shapes cross every edge);
* dtype class: ``16`` (bf16/fp16), ``32``, ``64``;
* d class: ``small`` (d <= 256) or ``large``.

Lookups read, in order: the tuned table of the arch (``kernels/tuned/<arch>.json``, written by
``python -m benchmarks.triton_tools.tune`` on a GPU, or the file of ``fastcl.config``'s ``triton.table``,
``FASTCL_TRITON_TABLE``), then the built-in defaults below. Both are read once, at the first lookup (:func:`reload` reads
them again). Nothing here ever benchmarks: a training step launches exactly the table's
config, so a new batch size never retunes and a step can be captured in a CUDA graph.

Why each default (compile facts of ``python -m benchmarks.triton_tools.aot``; docs/triton.md): the
logit-tile and GEMM kernels keep an fp32 ``[BM, BN]`` accumulator plus the epilogue's
tiles in registers, so a thread owns at most ~64 accumulator elements without spilling
(128x128 on 8 warps on sm_90, whose wgmma accumulators leave room; 128x64 on sm_80). fp32
inputs run 3xTF32 (three MMAs per product) with ``BK=16``; fp64 gets 32-row tiles.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

SWEEPS = ("fwd", "ds", "prefix_fwd", "prefix_ds")  # the logit-tile sweeps, each with extension roles
ROLES = ("rows", "head", "fwd", "ds", "mm", "mm_split", "prefix_fwd", "prefix_ds") + tuple(
    f"{sweep}_{ext}" for ext in ("ext", "guide") for sweep in SWEEPS
)
ARCHS = ("sm80", "sm90", "interp")
DCLASSES = ("16", "32", "64")
DSIZES = ("small", "large")
TUNED_DIR = Path(__file__).resolve().parent / "tuned"


@dataclass(frozen=True)
class Config:
    """Block sizes and other constexprs (``meta``), warps and pipeline stages of one launch;
    ``occupancy``: programs per SM a persistent grid is sized for (registers and shared
    memory of this config allow that many); ``dclass``: the dtype class it was looked up for."""

    meta: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 2
    occupancy: int = 1
    dclass: str = "16"
    source: str = field(default="default", compare=False)

    @functools.cached_property
    def kwargs(self) -> dict[str, int]:
        return dict(self.meta)

    def __getitem__(self, name: str) -> int:
        return self.kwargs[name]

    def describe(self) -> str:
        sizes = " ".join(f"{k}={v}" for k, v in self.meta)
        return f"{sizes} w{self.num_warps} s{self.num_stages} x{self.occupancy}"

    def to_json(self) -> dict:
        return {
            "meta": dict(self.meta),
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "occupancy": self.occupancy,
        }

    @staticmethod
    def from_json(obj: dict, source: str) -> Config:
        meta = obj["meta"]
        if not isinstance(meta, dict) or not all(isinstance(v, int) and v > 0 for v in meta.values()):
            raise ValueError(f"{source}: 'meta' must map block-size names to positive integers, got {meta!r}")
        cfg = Config(
            tuple(sorted(meta.items())),
            int(obj.get("num_warps", 4)),
            int(obj.get("num_stages", 2)),
            int(obj.get("occupancy", 1)),
            source=source,
        )
        for name in ("BM", "BN", "BK", "BR", "BD"):
            v = meta.get(name)
            if v is not None and (v < 16 or v & (v - 1)):
                raise ValueError(f"{source}: {name}={v} must be a power of two >= 16")
        if cfg.num_warps not in (1, 2, 4, 8, 16) or not 1 <= cfg.num_stages <= 8 or not 1 <= cfg.occupancy <= 8:
            raise ValueError(f"{source}: num_warps/num_stages/occupancy out of range: {obj!r}")
        return cfg


def cfg(num_warps: int = 4, num_stages: int = 2, occupancy: int = 1, **meta: int) -> Config:
    return Config(tuple(sorted(meta.items())), num_warps, num_stages, occupancy)


def d_class(d: int) -> str:
    return "small" if d <= 256 else "large"


# ---------------------------------------------------------------------------------------
# built-in defaults: {role: {arch: {dclass: config or {dsize: config}}}}
# ---------------------------------------------------------------------------------------

# the Matryoshka pre-pass snapshots per prefix: BD=128 spilled 44-80 B there
_ROWS = {"16": cfg(4, 1, BR=32, BD=64)}
# the head streams each anchor's P own positives (up to MAX_OWN slots, padded to a power
# of two) beside its row: narrower feature chunks than the pre-pass
_HEAD = {"16": cfg(4, 1, BR=16, BD=64), "64": cfg(4, 1, BR=16, BD=32)}
_INTERP_ROWS = {"16": cfg(BR=16, BD=64)}
# interpreter tiles: 16 wide so small test shapes cross tile edges; BK=32 halves the
# (Python-speed) feature loop, d > 32 still crosses its edge
_INTERP_TILE = {"16": cfg(BM=16, BN=16, BK=32, GROUP_M=2)}

DEFAULTS: dict[str, dict[str, dict]] = {
    "rows": {"sm80": _ROWS, "sm90": _ROWS, "interp": _INTERP_ROWS},
    "head": {"sm80": _HEAD, "sm90": _HEAD, "interp": _INTERP_ROWS},
    "fwd": {
        "sm80": {
            "16": cfg(8, 4, BM=128, BN=64, BK=32),
            "32": cfg(4, 3, BM=64, BN=64, BK=16),
            "64": cfg(4, 2, BM=32, BN=64, BK=16),
        },
        "sm90": {
            "16": cfg(8, 3, BM=128, BN=128, BK=64),
            "32": cfg(4, 3, BM=64, BN=64, BK=16),
            "64": cfg(4, 2, BM=32, BN=64, BK=16),
        },
        "interp": _INTERP_TILE,
    },
    "ds": {
        "sm80": {
            "16": cfg(8, 4, 1, BM=128, BN=64, BK=32, GROUP_M=8),
            "32": cfg(4, 3, 2, BM=64, BN=64, BK=16, GROUP_M=8),
            "64": cfg(4, 2, 2, BM=32, BN=64, BK=16, GROUP_M=8),
        },
        "sm90": {
            "16": cfg(8, 3, 1, BM=128, BN=64, BK=64, GROUP_M=8),
            "32": cfg(4, 3, 2, BM=64, BN=64, BK=16, GROUP_M=8),
            "64": cfg(4, 2, 2, BM=32, BN=64, BK=16, GROUP_M=8),
        },
        "interp": _INTERP_TILE,
    },
    "mm": {
        "sm80": {
            "16": cfg(8, 4, 1, BM=128, BN=64, BK=32, GROUP_M=8),
            "32": cfg(4, 3, 2, BM=64, BN=64, BK=16, GROUP_M=8),
            "64": cfg(4, 2, 2, BM=32, BN=32, BK=16, GROUP_M=8),  # 32 x 64 spilled 8 B
        },
        "sm90": {
            # 128 x 128 (4 stages, 128 KiB) spilled 192-392 B with Triton 3.6 at odd row counts
            "16": cfg(8, 4, 1, BM=128, BN=64, BK=64, GROUP_M=8),
            "32": cfg(4, 3, 2, BM=64, BN=64, BK=16, GROUP_M=8),
            "64": cfg(4, 2, 2, BM=32, BN=32, BK=16, GROUP_M=8),
        },
        # wide along d: fewer Python-speed programs, still crossing d > 64
        "interp": {"16": cfg(BM=16, BN=64, BK=16, GROUP_M=2)},
    },
    # fp32 dS beside 16-bit inputs: two MMAs and the split in registers (128x128 spilled 32 B)
    "mm_split": {
        "sm80": {"16": cfg(8, 4, 1, BM=128, BN=64, BK=32, GROUP_M=8)},
        "sm90": {"16": cfg(8, 4, 1, BM=128, BN=64, BK=64, GROUP_M=8)},
        "interp": {"16": cfg(BM=16, BN=64, BK=16, GROUP_M=2)},
    },
    # Matryoshka: the forward keeps K online-LSE states ([8, BM] tiles) beside the tile, the
    # ds kernel one more [BM, BN] tile live through each prefix's epilogue
    "prefix_fwd": {
        "sm80": {
            "16": cfg(8, 4, BM=128, BN=64, BK=32),
            "32": cfg(4, 3, BM=32, BN=64, BK=16),
            "64": cfg(4, 2, BM=32, BN=32, BK=16),
        },
        "sm90": {
            "16": cfg(8, 4, BM=128, BN=64, BK=32),
            "32": cfg(4, 3, BM=32, BN=64, BK=16),
            "64": cfg(4, 2, BM=32, BN=32, BK=16),
        },
        "interp": _INTERP_TILE,
    },
    "prefix_ds": {
        "sm80": {
            "16": cfg(8, 4, 1, BM=64, BN=64, BK=32, GROUP_M=8),
            "32": cfg(4, 3, 2, BM=32, BN=64, BK=16, GROUP_M=8),
            "64": cfg(4, 2, 2, BM=32, BN=32, BK=16, GROUP_M=8),
        },
        "sm90": {
            "16": cfg(8, 4, 1, BM=64, BN=64, BK=32, GROUP_M=8),
            "32": cfg(4, 3, 2, BM=32, BN=64, BK=16, GROUP_M=8),
            "64": cfg(4, 1, 2, BM=32, BN=32, BK=16, GROUP_M=8),  # two stages spilled 8 B
        },
        "interp": _INTERP_TILE,
    },
}


# The extensions' sweeps (``<sweep>_ext``: the sigmoid reduction or a self filter, a longer
# epilogue; ``<sweep>_guide``: the guide filter's second dot tile) take the plain sweep's config
# except where that spilled (compile facts of python -m benchmarks.triton_tools.aot, both archs, both
# Triton versions; the same entry for sm_80 and sm_90 unless the arch is named):
_BOTH = {
    # the K row-sum states beside the sigmoid's terms: 92-296 B at 128 x 64 (16-bit), 36-40 B (fp64)
    "prefix_fwd_ext": {"16": cfg(8, 4, BM=64, BN=64, BK=32), "64": cfg(4, 1, BM=16, BN=16, BK=16)},
    "prefix_ds_ext": {"32": cfg(4, 3, 2, BM=64, BN=32, BK=16, GROUP_M=8)},
    # the guide's tile: 8-144 B at 128 x 64 (16-bit), 16-148 B at 64 x 64 (fp32)
    "fwd_guide": {"32": cfg(4, 3, BM=64, BN=32, BK=16), "64": cfg(4, 2, BM=32, BN=32, BK=16)},
    "ds_guide": {
        "32": cfg(4, 3, 2, BM=64, BN=32, BK=16, GROUP_M=8),
        "64": cfg(4, 1, 2, BM=32, BN=32, BK=16, GROUP_M=8),
    },
    "prefix_fwd_guide": {"16": cfg(8, 4, BM=64, BN=64, BK=32), "64": cfg(4, 2, BM=16, BN=32, BK=16)},
    "prefix_ds_guide": {
        "32": cfg(4, 3, 2, BM=32, BN=32, BK=16, GROUP_M=8),
        "64": cfg(4, 1, 2, BM=32, BN=16, BK=16, GROUP_M=8),
    },
}
EXTENSION_CONFIGS: dict[str, dict[str, dict[str, Config]]] = {
    role: {arch: dict(by_class) for arch in ("sm80", "sm90")} for role, by_class in _BOTH.items()
}
# 16-bit sm_90 128 x 128: 2.7-7.5 KiB (128 x 64 x 64: 104 B with Triton 3.6); fp64 32 x 64 (its exp
# and log): 0.5-1.5 KiB; fp32 sm_80 64 x 64: 12 B
EXTENSION_CONFIGS["fwd_ext"] = {
    "sm80": {"32": cfg(4, 3, BM=32, BN=64, BK=16), "64": cfg(4, 2, BM=32, BN=32, BK=16)},
    "sm90": {"16": cfg(8, 3, BM=128, BN=64, BK=32), "64": cfg(4, 2, BM=32, BN=32, BK=16)},
}
EXTENSION_CONFIGS["fwd_guide"]["sm80"]["16"] = cfg(8, 4, BM=64, BN=64, BK=32)  # 128 x 64: 32-112 B (Triton 3.6)
EXTENSION_CONFIGS["fwd_guide"]["sm90"]["16"] = cfg(8, 3, BM=64, BN=64, BK=64)
EXTENSION_CONFIGS["ds_guide"]["sm90"]["16"] = cfg(8, 3, 1, BM=64, BN=64, BK=64, GROUP_M=8)  # 128 x 64: 8 B
for _sweep in SWEEPS:
    for _ext in ("ext", "guide"):
        _over = EXTENSION_CONFIGS.get(f"{_sweep}_{_ext}", {})
        DEFAULTS[f"{_sweep}_{_ext}"] = {arch: {**DEFAULTS[_sweep][arch], **_over.get(arch, {})} for arch in ARCHS}


def _default(role: str, arch: str, dclass: str, dsize: str) -> Config:
    by_class = DEFAULTS[role][arch]
    entry = by_class.get(dclass, by_class["16"])
    return entry[dsize] if isinstance(entry, dict) else entry


# ---------------------------------------------------------------------------------------
# the tuned tables
# ---------------------------------------------------------------------------------------


def key(role: str, arch: str, dclass: str, dsize: str) -> str:
    return f"{role}/{arch}/{dclass}/{dsize}"


def table_path(arch: str) -> Path:
    """Where the tuned table of ``arch`` is read from (``fastcl.config``'s ``triton.table``,
    ``FASTCL_TRITON_TABLE``: a file holding the entries of any arch)."""
    from fastcl import config

    table = config.get().triton.table
    return Path(table) if table else TUNED_DIR / f"{arch}.json"


def read_table(path: Path) -> dict[str, Config]:
    """``{key: Config}`` from a tuned-table file; a malformed file is an error, never ignored."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the Triton config table {path}: {exc}") from exc
    entries = raw.get("configs") if isinstance(raw, dict) else None
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: expected {{'configs': {{key: config}}}}")
    out = {}
    for k, obj in entries.items():
        parts = k.split("/")
        if (
            len(parts) != 4
            or parts[0] not in ROLES
            or parts[1] not in ARCHS
            or parts[2] not in DCLASSES
            or parts[3] not in DSIZES
        ):
            raise ValueError(f"{path}: bad key {k!r} (role/arch/dclass/dsize)")
        out[k] = Config.from_json(obj, f"{path}:{k}")
    return out


def write_table(path: Path, configs: dict[str, Config], note: dict | None = None) -> None:
    """Write ``configs`` (keys as :func:`key`) with a provenance ``note`` (device, versions)."""
    body = {"note": note or {}, "configs": {k: c.to_json() for k, c in sorted(configs.items())}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1) + "\n")


_LOCK = threading.Lock()
_TUNED: dict[tuple[str, Path], dict[str, Config]] = {}  # (arch, file) -> entries, read once
_CACHE: dict[tuple, Config] = {}
_CACHE_PATH: dict[str, Path] = {}  # arch -> the table file _CACHE's entries came from


def reload() -> None:
    """Forget the tables read so far: the next lookup reads the files again."""
    with _LOCK:
        _TUNED.clear()
        _CACHE.clear()
        _CACHE_PATH.clear()


def _tuned(arch: str, path: Path) -> dict[str, Config]:
    if (arch, path) not in _TUNED:
        _TUNED[(arch, path)] = read_table(path) if arch != "interp" and path.is_file() else {}
    return _TUNED[(arch, path)]


def lookup(role: str, arch: str, dclass: str, d: int) -> Config:
    """The config of ``role`` for this arch, dtype class and feature dimension."""
    k = (role, arch, dclass, d_class(d))
    hit = _CACHE.get(k)
    path = table_path(arch)
    if hit is None or _CACHE_PATH.get(arch) != path:
        with _LOCK:
            if _CACHE_PATH.get(arch) != path:  # another table: forget what was looked up
                for old in [c for c in _CACHE if c[1] == arch]:
                    del _CACHE[old]
                _CACHE_PATH[arch] = path
            tuned = _tuned(arch, path).get(key(*k))
            hit = replace(tuned or _default(*k), dclass=dclass)
            _CACHE[k] = hit
    return hit


def candidates(role: str, arch: str, dclass: str) -> list[Config]:
    """The configs ``python -m benchmarks.triton_tools.tune`` times for a role (the default first; at
    most eight): tile shapes whose compile facts allow them on this arch."""
    base = _default(role, arch, dclass, "large")
    if role in ("rows", "head") or dclass != "16" or arch == "interp":
        return [base]
    extra = {"GROUP_M": 8} if role in ("ds", "mm", "mm_split", "prefix_ds") else {}
    if arch == "sm90":
        shapes = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 8, 4), (64, 128, 64, 4, 4),
                  (128, 128, 32, 8, 4), (64, 64, 64, 4, 4), (128, 256, 64, 8, 3)]  # fmt: skip
    else:
        shapes = [(128, 64, 32, 8, 4), (128, 64, 64, 8, 3), (64, 64, 64, 4, 3), (64, 64, 32, 4, 4),
                  (128, 128, 32, 8, 3), (64, 128, 32, 4, 4)]  # fmt: skip
    out = [base]
    for bm, bn, bk, w, s in shapes:
        c = cfg(w, s, base.occupancy, BM=bm, BN=bn, BK=bk, **extra)
        if c not in out:
            out.append(c)
    return out[:8]


class override:
    """Use ``entries`` (``{key(...): Config}``) instead of the tables inside a ``with`` block
    (the tuner times candidates this way; tests use it to force a config)."""

    def __init__(self, entries: dict[str, Config]):
        self.entries = entries

    def __enter__(self):
        with _LOCK:
            self.saved = dict(_CACHE)
            for k, c in self.entries.items():
                role, arch, dclass, dsize = k.split("/")
                _CACHE[(role, arch, dclass, dsize)] = replace(c, dclass=dclass, source="override")
        return self

    def __exit__(self, *exc):
        with _LOCK:
            _CACHE.clear()
            _CACHE.update(self.saved)
