"""The basis of metrics.ENGINE_TIMINGS_MARGIN: per request, our decode tok/s (benchsuite/measure/metrics.py,
token 1 -> token n on the client's clock) against the engine's own (`timings.predicted_per_second`,
token 1 -> token n on the engine's clock), for every engine that reports one: llama-server and the
built-in server, both on the generated `tiny` model on this machine's CPU.

    python benchmarks/yardstick_agreement.py --out DIR [--output-tokens 32 128] [--requests 12]
    python benchmarks/yardstick_agreement.py --summarize RUN_DIR      # an existing run

It writes a matrix (`DIR/yardstick_agreement.yaml`: the built-in engine resident and llama-server,
both on `tiny`, one thread each so a core is left for the client; random-token prompts so every
request decodes exactly N tokens; concurrency 1 and 2), runs it with the product (`benchsuite run`:
its launcher, load generator, store and metric definitions, the adapters' request extras), then
prints per engine and output length the distribution of ours / engine's over warm requests
(client-bound streams, whose token 1 or token n the client read late, are left out as the
cross-check leaves them out, and counted), the client's jitter in ms (the span difference), how many
fall outside the tolerance (metrics.engine_tolerance),
and the same for the text-chunk timing the suite used before (first to last visible text), so the
bias the token timeline removes is seen beside it.
A figure, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from benchsuite.cli import main as benchsuite_main
from benchsuite.measure import metrics
from benchsuite.report.load import normalize_requests
from benchsuite.report.samples import _record
from benchsuite.results.stored_files import read_cells


def matrix_text(output_tokens: list[int], requests: int) -> str:
    return "\n".join(
        [
            "name: yardstick-agreement",
            "repeats: 1",
            "fairness: {kv_capacity_tokens: 2048, prefix_caching: false}",
            "engines:",
            "  builtin:",
            "    kind: builtin",
            "    options: {model: tiny, mode: resident}",
            "  llamacpp:",
            "    kind: llamacpp",
            "    options: {model: tiny, threads: 1}",
            "workloads:",
            *[
                line
                for n in output_tokens
                for line in (
                    f"  out{n}:",
                    "    dataset: random",
                    "    prompt_classes: [short]",
                    f"    output_tokens: {n}",
                    "    concurrency: [1, 2]",
                    f"    num_requests: {requests}",
                    "    warmup_requests: 2",
                )
            ],
            "",
        ]
    )


def _text_rate(r: object) -> float | None:
    """The former definition: (output_tokens - 1) / (last text chunk - first text chunk)."""
    times = r.chunk_times_s  # type: ignore[attr-defined]
    tokens = r.output_tokens  # type: ignore[attr-defined]
    if tokens is None or len(times) < 2 or times[-1] <= times[0]:
        return None
    return (tokens - 1) / (times[-1] - times[0])


def per_request(run_dir: Path) -> pd.DataFrame:
    """One row per warm request with both figures: engine kind, output tokens, concurrency, the ratios."""
    cells = {c.cell_id: c for c in read_cells(run_dir)}
    requests = normalize_requests(pd.read_parquet(run_dir / "requests.parquet"))
    rows = []
    for _, row in requests.iterrows():
        r = _record(row)
        timings = row["engine_timings"]  # stored as JSON text
        r.engine_timings = json.loads(timings) if isinstance(timings, str) else timings
        if r.warmup or r.cold or not r.ok or r.cell_id not in cells:
            continue
        ours, theirs, text = metrics.decode_tok_s(r), metrics.timings_decode_tok_s(r), _text_rate(r)
        if ours is None or theirs is None:
            continue
        cell = cells[r.cell_id]
        span = metrics.engine_span_s(r)
        rows.append(
            {
                "engine": cell.engine_kind,
                "output_tokens": r.output_tokens,
                "concurrency": cell.concurrency,
                "client_bound": metrics.client_bound(r),
                "ours_over_engine": ours / theirs,
                "text_chunks_over_engine": None if text is None else text / theirs,
                "engine_tok_s": theirs,
                "engine_span_ms": None if span is None else span * 1e3,
                # the client's lag difference between token n and token 1, in ms (ours shorter: positive)
                "jitter_ms": None if span is None else (span - span * theirs / ours) * 1e3,
                "tolerance": metrics.engine_tolerance(r),
            }
        )
    return pd.DataFrame(rows)


def summary(frame: pd.DataFrame) -> str:
    lines = [
        "| engine | output tokens | c | requests (client-bound) | engine tok/s p50 | engine span ms p50 | "
        "ours/engine's min | p50 | max | largest deviation | largest jitter ms | outside tolerance | "
        "former text-chunk timing / engine's p50 [min-max] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (engine, tokens, conc), all_g in frame.groupby(["engine", "output_tokens", "concurrency"], sort=True):
        g = all_g[~all_g["client_bound"]]
        text = all_g["text_chunks_over_engine"].dropna()
        text_cell = f"{text.median():.3f} [{text.min():.3f}-{text.max():.3f}]" if len(text) else "-"
        if g.empty:
            lines.append(f"| {engine} | {tokens} | {conc} | 0 ({len(all_g)}) | | | | | | | | | {text_cell} |")
            continue
        x = g["ours_over_engine"]
        outside = int(((x - 1).abs() > g["tolerance"]).sum())
        lines.append(
            f"| {engine} | {tokens} | {conc} | {len(g)} ({len(all_g) - len(g)}) | {g['engine_tok_s'].median():.0f} | "
            f"{g['engine_span_ms'].median():.0f} | {x.min():.4f} | {x.median():.4f} | {x.max():.4f} | "
            f"{(x - 1).abs().max():.2%} | {g['jitter_ms'].abs().max():.1f} | {outside} | {text_cell} |"
        )
    checked = frame[~frame["client_bound"]]
    dev = (checked["ours_over_engine"] - 1).abs()
    outside = int((dev > checked["tolerance"]).sum())
    lines += [
        "",
        f"{len(checked)} requests checked ({len(frame) - len(checked)} client-bound left out): largest |ours/engine's"
        f" - 1| = {dev.max():.2%}, median {dev.median():.2%}; largest |jitter| {checked['jitter_ms'].abs().max():.1f} "
        f"ms; outside the tolerance (ENGINE_TIMINGS_MARGIN {metrics.ENGINE_TIMINGS_MARGIN:.0%} + CLIENT_JITTER_S "
        f"{metrics.CLIENT_JITTER_S * 1e3:.0f} ms / engine span): {outside}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for the matrix and the run")
    parser.add_argument("--summarize", type=Path, help="summarize an existing run directory instead")
    parser.add_argument("--output-tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--requests", type=int, default=12)
    args = parser.parse_args(argv)
    if args.summarize is not None:
        run_dir = args.summarize
    elif args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        matrix = args.out / "yardstick_agreement.yaml"
        matrix.write_text(matrix_text(args.output_tokens, args.requests))
        rc = benchsuite_main(["run", str(matrix), "--output-root", str(args.out), "--no-report", "--quiet"])
        if rc != 0:
            print(f"benchsuite run exited {rc}", file=sys.stderr)
        run_dir = next(p for p in args.out.iterdir() if p.is_dir())
    else:
        parser.error("give --out DIR or --summarize RUN_DIR")
    frame = per_request(run_dir)
    if frame.empty:
        print(f"{run_dir}: no warm request has both our decode rate and the engine's own", file=sys.stderr)
        return 2
    print(summary(frame))
    return 0


if __name__ == "__main__":
    sys.exit(main())
