"""``python -m fastcl COMMAND``: the command-line entry point (also installed as ``fastcl``).

Each command lives in its own module and registers a sub-parser through ``COMMANDS``.
"""

from __future__ import annotations

import importlib

# command -> module defining ``add_parser(subparsers)`` and ``run(args)``
COMMANDS = {
    "info": "fastcl.cli.info",
    "train": "fastcl.cli.train",
    "eval": "fastcl.cli.eval",
    "plot-similarity": "fastcl.cli.plot_similarity",
}


def main(argv: list[str] | None = None) -> int:
    from fastcl.cli import OneLineErrorParser  # usage errors: one line, exit status 2

    parser = OneLineErrorParser(prog="fastcl", description="fused contrastive losses for sentence embeddings")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, path in COMMANDS.items():
        modules[name] = importlib.import_module(path)
        modules[name].add_parser(sub)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


def entry() -> None:
    """The process's entry point (the ``fastcl`` script, ``python -m fastcl``): :func:`main`,
    then :func:`fastcl.cli.exit_process` (``main`` itself returns, for callers in a process)."""
    from fastcl.cli import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
