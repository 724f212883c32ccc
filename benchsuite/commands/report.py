"""`benchsuite report RUN_DIR...`: write the HTML report and tables for one or more result runs
and print the path of index.html."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="results/<run-id>/ directories")
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default: reports/<run-id>/ in the current directory)"
    )


def main(args: argparse.Namespace) -> int:
    from benchsuite.report import write_report

    print(write_report(list(args.run_dirs), args.out))
    return 0
