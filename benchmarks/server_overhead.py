"""What the HTTP side costs the built-in engine: one `benchsuite run` per call, and per cell the
decode rate over HTTP beside the rate the engine produced in process over the same window.

    python benchmarks/server_overhead.py --out DIR [--model tiny] [--device cpu] [--modes ...]

It writes a matrix (`DIR/server_overhead.yaml`: the built-in engine in each mode, concurrency 1 and
4, random-token prompts so every request decodes exactly --output-tokens tokens) and runs it with
the product (`benchsuite run`: its launcher, load generator, store and metric definitions), then
prints from the stored cells:
- per stream: decode_tok_s_p50 (the median request's decode rate over HTTP, benchsuite/measure/metrics.py)
  against 1 / engine_decode_step_s (the engine thread's own time per all-decode step in that cell:
  plan, model, wait, sample, hand-off; from the server's counters), and their ratio;
- aggregate: output_tok_s (the clients' aggregate output rate, prefill included) against
  engine_decode_tok_s (decode tokens / the engine's decode-step seconds), and their ratio;
- step ms: engine_decode_step_s.
A figure, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from benchsuite.cli import main as benchsuite_main

MODES = {
    "resident": {"mode": "resident"},
    "paged": {"mode": "paged", "resident_experts": None},  # K from --k
    "offload": {"mode": "offload", "offload_layers": None},  # from --offload-layers
    "cpu-experts": {"mode": "cpu-experts", "n_cpu_moe": None},  # N from --n-cpu-moe
}


def matrix_text(args: argparse.Namespace) -> str:
    lines = ["name: server-overhead", "repeats: 1", f"fairness: {{kv_capacity_tokens: {args.kv_tokens}}}", "engines:"]
    for mode in args.modes:
        options = dict(MODES[mode])
        if mode == "paged":
            options["resident_experts"] = args.k
        if mode == "cpu-experts":
            options["n_cpu_moe"] = args.n_cpu_moe
        if mode == "offload":
            options["offload_layers"] = args.offload_layers
        options.update(model=args.model, device=args.device)
        if args.dtype:
            options["dtype"] = args.dtype
        if args.routing != "model":
            options["routing"] = args.routing
        body = ", ".join(f"{k}: {v}" for k, v in options.items())
        lines += [f"  {mode}:", "    kind: builtin", f"    options: {{{body}}}"]
    lines += [
        "workloads:",
        "  decode:",
        "    dataset: random",
        f"    output_tokens: {args.output_tokens}",
        "    prompt_classes: [short]",
        "    concurrency: [1, 4]",
        f"    num_requests: {args.num_requests}",
        "    warmup_requests: 2",
    ]
    return "\n".join(lines) + "\n"


def table(cells: pd.DataFrame) -> str:
    """Per stream: the median request's decode rate over HTTP against 1 / the engine's decode step
    (each decode step gives every running request one token). Aggregate: output_tok_s over HTTP
    (prefill included) against the engine's decode tokens per second of its own decode steps."""
    rows = ["mode          c | per stream: http  engine  ratio | aggregate: http  engine  ratio | step ms"]
    for _, c in cells.sort_values(["engine", "concurrency"]).iterrows():
        step_s = c.get("engine_decode_step_s")
        engine_stream = 1.0 / step_s if pd.notna(step_s) and step_s else float("nan")
        http_stream, http_all, engine_all = c["decode_tok_s_p50"], c["output_tok_s"], c.get("engine_decode_tok_s")
        rows.append(
            f"{c['engine']:<12} {c['concurrency']:>2} | {http_stream:>15.1f} {engine_stream:>7.1f} "
            f"{http_stream / engine_stream:>6.2f} | "
            f"{http_all:>14.1f} {engine_all:>7.1f} {http_all / engine_all:>6.2f} | "
            f"{step_s * 1e3:>7.2f}"
        )
    return "\n".join(rows)


PHASES = ("plan", "model", "wait", "sample_deliver")


def phases(run_dir: Path, cells: pd.DataFrame) -> str:
    """Where an engine step's host time goes, per cell: the engine's phase counters scraped before
    and after the cell (engine_metrics/<cell>.json), divided by its steps, in ms."""
    rows = ["mode          c | steps | ms per step: " + "  ".join(f"{p:>14}" for p in PHASES)]
    for _, c in cells.sort_values(["engine", "concurrency"]).iterrows():
        path = run_dir / "engine_metrics" / f"{c['cell_id']}.json"
        if not path.is_file():
            continue
        m = json.loads(path.read_text())
        before, after = m.get("before") or {}, m.get("after") or {}

        def delta(name: str, before: dict = before, after: dict = after) -> float:
            key = "paged_experts:" + name
            return float(after.get(key, 0.0)) - float(before.get(key, 0.0))

        steps = delta("engine_steps_total")
        if steps <= 0:
            continue
        ms = [delta(f"engine_step_{p}_seconds_total") / steps * 1e3 for p in PHASES]
        rows.append(
            f"{c['engine']:<12} {c['concurrency']:>2} | {steps:>5.0f} |              "
            + "  ".join(f"{v:>14.3f}" for v in ms)
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results root (the run lands in OUT/<run-id>)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--k", type=int, default=8, help="K of paged mode")
    p.add_argument("--n-cpu-moe", type=int, default=2)
    p.add_argument("--offload-layers", type=int, default=2)
    p.add_argument("--routing", default="model")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--kv-tokens", type=int, default=4096)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    matrix = args.out / "server_overhead.yaml"
    matrix.write_text(matrix_text(args))
    code = benchsuite_main(["run", str(matrix), "--output-root", str(args.out), "--no-report", "--quiet"])
    runs = sorted(args.out.glob("server-overhead-*/cells.parquet"), key=lambda f: f.stat().st_mtime)
    if not runs:
        print("no cells were stored", file=sys.stderr)
        return code or 1
    cells = pd.read_parquet(runs[-1])
    print(f"\n{runs[-1].parent}: {args.model} on {args.device}, {args.output_tokens} tokens per request\n")
    print(table(cells))
    print()
    print(phases(runs[-1].parent, cells))
    return code


if __name__ == "__main__":
    sys.exit(main())
