"""Two settings of benchmarks/prefill_h200.py against each other, from their JSON files alone (no GPU).

Each side is one or more JSON files of one setting (e.g. `--gc-freeze off` and `on`, run in alternating order so
that neither always runs first). Per cell (the same `cell` name on both sides): every file's median prefill over
its measured prompts (the first prompt of a cell warms up and is left out), then the sides' pooled prompts as
medians, their ratio (B over A) and p, the share of 20,000 shuffles of the pooled prompts whose medians differ as
much (benchmarks/prefill_speeds.median_ratio_test); the host's plan per prompt (paged cells) and the collector's
time and full collections a side. The files of one side differ from one another too (another process, another
moment): a ratio no larger than the spread between a side's own files is not the setting's.

    python benchmarks/prefill_ab.py --a off1.json off2.json --b on1.json on2.json [--names off,on]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path
from typing import Any

_SPEC = importlib.util.spec_from_file_location("prefill_speeds", Path(__file__).with_name("prefill_speeds.py"))
assert _SPEC is not None and _SPEC.loader is not None
_SPEEDS = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_SPEEDS)
median_ratio_test = _SPEEDS.median_ratio_test


def measured(path: Path) -> dict[str, list[dict[str, Any]]]:
    """cell name -> its measured prompts (the file's `runs` less the warm-up), cells that failed left out."""
    record = json.loads(path.read_text())
    return {c["cell"]: c["runs"][1:] for c in record["cells"] if "error" not in c and len(c.get("runs", ())) > 1}


def _plan_s(prompt: dict[str, Any]) -> float | None:
    prefill = prompt.get("prefill") or {}
    return prefill.get("host_plan_s")


def compare(a: list[Path], b: list[Path], names: tuple[str, str] = ("A", "B")) -> list[str]:
    """The table's lines: per cell in both sides, each file's median, then the pooled comparison."""
    sides = [[measured(p) for p in files] for files in (a, b)]
    cells = [c for c in sides[0][0] if all(c in f for side in sides for f in side)]
    lines = [f"{'cell':<40} {'files ' + names[0]:>22} {'files ' + names[1]:>22} {names[0]:>7} {names[1]:>7} "
             f"{names[1] + '/' + names[0]:>7} {'p':>6} {'plan ' + names[0]:>8} {'plan ' + names[1]:>8} "
             f"{'gc ms':>11} {'full':>5}"]  # fmt: skip
    for cell in cells:
        per_file = [[statistics.median(r["prefill_s"] for r in f[cell]) for f in side] for side in sides]
        pooled = [[r["prefill_s"] for f in side for r in f[cell]] for side in sides]
        ratio, p = median_ratio_test(pooled[0], pooled[1])
        plans = [[s for f in side for r in f[cell] if (s := _plan_s(r)) is not None] for side in sides]
        plan = [f"{statistics.median(x):8.3f}" if x else f"{'-':>8}" for x in plans]
        gc_ms = [sum(r.get("gc_s") or 0.0 for f in side for r in f[cell]) * 1e3 for side in sides]
        full = [sum((r.get("gc_collections") or [0, 0, 0])[2] for f in side for r in f[cell]) for side in sides]
        files = [" ".join(f"{v:.3f}" for v in side) for side in per_file]
        lines.append(f"{cell:<40} {files[0]:>22} {files[1]:>22} {statistics.median(pooled[0]):7.3f} "
                     f"{statistics.median(pooled[1]):7.3f} {ratio:7.3f} {p:6.3f} {plan[0]} {plan[1]} "
                     f"{gc_ms[0]:5.1f}/{gc_ms[1]:<5.1f} {full[0]:>2}/{full[1]:<2}")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, nargs="+", required=True, help="side A's prefill_h200.py JSON files")
    ap.add_argument("--b", type=Path, nargs="+", required=True, help="side B's")
    ap.add_argument("--names", default="A,B", help="the sides' names in the header, comma-separated")
    args = ap.parse_args()
    first, _, second = args.names.partition(",")
    print("\n".join(compare(args.a, args.b, (first, second or "B"))))


if __name__ == "__main__":
    main()
