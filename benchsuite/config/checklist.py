"""What a plan needs from this machine and what it will cost, before anything starts.

Owns three readings of a `Plan` that `benchsuite run` prints (a dry run all of them, a run the
first when something is missing):
- `environment(plan)`: each engine adapter's `environment` checks (binaries, packages, a CUDA
  device), one line per distinct finding with the engines that need it; a missing one stops a
  run before its results directory exists, with the command that fixes it;
- `estimate(plan)`: cells x requests x output tokens, and, for a matrix that names published
  figures (`reference:`), a duration at those published decode rates per mode, saying so;
- `published_lines(plan)`: the published rows the report will set beside the run's figures.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from benchsuite.config.plan import Plan, plan_cells
from benchsuite.engines import ADAPTERS
from benchsuite.engines.base import EnvCheck, ServerSpec
from benchsuite.tools.reference import DecodeRow, load_reference


@dataclass(frozen=True)
class EnvLine:
    check: EnvCheck
    engines: tuple[str, ...]  # the matrix's engine entries that need it

    def text(self) -> str:
        c = self.check
        who = f"engines {', '.join(self.engines)}"
        if c.missing:
            return f"missing: {c.subject}: {c.found} ({who})" + (f"; {c.fix}" if c.fix else "")
        return f"ok: {c.subject}: {c.found} ({who})"


def environment(plan: Plan) -> list[EnvLine]:
    """Every server's and searched server's checks, each distinct finding once (missing first)."""
    users: dict[EnvCheck, list[str]] = defaultdict(list)
    for spec in _specs(plan):
        for check in ADAPTERS[spec.kind].environment(spec):
            if spec.name not in users[check]:
                users[check].append(spec.name)
    lines = [EnvLine(check, tuple(names)) for check, names in users.items()]
    return sorted(lines, key=lambda line: not line.check.missing)


def runnable_without(plan: Plan, lines: list[EnvLine]) -> list[str]:
    """The engine entries no missing finding concerns (what `--only` could still run)."""
    blocked = {name for line in lines if line.check.missing for name in line.engines}
    return list(dict.fromkeys(spec.name for spec in _specs(plan) if spec.name not in blocked))


def _specs(plan: Plan) -> list[ServerSpec]:
    return [*plan.servers, *(task.spec for task in plan.searches)]


@dataclass(frozen=True)
class Estimate:
    cells: int  # planned cells, a search's final cells included (its per-value launches are not)
    requests: int  # warmups included
    output_tokens: int
    seconds: float | None  # at the published rates; None without a reference
    basis: str  # how the seconds were estimated, in words


def estimate(plan: Plan) -> Estimate:
    """Sizes of the run and, with a reference, a duration at the published rates: per cell,
    requests x output tokens / the published decode rate of its kind of server at its concurrency
    (paged, offload, or the CPU-experts baseline; single stream at c=1, the published 4-request
    aggregate at c>1 where there is one, else one stream's rate). Prefill, server starts and a
    search's per-value launches are left out: a lower bound for a GPU like the published one."""
    per_search = [
        (task.spec, c.workload_spec, c.concurrency)
        for task in plan.searches
        for c in plan_cells(plan.matrix, task.spec, task.params)
    ]
    by_id = {s.server_id: s for s in plan.servers}
    cells = [(by_id[c.server_id], c.workload_spec, c.concurrency) for c in plan.cells] + per_search
    requests = sum(w.num_requests + w.warmups_at(c) for _, w, c in cells)
    tokens = sum((w.num_requests + w.warmups_at(c)) * w.output_tokens for _, w, c in cells)
    rates = _published_rates(plan)
    if rates is None:
        return Estimate(len(cells), requests, tokens, None, "no published rates to estimate with (no `reference:`)")
    seconds = 0.0
    for spec, w, c in cells:
        role = _role(spec)
        single, aggregate = rates[role]
        rate = single if c == 1 or aggregate is None else aggregate
        seconds += (w.num_requests + w.warmups_at(c)) * w.output_tokens / rate
    shown = ", ".join(f"{role} {s:g}" + (f" ({a:g} at 4 requests)" if a else "") for role, (s, a) in rates.items())
    basis = f"at the published decode rates (tok/s: {shown}); prefill, server starts and search launches not included"
    return Estimate(len(cells), requests, tokens, seconds, basis)


def _role(spec: ServerSpec) -> str:
    if ADAPTERS[spec.kind].traits.is_cpu_expert_baseline:
        return "llama.cpp best"
    return "offload" if spec.options.placement().mode == "offload" else "paged"


def _published_rates(plan: Plan) -> dict[str, tuple[float, float | None]] | None:
    """role -> (single-stream tok/s, 4-request aggregate tok/s or None): the slowest published figure
    of the matrix's setup for each (an estimate to plan with errs long)."""
    rows = _rows(plan)
    if not rows:
        return None
    single = [r for r in rows if r.concurrency == 1]
    multi = [r for r in rows if r.concurrency > 1]

    def slowest(values: list[float | None]) -> float | None:
        present = [v for v in values if v]
        return min(present) if present else None

    out: dict[str, tuple[float, float | None]] = {}
    for role, pick in (
        ("paged", lambda r: r.paged_tok_s),
        ("llama.cpp best", lambda r: r.llamacpp_best_tok_s),
        ("offload", lambda r: r.offload_tok_s),
    ):
        one = slowest([pick(r) for r in single])
        if one is not None:
            out[role] = (one, slowest([pick(r) for r in multi]))
    paged = out.get("paged")
    for role in ("llama.cpp best", "offload"):
        if role not in out and paged is not None:
            out[role] = paged
    return out or None


def _rows(plan: Plan) -> tuple[DecodeRow, ...]:
    choice = plan.matrix.matrix.reference
    if choice is None:
        return ()
    return load_reference(choice.name).decode_rows(choice.machine, choice.quant)


def published_lines(plan: Plan) -> list[str]:
    """The published rows this run's report will show beside its own figures (decode and TTFT)."""
    choice = plan.matrix.matrix.reference
    if choice is None:
        return []
    ref = load_reference(choice.name)
    lines = [f"published figures ({ref.name}, {ref.model}) the report sets beside yours:"]
    for r in ref.decode_rows(choice.machine, choice.quant):
        high = f"-{r.paged_high_tok_s:g}" if r.paged_high_tok_s else ""
        rates = [f"paged K={r.resident_experts} {r.paged_tok_s:g}{high}"]
        if r.llamacpp_best_tok_s:
            rates.append(f"llama.cpp best {r.llamacpp_best_tok_s:g}")
        if r.offload_tok_s:
            rates.append(f"offload {r.offload_tok_s:g}")
        kind = "decode tok/s per stream, c=1" if r.concurrency == 1 else f"output tok/s, {r.concurrency} requests"
        lines.append(f"  {r.machine} {r.quant} ({kind}): {', '.join(rates)}")
    for t in ref.ttft:
        if choice.machine in (None, t.machine) and choice.quant in (None, t.quant):
            lines.append(
                f"  {t.machine} {t.quant} TTFT p50 {t.engine}: {t.short_ms:g} ms short, {t.long_2048_ms:g} ms at 2,048"
            )
    return lines


def duration_text(seconds: float) -> str:
    """Seconds under 2 minutes, minutes under 2 hours, else hours: 90 s -> "90 s", 3,725 s -> "62 min",
    9,000 s -> "2.5 h"."""
    if seconds < 120:
        return f"{math.ceil(seconds)} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
