"""`benchsuite compare RUN_A RUN_B`: per-configuration changes between two result runs, flagged
only when a Mann-Whitney U test on the per-request samples and a relative threshold agree.
Writes compare.md and compare.html and prints the markdown."""

from __future__ import annotations

import argparse
from pathlib import Path


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, got {text}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", type=Path, metavar="RUN_A", help="baseline results/<run-id>/")
    parser.add_argument("run_b", type=Path, metavar="RUN_B", help="candidate results/<run-id>/")
    parser.add_argument("--threshold", type=_fraction, default=0.05, help="relative change needed to flag (default 0.05 = 5%%)")
    parser.add_argument("--alpha", type=_fraction, default=0.05, help="significance level of the Mann-Whitney U test (default 0.05)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: reports/compare-<A>-vs-<B>/)")


def main(args: argparse.Namespace) -> int:
    from benchsuite.report import compare_runs, write_comparison
    from benchsuite.report.compare import comparison_markdown

    comparison = compare_runs(args.run_a, args.run_b, threshold=args.threshold, alpha=args.alpha)
    md_path, html_path = write_comparison(comparison, args.out)
    print(comparison_markdown(comparison))
    print(f"wrote {md_path} and {html_path}")
    return 0
