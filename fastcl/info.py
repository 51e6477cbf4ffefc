"""``python -m fastcl.info``: versions, devices and which backends can run here (and why not)."""

from __future__ import annotations

import importlib.metadata
import platform
import sys


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    import torch

    from fastcl import __version__
    from fastcl.ops import dispatch

    lines = [
        f"fastcl   {__version__}",
        f"python   {sys.version.split()[0]} ({platform.machine()})",
        f"torch    {torch.__version__} (cuda build: {torch.version.cuda or 'none'})",
    ]
    for dist in ("triton", "ninja", "transformers", "datasets", "sentence-transformers"):
        lines.append(f"{dist:<8} {_version(dist)}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"device   cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)")
    else:
        lines.append("device   no CUDA device; CPU only")
    lines.append("backends:")
    for name, status in dispatch.describe().items():
        lines.append(f"  {name:<10} {status}")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
