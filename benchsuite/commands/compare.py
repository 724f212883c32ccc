"""`benchsuite compare RUN_A RUN_B` (or `RUN_A1 RUN_A2 ... --vs RUN_B1 RUN_B2 ...`): per-configuration
changes between two runs, or two sets of reruns, tested over repeats (one run a side) or over runs
(two or more a side), never over requests; flagged only when significant after Benjamini-Hochberg
and over the threshold (benchsuite.report.compare). Writes compare.md and compare.html (every row) and
prints one line of counts and the flagged rows only (benchsuite.report.compare_text); `--columns all`
prints the full table."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchsuite.errors import UserError


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, got {text}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        type=Path,
        nargs="+",
        metavar="RUN",
        help="RUN_A RUN_B (baseline, candidate); with --vs, every RUN is a rerun of the baseline",
    )
    parser.add_argument(
        "--vs",
        type=Path,
        nargs="+",
        metavar="RUN_B",
        default=None,
        help="the candidate's runs (reruns of one matrix): with two or more runs a side the test is over runs",
    )
    parser.add_argument(
        "--threshold", type=_fraction, default=0.05, help="relative change needed to flag (default 0.05 = 5%%)"
    )
    parser.add_argument(
        "--alpha",
        type=_fraction,
        default=0.05,
        help="false-discovery rate over all rows (Benjamini-Hochberg; default 0.05)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default: reports/compare-<A>-vs-<B>/)"
    )
    parser.add_argument(
        "--columns",
        choices=("default", "all"),
        default="default",
        help="printed: 'default' = one line of counts (configurations compared, flagged faster, flagged slower, "
        "not significant, not comparable) and the flagged rows with their interval; 'all' = the full table, one "
        "row per configuration and metric with every column (compare.md always has every row and column)",
    )


def main(args: argparse.Namespace) -> int:
    from benchsuite.report import compare_runs, write_comparison
    from benchsuite.report.compare import COLUMNS_ALL, comparison_markdown
    from benchsuite.report.compare_text import terminal_text

    if args.vs is None:
        if len(args.runs) != 2:
            raise UserError(
                f"compare: give RUN_A RUN_B, or RUN_A... --vs RUN_B... (got {len(args.runs)} runs and no --vs)"
            )
        side_a, side_b = [args.runs[0]], [args.runs[1]]
    else:
        side_a, side_b = list(args.runs), list(args.vs)
    comparison = compare_runs(side_a, side_b, threshold=args.threshold, alpha=args.alpha)
    md_path, html_path = write_comparison(comparison, args.out)
    print(comparison_markdown(comparison, COLUMNS_ALL) if args.columns == COLUMNS_ALL else terminal_text(comparison))
    print(f"wrote {md_path} and {html_path}")
    return 0
