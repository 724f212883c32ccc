"""Are the quickstart's verdicts stable? Run `benchsuite run configs/quickstart.yaml` N times (same
commit, same matrix, one after the other), then print:

- each run's wall time (the whole command: servers, cells, summary and report), min / median / max;
- per setup, concurrency and metric: each run's fastest configuration and its verdict against the
  others, and STABLE when every run names the same winner, or when every run that names another one
  says its win is "not significant" (or has too few repeats); UNSTABLE when two runs make opposite
  significant claims;
- the A/A comparisons: `compare` between every pair of runs (one run a side: tested over repeats),
  and the rows it flags (an A/A comparison should flag none).

    python benchmarks/quickstart_aa.py                       # 3 runs into a temporary directory
    python benchmarks/quickstart_aa.py --runs 3 --out-dir /tmp/aa --json aa.json

It prints figures; it asserts nothing (performance targets live in benchmarks, never in tests).
The machine it runs on may be shared: quote medians, and read the busy-machine caveat of each report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def run_quickstart(out_dir: Path, index: int) -> tuple[Path, float]:
    """One `benchsuite run` of the quickstart; (its results run directory, wall seconds)."""
    root = out_dir / f"run-{index}"
    argv = [
        sys.executable,
        "-m",
        "benchsuite",
        "run",
        str(QUICKSTART),
        "--output-root",
        str(root / "results"),
        "--run-id",
        f"quickstart-aa-{index}",
        "--quiet",
    ]
    root.mkdir(parents=True, exist_ok=True)  # the report lands in <root>/reports/
    started = time.perf_counter()
    done = subprocess.run(
        argv, cwd=root, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"run {index} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return root / "results" / f"quickstart-aa-{index}", wall_s


def run_verdicts(run_dir: Path) -> dict[tuple[str, str, int, str], dict[str, Any]]:
    """(workload, prompt class, concurrency, metric) ->
    {winner, winner_family, versus: {family: (text, verdict, ratio)}}."""
    from benchsuite.report.build import build_report_data

    data = build_report_data([run_dir])
    out = {}
    for v in data.verdicts:
        out[(v.workload, v.prompt_class, v.concurrency, v.metric_name)] = {
            "winner": v.winner,
            "winner_family": v.winner_family,
            "versus": {
                vs.other_family: {
                    "text": vs.text(v.winner, v.ttft),
                    "verdict": vs.verdict(),
                    "ratio": None if vs.estimate is None else vs.estimate.ratio,
                }
                for vs in v.versus
            },
        }
    return out


def stability(per_run: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """STABLE / UNSTABLE for one setup across runs, with the reasons."""
    families = [r["winner_family"] for r in per_run]
    if len(set(families)) == 1:
        return "STABLE (same winner in every run)", []
    problems = []
    for i, run in enumerate(per_run):
        for j, other in enumerate(per_run):
            if i == j or other["winner_family"] == run["winner_family"]:
                continue
            claim = run["versus"].get(other["winner_family"])  # run i's winner against run j's winner
            if claim is not None and claim["verdict"] == "significant":
                problems.append(f"run {i + 1} says {claim['text']}, but run {j + 1}'s winner is {other['winner']}")
    if problems:
        return "UNSTABLE (opposite significant claims)", problems
    return "STABLE (the winner varies, and every run calls those wins not significant)", []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchsuite.report import compare_runs

    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="quickstart-aa-"))
    runs, walls = [], []
    for index in range(1, args.runs + 1):
        load = os.getloadavg()[0]
        run_dir, wall_s = run_quickstart(out_dir, index)
        runs.append(run_dir)
        walls.append(wall_s)
        print(f"run {index}: {wall_s:.1f} s wall (load average {load:.2f} at its start) -> {run_dir}", flush=True)
    print(
        f"quickstart wall time over {len(walls)} runs: min {min(walls):.1f} s, "
        f"median {statistics.median(walls):.1f} s, max {max(walls):.1f} s"
    )
    verdicts = [run_verdicts(r) for r in runs]
    report: dict[str, Any] = {"wall_s": walls, "runs": [str(r) for r in runs], "setups": [], "compare": []}
    stable = 0
    for key in sorted(set.intersection(*(set(v) for v in verdicts)), key=str):
        per_run = [v[key] for v in verdicts]
        status, problems = stability(per_run)
        stable += status.startswith("STABLE")
        print(f"\n{key[0]} · {key[1]} · c={key[2]} · {key[3]}: {status}")
        for i, run in enumerate(per_run, start=1):
            claims = "; ".join(f"{c['text']}" for c in run["versus"].values())
            print(f"  run {i}: fastest {run['winner']}; {claims}")
        for problem in problems:
            print(f"  ! {problem}")
        report["setups"].append({"key": list(key), "status": status, "problems": problems, "runs": per_run})
    total = len(report["setups"])
    print(f"\nverdict stability: {stable} of {total} setups STABLE")
    for a, b in itertools.combinations(range(len(runs)), 2):
        comparison = compare_runs(runs[a], runs[b])
        flagged = comparison.flagged
        print(
            f"A/A compare run {a + 1} -> run {b + 1}: {len(flagged)} of {len(comparison.rows)} rows flagged "
            f"(tested over {comparison.level}); same commit and matrix: {comparison.same_source is not None}"
        )
        for _, row in flagged.iterrows():
            print(
                f"  ! {row['configuration']} c={row['concurrency']} {row['metric']}: "
                f"{row['change']:+.1%} ({row['verdict']})"
            )
        report["compare"].append({"a": a + 1, "b": b + 1, "flagged": len(flagged), "rows": len(comparison.rows)})
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
