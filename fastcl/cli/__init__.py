"""Sub-commands of ``python -m fastcl`` (one module each, registered in ``fastcl.__main__``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

# Set by a command that started and ended a torch.distributed group: the process then leaves
# without the interpreter's teardown (exit_process).
_skip_teardown = False


class OneLineErrorParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose usage errors are one line on stderr, exit status 2
    (``prog: error: message``, the usage left to ``-h``), like every other bad input of
    fastcl's commands. Sub-parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} -h)\n")


def skip_teardown() -> None:
    """Make :func:`exit_process` leave with ``os._exit``: this process ran a gloo group.

    DDP keeps the group's C++ object alive after ``destroy_process_group`` (its references
    outlive the module), so gloo's worker threads live into the interpreter's teardown. One that
    is still releasing a finished collective then needs the GIL for the tensors it held, finds
    the interpreter finalising, and the process aborts ("terminate called without an active
    exception", SIGABRT): a finished run reported as failed. Seen about once in 35 runs of
    ``examples/ddp.py`` on a loaded 2-core machine (core dump: docs/distributed.md)."""
    global _skip_teardown
    _skip_teardown = True


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``: ``sys.exit``, or, after :func:`skip_teardown`, the
    streams and logs flushed and ``os._exit`` (the run's files are written by then)."""
    if not _skip_teardown:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["OneLineErrorParser", "exit_process", "skip_teardown"]
