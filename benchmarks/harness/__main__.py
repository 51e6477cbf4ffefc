"""``python -m benchmarks.harness report JSON...``: benchmark JSON -> RESULTS.md tables and plots;
``python -m benchmarks.harness correctness``: every implementation against float64 at scale."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness")
    sub = parser.add_subparsers(dest="command", required=True)
    from benchmarks.harness import correctness, report

    report.add_arguments(sub.add_parser("report", help="pytest-benchmark JSON -> RESULTS.md tables and PNG plots"))
    correctness.add_arguments(sub.add_parser("correctness", help="values and gradients vs float64 at scale"))
    args = parser.parse_args(argv)
    return {"report": report.main, "correctness": correctness.main}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
