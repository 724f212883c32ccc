"""`benchsuite accuracy --a URL --b URL`: greedy tokens and logprobs of two running engines."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchsuite.checks import accuracy
from benchsuite.interrupt import run_async
from benchsuite.load.datasets import bundled_prompts


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--a", required=True, metavar="URL", help="base URL of engine A, e.g. http://127.0.0.1:30000")
    parser.add_argument("--b", required=True, metavar="URL", help="base URL of engine B")
    parser.add_argument("--prompts", type=int, default=16, help="number of bundled prompts to send (default 16)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-agreement", type=float, default=accuracy.Thresholds.min_agreement)
    parser.add_argument(
        "--max-logprob-diff",
        type=float,
        default=accuracy.Thresholds.max_logprob_diff_nats,
        help="largest allowed |logprob A - logprob B| in nats",
    )
    parser.add_argument("--json-out", type=Path, help="write the full report as JSON here")


def main(args: argparse.Namespace) -> int:
    prompts = [(p.prompt_id, p.text) for p in bundled_prompts()[: args.prompts]]
    thresholds = accuracy.Thresholds(args.min_agreement, args.max_logprob_diff)
    report = run_async(
        accuracy.run_accuracy(
            args.a.rstrip("/"), args.b.rstrip("/"), prompts, max_tokens=args.max_tokens, thresholds=thresholds
        )
    )
    print(accuracy.format_report(report))
    if args.json_out:
        args.json_out.write_text(json.dumps(report.to_dict(), indent=2))
    return 0 if report.passed else 1
