"""Sub-commands of ``python -m fastcl`` (one module each, registered in ``fastcl.__main__``)."""

from __future__ import annotations

import argparse


class OneLineErrorParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose usage errors are one line on stderr, exit status 2
    (``prog: error: message``, the usage left to ``-h``), like every other bad input of
    fastcl's commands. Sub-parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} -h)\n")


__all__ = ["OneLineErrorParser"]
