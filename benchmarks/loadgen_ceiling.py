"""How fast can the load generator receive streams before it becomes the bottleneck?

Runs `benchsuite.load.loadgen.run_load` (closed loop, `--streams` concurrent streams) pinned to ONE
CPU core against the scripted fake server (tests/fakes.py) running in separate processes on other
cores. Each phase paces the fake so that all streams together offer a given number of SSE chunks
per second (every stream emits one chunk per `streams / rate` seconds, all streams in step, like a
batched engine's decode steps); a last phase sends unpaced (as fast as the server can).

Per phase it prints: offered and achieved chunks/s, the client's CPU use (fraction of its one
core), chunks per client CPU-second (the client's one-core ceiling estimate), the client-side
ITL p50/p99 against the paced ITL, the server's CPU use, and errors. The client keeps up at a
rate when achieved >= 95% of offered, its core is not saturated, and ITL p99 stays near the pace.

    python benchmarks/loadgen_ceiling.py                      # 256 streams, 20k/40k/80k chunks/s + unpaced
    python benchmarks/loadgen_ceiling.py --rates 20000 --duration-s 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import psutil

from benchsuite.load.loadgen import LoadSpec, run_load
from benchsuite.measure.metrics import itls_s, percentile
from benchsuite.records import LoadRequest
from benchsuite.run.process import EngineProcess, free_port

FAKE_SERVER = Path(__file__).resolve().parent.parent / "tests" / "fakes.py"


@dataclass(frozen=True)
class Phase:
    offered_chunks_per_s: float | None  # None: unpaced
    paced_itl_s: float
    requests: int
    chunks: int
    errors: int
    wall_s: float
    achieved_chunks_per_s: float
    client_cpu_frac: float
    chunks_per_client_cpu_s: float
    itl_p50_s: float | None
    itl_p99_s: float | None
    server_cpu_frac: float

    @property
    def keeps_up(self) -> bool:
        if self.offered_chunks_per_s is None:
            return False
        return (
            self.errors == 0
            and self.achieved_chunks_per_s >= 0.95 * self.offered_chunks_per_s
            and self.client_cpu_frac < 0.95
        )


def _cpu_plan(server_workers: int) -> tuple[int, list[int]]:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    client = cpus[0]
    others = cpus[1:] or cpus
    return client, others[: max(server_workers, 1)]


def _server_cpu_s(pid: int) -> float:
    total = 0.0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            times = proc.cpu_times()
            total += times.user + times.system
    except psutil.Error:
        pass
    return total


async def _phase(
    session: aiohttp.ClientSession,
    url: str,
    server_pid: int,
    streams: int,
    output_tokens: int,
    offered: float | None,
    duration_s: float,
) -> Phase:
    itl_s = streams / offered if offered else 0.0
    per_request_s = output_tokens * itl_s
    rounds = max(2, math.ceil(duration_s / per_request_s)) if per_request_s > 0 else 4
    requests = [LoadRequest(f"c{i}", "ceiling", "x", output_tokens) for i in range(streams * rounds)]
    cpu0, server0, wall0 = time.process_time(), _server_cpu_s(server_pid), time.perf_counter()
    records = await run_load(
        url,
        requests,
        LoadSpec(concurrency=streams, timeout_s=120),
        cell_id="ceiling",
        model_name="fake",
        extras={"fake_itl_s": itl_s},
        cold_first=False,
        session=session,
    )
    wall_s = time.perf_counter() - wall0
    cpu_s = time.process_time() - cpu0
    server_s = _server_cpu_s(server_pid) - server0
    chunks = sum(r.streamed_chunks for r in records)
    window_s = max(r.t_done_s or r.t_sent_s for r in records) - min(r.t_sent_s for r in records)
    gaps = [g for r in records if r.ok for g in itls_s(r)]
    return Phase(
        offered_chunks_per_s=offered,
        paced_itl_s=itl_s,
        requests=len(records),
        chunks=chunks,
        errors=sum(1 for r in records if not r.ok),
        wall_s=wall_s,
        achieved_chunks_per_s=chunks / window_s,
        client_cpu_frac=cpu_s / wall_s,
        chunks_per_client_cpu_s=chunks / cpu_s if cpu_s > 0 else float("inf"),
        itl_p50_s=percentile(gaps, 50),
        itl_p99_s=percentile(gaps, 99),
        server_cpu_frac=server_s / wall_s,
    )


async def _measure(args: argparse.Namespace, url: str, server_pid: int) -> list[Phase]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        # Open every connection before measuring (keep-alive reuses them afterwards).
        warm = [LoadRequest(f"w{i}", "ceiling", "x", 4) for i in range(args.streams)]
        await run_load(
            url,
            warm,
            LoadSpec(concurrency=args.streams),
            cell_id="warm",
            model_name="fake",
            extras={},
            cold_first=False,
            session=session,
        )
        offered: list[float | None] = [*args.rates]
        if not args.no_unpaced:
            offered.append(None)
        phases = []
        for rate in offered:
            phase = await _phase(session, url, server_pid, args.streams, args.output_tokens, rate, args.duration_s)
            phases.append(phase)
            _print_row(phase)
        return phases


def _fmt_ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1e3:.2f}"


def _print_header(streams: int, client_cpu: int, server_cpus: list[int]) -> None:
    print(
        f"load generator ceiling: {streams} streams, client pinned to CPU {client_cpu}, "
        f"fake server on CPUs {server_cpus}"
    )
    print(
        f"{'offered/s':>10} {'achieved/s':>11} {'client cpu':>10} {'chunks/cpu-s':>12} "
        f"{'pace ms':>8} {'itl p50 ms':>10} {'itl p99 ms':>10} {'server cpu':>10} {'errors':>6} {'keeps up':>8}"
    )


def _print_row(p: Phase) -> None:
    offered = "unpaced" if p.offered_chunks_per_s is None else f"{p.offered_chunks_per_s:,.0f}"
    keeps = "-" if p.offered_chunks_per_s is None else ("yes" if p.keeps_up else "NO")
    print(
        f"{offered:>10} {p.achieved_chunks_per_s:>11,.0f} {p.client_cpu_frac:>10.0%} "
        f"{p.chunks_per_client_cpu_s:>12,.0f} {_fmt_ms(p.paced_itl_s):>8} {_fmt_ms(p.itl_p50_s):>10} "
        f"{_fmt_ms(p.itl_p99_s):>10} {p.server_cpu_frac:>10.0%} {p.errors:>6} {keeps:>8}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[20000.0, 40000.0, 80000.0],
        help="comma-separated offered chunks/s (all streams together)",
    )
    parser.add_argument("--no-unpaced", action="store_true", help="skip the unpaced phase")
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--duration-s", type=float, default=8.0, help="approximate length of each paced phase")
    parser.add_argument("--server-workers", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the phases here")
    args = parser.parse_args(argv)

    client_cpu, server_cpus = _cpu_plan(args.server_workers)
    port = free_port()
    argv_server = [
        sys.executable,
        str(FAKE_SERVER),
        "--port",
        str(port),
        "--workers",
        str(args.server_workers),
        "--cpus",
        ",".join(map(str, server_cpus)),
    ]
    log = Path(tempfile.mkdtemp(prefix="loadgen-ceiling-")) / "fake.log"
    with EngineProcess(argv_server, None, log, f"http://127.0.0.1:{port}/health", 30) as server:
        asyncio.run(server.wait_ready())
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {client_cpu})
        assert server.pid is not None
        _print_header(args.streams, client_cpu, server_cpus)
        phases = asyncio.run(_measure(args, f"http://127.0.0.1:{port}", server.pid))
    paced_ok = [p for p in phases if p.keeps_up]
    best = max(phases, key=lambda p: p.chunks_per_client_cpu_s)
    if paced_ok:
        top = max(paced_ok, key=lambda p: p.achieved_chunks_per_s)
        print(
            f"ceiling: the client kept up with {top.achieved_chunks_per_s:,.0f} chunks/s over {args.streams} "
            f"streams using {top.client_cpu_frac:.0%} of one core"
        )
    else:
        print(f"ceiling: the client kept up with none of the paced rates at {args.streams} streams")
    offered = "unpaced" if best.offered_chunks_per_s is None else f"{best.offered_chunks_per_s:,.0f}/s offered"
    print(
        f"one-core estimate: {best.chunks_per_client_cpu_s:,.0f} chunks per client CPU-second (best phase, {offered})"
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(p) | {"keeps_up": p.keeps_up} for p in phases], indent=2))
    return 0 if paced_ok else 1


if __name__ == "__main__":
    sys.exit(main())
