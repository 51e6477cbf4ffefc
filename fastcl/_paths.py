"""Where fastcl finds the staged datasets.

``FASTCL_DATA_DIR`` if set, else ``shared/data`` in the folder that holds the repository
checkout (a sibling, so that data stays out of the repository; the expected sub-folders:
:func:`require_data_dir`'s message and docs/data.md). Data is never copied into the repository.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "FASTCL_DATA_DIR"
_REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The data directory: ``explicit`` > ``$FASTCL_DATA_DIR`` > ``<repo>/../shared/data``.

    The path is returned whether or not it exists; callers that need it raise a clear
    ``FileNotFoundError`` (see :func:`require_data_dir`).
    """
    if explicit is not None:
        return Path(explicit).expanduser()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return _REPO_ROOT.parent / "shared" / "data"


def require_data_dir(explicit: str | os.PathLike | None = None) -> Path:
    path = data_dir(explicit)
    if not path.is_dir():
        raise FileNotFoundError(
            f"data directory {path} not found: pass --data-dir or set {ENV_VAR} to the folder "
            "holding stsb/, sts12-16/, sick/, snli/, senteval-transfer/ and wiki/"
        )
    return path
