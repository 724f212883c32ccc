"""Prefill requests, fast half against slow half: for every built-in cell at concurrency 1 whose requests carry the
engine's own prefill keys (paged_experts' `timings`: `RequestPrefill`), the cell's measured requests split at their
median TTFT, each half beside the host's side of its prefill steps. Why: a cell's prefill counters
(report/prefill.py) sum its requests, so a cell whose prompts prefill at two speeds (h200-policyconfirm: 0.396-0.436
s or 0.451-0.621 s a 2,048-token prompt, request by request) shows one blurred figure; per request the engine says
which side the host was on. Concurrency 1 only: above it a request's TTFT holds its place in the queue (at c=4
about 1, 2, 3 and 4 chunks), so a split on it would sort requests by arrival, not by speed.

Per request (the engine's clock, except TTFT, the client's):

    issue_of_prompt = prefill_issue_ms / prompt_ms   (the host issuing the prompt's steps, over arrival -> token 1)
    on_cpu          = prefill_issue_cpu_ms / prefill_issue_ms   (the engine thread's CPU time while it issued them)
    host_plan_ms    = prefill_host_plan_ms / prefill_layer_steps   (per paged host-planned layer-step)
    host_wait_ms    = prefill_host_wait_ms / prefill_layer_steps
    queued          = prefill_issue_run_delay_ms / prefill_issue_ms   (runnable, waiting for a CPU: paged_experts'
                                                                       thread_clock, Linux, since 2026-12-05)
    blocked         = max(0, 1 - on_cpu - queued)   (asleep: a lock such as the interpreter's, a blocking read;
                      clamped, as the clocks are read a few microseconds apart)
    vol_switches, invol_switches = the engine thread's context switches over those steps (it blocked; the
                      scheduler took the CPU back), and cpu_id the CPU the last of them ended on
    sampler_ms      = the time the runner's memory sampler spent in NVML reads inside the request's
                      [sent, first token] (RequestRecord.sampler_read_s, benchsuite.tools.device_memory)

and per half the median of each over its requests (so a half's on_cpu, queued and blocked need not add up to 1),
its switches as 'voluntary/involuntary' medians, and cpu_ids: the distinct CPUs its requests ended on (their
count past four). issue_of_prompt near 1: the device never got ahead of the host's issue (host_wait_ms says
whether the host was working or waiting for the device meanwhile: with the model's own router it waits at every
layer); well below 1: the host ran ahead and the device's queue set the time. A slow half whose host_plan_ms is
above the fast half's, at the same routing, had a slower host: on_cpu near 1 says the thread ran all along (more
work, or a slower CPU), well below 1 that it was off the CPU; queued (preempted, or queued behind other tasks) and
blocked (the interpreter lock another of the server's threads held, a sleeping read) say which, and sampler_ms
whether the instrument's own NVML reads lay in the slow requests' waits.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import pandas as pd

from benchsuite.report.fmt import number
from benchsuite.report.load import RunData, as_dict

TITLE = "Prefill requests: fast half against slow half"
ANCHOR = "prefill-requests"
COLUMNS = (
    "run_id", "configuration", "routing", "workload", "prompt_class", "concurrency", "repeat", "half", "requests",
    "ttft_s", "prompt_ms", "issue_ms", "issue_of_prompt", "on_cpu", "queued", "blocked", "switches", "cpu_ids",
    "sampler_ms", "host_plan_ms", "host_wait_ms", "router_ms", "shared_steps", "cell_id",
)  # fmt: skip
FIGURES = (
    "ttft_s", "prompt_ms", "issue_ms", "issue_of_prompt", "on_cpu", "queued", "blocked", "sampler_ms",
    "host_plan_ms", "host_wait_ms", "router_ms",
)  # fmt: skip
PER_REQUEST = ("run_id", "cell_id", "warmup", "t_sent_s", *FIGURES, "vol_switches", "invol_switches", "cpu_id",
               "shared_steps")  # fmt: skip
MOST_CPU_IDS = 4  # a half whose requests ended on more CPUs shows their count
INTRO = (
    "<p>The built-in engine's own prefill figures per request (its <code>timings</code>), for each concurrency-1 "
    "cell's measured requests split at their median TTFT: the fast half, then the slow half (medians over each "
    "half's requests; above concurrency 1 a TTFT holds the request's place in the queue, so cells there are left "
    "out). "
    "prompt_ms is the engine's arrival to first token; issue_ms the host's time issuing the steps that ran the "
    "prompt (every launch; with the model's own router, its reads of the routed ids too); issue_of_prompt = "
    "issue_ms / prompt_ms per request; on_cpu the engine thread's CPU time over issue_ms (below 1: the thread was "
    "off the CPU); queued and blocked split the rest: runnable but waiting for a CPU (preempted, or queued behind "
    "other tasks), and asleep (a lock such as the interpreter's, a blocking read; clamped at 0), each a median, so "
    "a half's three need not add up to 1; switches the engine thread's voluntary/involuntary context switches "
    "(medians) and cpu_ids the CPUs its requests' prefills ended on; sampler_ms the time "
    "the runner's device-memory sampler spent in NVML reads during the request's wait for its first token (the "
    "instrument's own reads: a slow half with more of it points at them); host_plan_ms and host_wait_ms the "
    "host's time per paged layer-step, its own work (plan, launches) and blocked on the device; router_ms a "
    "synthetic router's draws. Reading: "
    "issue_of_prompt near 1 means the device never got ahead of the host's issue (host_wait_ms says whether the "
    "host was working or waiting on the device meanwhile: with the model's own router it waits at every layer); "
    "well below 1, the host ran ahead and the device set the time. A slow half whose host_plan_ms exceeds the fast "
    "half's had a slower host. shared_steps counts steps that also ran another request's prompt chunk (their "
    "figures are the whole step's).</p>"
)
EMPTY = (
    "no built-in cell at concurrency 1 had two measured requests with the engine's prefill timings (runs before "
    "2026-12-04, or no prompts)"
)


def request_figures(run_id: str, requests: pd.DataFrame) -> pd.DataFrame:
    """Every ok request with its two timestamps and the engine's prompt_ms (warm-up ones too, marked): TTFT and the
    per-request figures of the module docstring, None where the engine sent no prefill keys (a run before
    2026-12-04, another engine) or a key the platform could not give. The report's table and
    benchmarks/prefill_speeds.py both read these."""
    rows = []
    for _, r in requests.iterrows():
        if not r.get("ok"):
            continue
        t = as_dict(r.get("engine_timings"))
        prompt, sent, first = (number(v) for v in (t.get("prompt_ms"), r.get("t_sent_s"), r.get("t_first_token_s")))
        if prompt is None or sent is None or first is None:
            continue
        issue, cpu = number(t.get("prefill_issue_ms")), number(t.get("prefill_issue_cpu_ms"))
        delay = number(t.get("prefill_issue_run_delay_ms"))
        layer_steps = number(t.get("prefill_layer_steps")) or 0.0
        queued = delay / issue if delay is not None and issue else None
        blocked = max(0.0, 1.0 - cpu / issue - queued) if cpu is not None and issue and queued is not None else None

        def per_layer(key: str, t: dict[str, Any] = t, layer_steps: float = layer_steps) -> float | None:
            value = number(t.get(key))
            return value / layer_steps if value is not None and layer_steps else None

        rows.append({
            "run_id": run_id, "cell_id": r["cell_id"], "warmup": bool(r.get("warmup")), "t_sent_s": sent,
            "ttft_s": first - sent, "prompt_ms": prompt, "issue_ms": issue,
            "issue_of_prompt": issue / prompt if issue is not None and prompt > 0 else None,
            "on_cpu": cpu / issue if cpu is not None and issue else None, "queued": queued, "blocked": blocked,
            "vol_switches": number(t.get("prefill_issue_voluntary_switches")),
            "invol_switches": number(t.get("prefill_issue_involuntary_switches")),
            "cpu_id": number(t.get("prefill_cpu_id_last")),
            "sampler_ms": None if (read := number(r.get("sampler_read_s"))) is None else read * 1e3,
            "host_plan_ms": per_layer("prefill_host_plan_ms"), "host_wait_ms": per_layer("prefill_host_wait_ms"),
            "router_ms": number(t.get("prefill_router_ms")), "shared_steps": number(t.get("prefill_shared_steps")),
        })  # fmt: skip
    return pd.DataFrame(rows, columns=list(PER_REQUEST))


def _median(values: Iterable[Any]) -> float | None:
    present = [v for v in (number(x) for x in values) if v is not None]
    return statistics.median(present) if present else None


def _cpu_ids(values: Iterable[Any]) -> str | None:
    """The distinct CPUs, ascending, as '3,7', or '6 CPUs' past MOST_CPU_IDS (None: no request said)."""
    cpus = sorted({int(v) for v in (number(x) for x in values) if v is not None})
    if len(cpus) > MOST_CPU_IDS:
        return f"{len(cpus)} CPUs"
    return ",".join(str(c) for c in cpus) if cpus else None


def _switches(group: pd.DataFrame) -> str | None:
    """'voluntary/involuntary' medians (None: no request said)."""
    voluntary, involuntary = _median(group["vol_switches"]), _median(group["invol_switches"])
    if voluntary is None or involuntary is None:
        return None
    return f"{voluntary:g}/{involuntary:g}"


def halves(mine: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """A cell's requests by TTFT: the faster floor(n/2), then the rest (an odd one out goes to the slow half). The
    report's split, and benchmarks/prefill_speeds.py's."""
    ordered = mine.sort_values("ttft_s", kind="stable")
    cut = len(ordered) // 2
    return [("fast", ordered.iloc[:cut]), ("slow", ordered.iloc[cut:])]


def prefill_requests_table(cells: pd.DataFrame, runs: Iterable[RunData]) -> pd.DataFrame:
    """Two rows (fast, slow) per concurrency-1 cell with at least two measured requests carrying the engine's
    prefill keys. Cell ids repeat across runs (a run's rerun under a new id keeps them): requests are the cell's
    own run's."""
    if cells.empty or "concurrency" not in cells:
        return pd.DataFrame(columns=list(COLUMNS))
    frames = [request_figures(run.run_id, run.requests) for run in runs if not run.requests.empty]
    figures = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run_id", "cell_id"])
    per_request = figures[~figures["warmup"].astype(bool) & figures["issue_ms"].notna()] if frames else figures
    rows = []
    by_cell = {(str(r), str(c)): g for (r, c), g in per_request.groupby(["run_id", "cell_id"])}
    alone = cells[cells["concurrency"].astype(int) == 1]
    for _, c in alone.sort_values(["run_id", "prompt_class", "routing", "label", "repeat"]).iterrows():
        mine = by_cell.get((str(c["run_id"]), str(c["cell_id"])))
        if mine is None or len(mine) < 2:
            continue
        for half, group in halves(mine):
            rows.append({
                "run_id": c["run_id"], "configuration": c["label"], "routing": c["routing"],
                "workload": c["workload"], "prompt_class": c["prompt_class"], "concurrency": int(c["concurrency"]),
                "repeat": int(c["repeat"]), "half": half, "requests": len(group),
                **{k: _median(group[k]) for k in FIGURES},
                "switches": _switches(group), "cpu_ids": _cpu_ids(group["cpu_id"]),
                "shared_steps": int(sum(number(v) or 0 for v in group["shared_steps"])),
                "cell_id": c["cell_id"],
            })  # fmt: skip
    return pd.DataFrame(rows, columns=list(COLUMNS))
