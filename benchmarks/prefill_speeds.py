"""Whether a run's paged prefills ran at two speeds, and whether the host set them, from the stored run alone
(no GPU: the cells and requests of `benchsuite run`, read as the report reads them).

For each paged cell with prompt chunks of the class given (2,048 tokens by default), and each routing:

- per request, the client's TTFT and the engine's own `prompt_ms` (arrival -> token 1 on its clock): when they
  agree the time is the engine's, not the HTTP path's; and, for runs since 2026-12-04, the engine's per-request
  prefill keys (`prefill_issue_ms` over `prompt_ms`: near 1, the host issued the prompt for as long as the
  request waited; `prefill_issue_cpu_ms` over `prefill_issue_ms`: near 1, the engine thread was on the CPU all
  along; `prefill_host_plan_ms` per layer-step); for runs since 2026-12-05, how the rest of that time went (queued:
  runnable but waiting for a CPU; blocked: asleep), the thread's context switches (voluntary / involuntary), the
  CPU its prefill ended on, and the memory sampler's NVML reads inside the request's wait for its first token
  (sampler ms); then, at concurrency 1, each server's measured requests as their cell's fast or slow half in
  sending order, with a runs test against the same halves shuffled within each cell (whether the speed comes in
  regimes of consecutive requests: the split sets each cell's halves, so only runs across a cell's requests are
  tested; a regime as long as a cell shows in the per-cell figures below), and per CPU how many were fast or slow;
- per cell, the chunk's device span beside the synthetic router's time per chunk (`router_s`): the router does the
  same work for every 2,048-token chunk, nearly all of it on the host (its draw kernel and the one copy back, ~1.1
  ms on the H200, are the same every chunk), so its time is a probe of the host's speed during the cell, and a span
  that moves with it (the correlation over the run's cells is printed) points to the host, not the link or the
  GPU;
- with `--against BASE` (another run of the same matrix, e.g. other code on the same machine): per server (the same
  configuration has the same server id in both runs), routing and concurrency, the measured requests' engine
  `prompt_ms`, `prefill_issue_ms` and host plan per layer-step, as medians in each run, their ratio (this run over
  BASE) and p: the share of 20,000 shuffles of the two runs' pooled requests whose medians differ by as much. The
  shuffle treats requests as exchangeable; requests of one cell share a server's state, so read a small p beside
  the cells' own spread, not alone.

    python benchmarks/prefill_speeds.py results/h200-headline-c [--prompt-class 2048] [--against results/RUN]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import pandas as pd

from benchsuite.report.load import load_run
from benchsuite.report.prefill_requests import halves, request_figures


def per_request(run_id: str, requests: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """The report's per-request figures (report/prefill_requests.py) of the cells' requests, in sending order."""
    keys = ["cell_id", "server_id", "routing", "concurrency", "repeat"]
    return request_figures(run_id, requests).merge(cells[keys], on="cell_id").sort_values("t_sent_s")


def _cell(value: object, spec: str) -> str:
    return "" if value is None or pd.isna(value) else format(value, spec)


def slow_half(measured: pd.DataFrame) -> pd.Series:
    """Whether each request is in its cell's slow half (report/prefill_requests.halves, the report's split)."""
    slow = pd.Series(False, index=measured.index)
    for _, cell in measured.groupby("cell_id"):
        slow[halves(cell)[1][1].index] = True
    return slow


def by_cpu(measured: pd.DataFrame) -> dict[int, tuple[int, int]]:
    """CPU -> (requests in their cell's fast half, in its slow half), per CPU the engine thread's prefill ended on
    (requests that did not say are left out)."""
    counts: dict[int, list[int]] = {}
    for (_, r), slow in zip(measured.iterrows(), slow_half(measured)):
        if not pd.isna(r["cpu_id"]):
            counts.setdefault(int(r["cpu_id"]), [0, 0])[int(slow)] += 1
    return {cpu: (fast, slow) for cpu, (fast, slow) in sorted(counts.items())}


def _runs(labels: np.ndarray) -> int:
    return 1 + int(np.count_nonzero(labels[1:] != labels[:-1])) if labels.size else 0


def runs_test(slow: list[bool], cells: list[str], shuffles: int = 4000, seed: int = 0) -> tuple[int, float, float]:
    """(runs of equal halves in sending order, the mean runs over `shuffles` shuffles of the halves within each cell,
    p: the share of shuffles with as few runs or fewer). The halves are set per cell (half of each cell is slow),
    so the reference keeps each cell's labels and positions and permutes only which of its requests is slow: a
    formula for independent labels would expect too few runs here. p small: the speed comes in regimes of
    consecutive requests; near 1: it alternates more than chance."""
    labels, groups = np.array(slow, dtype=bool), np.array(cells)
    observed = _runs(labels)
    if not labels.size:
        return 0, 0.0, 1.0
    rng = np.random.default_rng(seed)
    members = [np.flatnonzero(groups == g) for g in dict.fromkeys(cells)]
    shuffled = labels.copy()
    counts = np.empty(shuffles, dtype=np.int64)
    for i in range(shuffles):
        for idx in members:
            shuffled[idx] = rng.permutation(labels[idx])
        counts[i] = _runs(shuffled)
    return observed, float(counts.mean()), float(np.mean(counts <= observed))


def median_ratio_test(base: list[float], new: list[float], shuffles: int = 20000, seed: int = 0) -> tuple[float, float]:
    """(median(new) / median(base), p: the share of `shuffles` random splits of the pooled values into groups of the
    same sizes whose medians differ by at least as much as the observed ones, counting the observed split itself,
    so p is never 0: (k + 1) / (shuffles + 1)). Both groups must be non-empty."""
    a, b = np.asarray(base, dtype=float), np.asarray(new, dtype=float)
    observed = abs(float(np.median(b) - np.median(a)))
    pooled = np.tile(np.concatenate([a, b]), (shuffles, 1))  # [shuffles, n_a + n_b]
    pooled = np.random.default_rng(seed).permuted(pooled, axis=1)
    diffs = np.abs(np.median(pooled[:, a.size :], axis=1) - np.median(pooled[:, : a.size], axis=1))
    # a tolerance for float noise, so a shuffle that reproduces the observed split counts as "as much"
    as_much = int(np.count_nonzero(diffs >= observed - 1e-12))
    return float(np.median(b) / np.median(a)), (as_much + 1) / (shuffles + 1)


def paged_cells(run_dir: Path, prompt_class: str) -> tuple[str, pd.DataFrame, pd.DataFrame]:
    """(run id, the run's paged cells with prompt chunks of the class, their requests in sending order)."""
    run = load_run(run_dir)
    cells = run.cells
    if "prefill_chunks" not in cells:
        raise SystemExit(f"{run_dir}: stored before the prefill counters (no prefill_chunks)")
    cells = cells[(cells["mode"] == "paged") & (cells["prompt_class"].astype(str) == prompt_class)]
    cells = cells[pd.to_numeric(cells["prefill_chunks"], errors="coerce").fillna(0) > 0]
    if cells.empty:
        raise SystemExit(f"{run_dir}: no paged cell with {prompt_class}-token prompt chunks")
    return run.run_id, cells, per_request(run.run_id, run.requests, cells)


def compare(base: pd.DataFrame, new: pd.DataFrame) -> list[dict[str, object]]:
    """Per (server, routing, concurrency) in both runs: each figure's medians over the measured requests, their
    ratio (new over base) and p (median_ratio_test); one in a single run gets a row with its requests counted and
    no figure (`only`: which run has it)."""
    keys = ["server_id", "routing", "concurrency"]
    rows: list[dict[str, object]] = []
    base_measured, new_measured = (r[~r["warmup"].astype(bool)] for r in (base, new))
    for key, mine in new_measured.groupby(keys):
        theirs = base_measured[(base_measured[keys] == pd.Series(key, index=keys)).all(axis=1)]
        row: dict[str, object] = dict(zip(keys, key)) | {"base_requests": len(theirs), "requests": len(mine)}
        if theirs.empty:
            rows.append(row | {"only": "this run"})
            continue
        for figure in ("prompt_ms", "issue_ms", "host_plan_ms"):
            a, b = (pd.to_numeric(r[figure], errors="coerce").dropna().tolist() for r in (theirs, mine))
            if a and b:
                ratio, p = median_ratio_test(a, b)
                row |= {f"{figure}_base": statistics.median(a), figure: statistics.median(b),
                        f"{figure}_ratio": ratio, f"{figure}_p": p}  # fmt: skip
        rows.append(row)
    seen = {tuple(r[k] for k in keys) for r in rows}
    for key, theirs in base_measured.groupby(keys):
        if tuple(key) not in seen:
            rows.append(dict(zip(keys, key)) | {"base_requests": len(theirs), "requests": 0, "only": "the base run"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a results run directory")
    ap.add_argument("--prompt-class", default="2048")
    ap.add_argument("--against", type=Path, help="a run of the same matrix to compare the requests with")
    args = ap.parse_args()
    _, cells, requests = paged_cells(args.run, args.prompt_class)
    for (routing, concurrency), mine in requests.groupby(["routing", "concurrency"]):
        measured = mine[~mine["warmup"].astype(bool)]
        print(f"\n== {routing}, c={concurrency}: {len(measured)} measured requests (warm-up ones too below)")
        header = ("server", "rep", "warm", "ttft_ms", "prompt_ms", "issue_ms", "on_cpu", "queued", "blocked",
                  "vol", "invol", "cpu", "sampler_ms", "plan/layer")  # fmt: skip
        print("{:<13} {:>3} {:>4} {:>8} {:>9} {:>8} {:>6} {:>6} {:>7} {:>4} {:>5} {:>3} {:>10} {:>10}".format(*header))
        for _, r in mine.iterrows():
            print(f"{r['server_id']:<13} {r['repeat']:>3} {'yes' if r['warmup'] else '':>4} {r['ttft_s'] * 1e3:8.1f} "
                  f"{r['prompt_ms']:9.1f} {_cell(r['issue_ms'], '8.1f'):>8} {_cell(r['on_cpu'], '6.2f'):>6} "
                  f"{_cell(r['queued'], '6.2f'):>6} {_cell(r['blocked'], '7.2f'):>7} "
                  f"{_cell(r['vol_switches'], '4.0f'):>4} {_cell(r['invol_switches'], '5.0f'):>5} "
                  f"{_cell(r['cpu_id'], '3.0f'):>3} {_cell(r['sampler_ms'], '10.2f'):>10} "
                  f"{_cell(r['host_plan_ms'], '10.3f'):>10}")  # fmt: skip
        gap = (measured["ttft_s"] * 1e3 - measured["prompt_ms"]).dropna()
        if len(gap):
            print(f"client TTFT - engine prompt_ms: median {statistics.median(gap):.1f} ms, max {gap.max():.1f} ms")
        for server, mine_server in measured.groupby("server_id") if concurrency == 1 else ():  # c>1: queue order
            ordered = mine_server.sort_values("t_sent_s")
            halves_of = slow_half(ordered)
            slow = [bool(halves_of[i]) for i in ordered.index]
            runs, expected, p = runs_test(slow, [str(c) for c in ordered["cell_id"]])
            order = "".join("s" if x else "F" for x in slow)
            print(f"server {server}: halves in sending order {order}; {runs} runs, {expected:.1f} with each cell's "
                  f"halves shuffled (p = {p:.3f} for as few)")  # fmt: skip
        cpus = by_cpu(measured) if concurrency == 1 else {}
        if cpus:
            print("per CPU (fast half / slow half of their cell): "
                  + ", ".join(f"{cpu}: {fast}/{slow}" for cpu, (fast, slow) in cpus.items()))  # fmt: skip
    print("\n== per cell: the chunk's device span against the synthetic router's time per chunk")
    synthetic = cells[pd.to_numeric(cells["prefill_router_s_per_chunk"], errors="coerce").fillna(0) > 0]
    for _, c in synthetic.sort_values("prefill_span_s_per_chunk").iterrows():
        idle = c.get("prefill_idle_before_layer_s")
        idle_ms = "" if pd.isna(idle) else f"{idle * 1e3:6.2f}"
        print(f"{c['routing']:<26} c={c['concurrency']} rep {c['repeat']}: span {c['prefill_span_s_per_chunk']:.3f} s, "
              f"router {c['prefill_router_s_per_chunk'] * 1e3:6.2f} ms, idle before a layer {idle_ms} ms")  # fmt: skip
    if len(synthetic) >= 3:
        r = np.corrcoef(synthetic["prefill_router_s_per_chunk"], synthetic["prefill_span_s_per_chunk"])[0, 1]
        print(f"correlation of span with router time over {len(synthetic)} cells: {r:.2f}")
    if args.against is not None:
        base_id, _, base = paged_cells(args.against, args.prompt_class)
        print(
            f"\n== against {base_id}: medians over each server's measured requests (n: {base_id}'s / this run's); "
            f"each figure as {base_id}'s, this run's, their ratio, p"
        )
        print("{:<13} {:<26} {:>2} {:>7}  {:<27}  {:<27}  {}".format(
            "server", "routing", "c", "n", "prompt_ms", "issue_ms", "plan/layer ms"))  # fmt: skip
        for row in compare(base, requests):
            figures = []
            for figure, spec in (("prompt_ms", "7.1f"), ("issue_ms", "7.1f"), ("host_plan_ms", "7.3f")):
                if figure in row:
                    figures.append(f"{row[f'{figure}_base']:{spec}} {row[figure]:{spec}} "
                                   f"{row[f'{figure}_ratio']:5.3f} {row[f'{figure}_p']:5.3f}")  # fmt: skip
                else:
                    figures.append(f"{'-':<27}")
            n = f"{row['base_requests']}/{row['requests']}"
            said = f"only in {row['only']}" if "only" in row else "  ".join(figures)
            print(f"{row['server_id']:<13} {row['routing']:<26} {row['concurrency']:>2} {n:>7}  {said}".rstrip())


if __name__ == "__main__":
    main()
