"""`benchsuite canary --url URL`: plant a marker in one request and look for it in all others."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchsuite.checks import canary
from benchsuite.interrupt import run_async


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="base URL of the engine, e.g. http://127.0.0.1:30000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json-out", type=Path, help="write the report as JSON here")


def main(args: argparse.Namespace) -> int:
    report = run_async(
        canary.run_canary(
            args.url.rstrip("/"), rounds=args.rounds, concurrency=args.concurrency, max_tokens=args.max_tokens
        )
    )
    print(canary.format_report(report))
    if args.json_out:
        args.json_out.write_text(json.dumps(report.to_dict(), indent=2))
    return 0 if report.passed else 1
