"""`benchsuite linkbw`: measure host<->device copy bandwidth (benchsuite.tools.linkbw) and print or save it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchsuite.tools.linkbw import LinkPlan, measure, render


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--samples", type=int, default=5, help="timed samples per case (after warmup)")
    p.add_argument("--no-pageable", action="store_true", help="skip pageable host memory")
    p.add_argument("--no-d2h", action="store_true", help="skip device-to-host")
    p.add_argument("--burst", type=int, default=384, help="back-to-back copies per burst (1 disables bursts)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--json-out", help="also write the JSON report here (preflight --link-gbps takes it)")


def main(args: argparse.Namespace) -> int:
    plan = LinkPlan(samples=args.samples, pageable=not args.no_pageable, d2h=not args.no_d2h, burst_copies=args.burst)
    report = measure(plan, args.device)
    data = report.to_dict()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=2))
    print(json.dumps(data, indent=2) if args.json else render(report))
    return 0
