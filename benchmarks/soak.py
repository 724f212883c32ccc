"""Soak test of the built-in server: many streams and abandoned requests for minutes, then checks.

Starts `python -m paged_experts.server` itself (benchsuite.run.process.EngineProcess: own session,
free loopback port, group kill at the end) on the tiny checkpoint unless `--model` says otherwise,
and drives it with:
- `--streams` closed-loop clients (default 64), each sending streamed completions one after
  another (random max_tokens in [4, --max-tokens]) and reading every chunk to [DONE];
- every `--burst-every-s` seconds, a burst of `--burst-size` streamed requests that the client
  abandons mid-stream (closes the connection after its first content chunk).

Figures (JSON on stdout or --out):
- requests_ok / requests_failed: completed streams of the closed-loop clients, and the failed ones
  (HTTP error, broken or empty stream); abandoned: burst requests dropped after a first chunk;
- rss_start_mib / rss_end_mib / rss_peak_mib: the server's resident memory (psutil; the process
  and its children) after the warmup phase (`--warmup-s`), after the load, and the highest sample;
- kv_used_tokens_idle / kv_capacity_tokens: `paged_experts:kv_used_tokens` and
  `paged_experts:kv_capacity_tokens` from /metrics once the load has stopped and the server is idle
  (num_running_reqs and num_queue_reqs 0; waits up to idle_timeout_s);
- server_aborted_requests / server_generation_tokens: the server's own counters at the end (every
  abandoned request should show up as aborted);
- server_alive / healthy_after: the process still runs and /health answers 200.
`ok` is true when the server is alive and healthy, no request failed, and the idle KV is empty.

    python benchmarks/soak.py --minutes 3 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil

from benchsuite.run.process import EngineProcess, free_port
from benchsuite.tools.scrape import parse_prometheus

MIB = 1024 * 1024
KV_USED = "paged_experts:kv_used_tokens"
KV_CAPACITY = "paged_experts:kv_capacity_tokens"
IDLE_GAUGES = ("paged_experts:num_running_reqs", "paged_experts:num_queue_reqs", KV_USED)
PROMPTS = (
    "The history of the printing press shows that",
    "A good way to learn a new programming language is",
    "In the early morning the harbour was quiet and",
    "The rules of chess say that a pawn",
)


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float
    streams: int = 64
    max_tokens: int = 48
    burst_every_s: float = 5.0
    burst_size: int = 16
    warmup_s: float = 5.0
    idle_timeout_s: float = 60.0
    model: str | None = None  # checkpoint directory; None: the generated tiny model
    server_args: tuple[str, ...] = ("--mode", "paged", "--paged-experts-num-resident", "8")
    kv_capacity_tokens: int = 8192
    seed: int = 0


@dataclass
class SoakResult:
    duration_s: float
    streams: int
    requests_ok: int = 0
    requests_failed: int = 0
    abandoned: int = 0
    completion_tokens: int = 0
    rss_start_mib: float | None = None
    rss_end_mib: float | None = None
    rss_peak_mib: float | None = None
    server_aborted_requests: float | None = None  # paged_experts:num_aborted_requests_total at the end
    server_generation_tokens: float | None = None  # paged_experts:generation_tokens_total at the end
    kv_used_tokens_idle: float | None = None
    kv_capacity_tokens: float | None = None
    server_alive: bool = False
    healthy_after: bool = False
    failures: list[str] = field(default_factory=list)  # the first few failure descriptions

    @property
    def rss_growth_mib(self) -> float | None:
        if self.rss_start_mib is None or self.rss_end_mib is None:
            return None
        return self.rss_end_mib - self.rss_start_mib

    @property
    def ok(self) -> bool:
        return (
            self.server_alive
            and self.healthy_after
            and self.requests_failed == 0
            and self.requests_ok > 0
            and self.kv_used_tokens_idle == 0
        )

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "rss_growth_mib": self.rss_growth_mib, "ok": self.ok}


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process and its children, MiB; None once it is gone."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs) / MIB
    except psutil.Error:
        return None


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(f"{base}/metrics") as resp:
        resp.raise_for_status()
        return parse_prometheus(await resp.text())


async def _stream(session: aiohttp.ClientSession, base: str, body: dict[str, object], abandon: bool) -> int:
    """Send one streamed completion; the completion tokens read (abandon: stop after one chunk)."""
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        tokens, done = 0, False
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            if abandon and event.get("choices") and event["choices"][0].get("text"):
                resp.close()  # drop the connection mid-stream; the server must free the request
                return 0
        if not done or tokens == 0:
            raise RuntimeError(f"stream ended without [DONE] or usage (tokens {tokens})")
        return tokens


def _body(rng: random.Random, max_tokens: int) -> dict[str, object]:
    return {
        "prompt": rng.choice(PROMPTS),
        "max_tokens": rng.randint(4, max_tokens),
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def drive(base: str, config: SoakConfig, pid: int, result: SoakResult) -> None:
    """The load phase: closed-loop streams plus abandoned bursts until the duration ends."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.monotonic()
        end = t0 + config.duration_s

        def fail(what: str) -> None:
            result.requests_failed += 1
            if len(result.failures) < 10:
                result.failures.append(what)

        async def client(index: int) -> None:
            rng = random.Random(config.seed * 1000 + index)
            while time.monotonic() < end:
                try:
                    tokens = await _stream(session, base, _body(rng, config.max_tokens), abandon=False)
                except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as exc:
                    fail(f"stream {index}: {type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.5)
                    continue
                # add after the await: `x += await f()` would read x before awaiting and lose updates
                result.completion_tokens += tokens
                result.requests_ok += 1

        async def bursts() -> None:
            rng = random.Random(config.seed - 1)
            while time.monotonic() + config.burst_every_s < end:
                await asyncio.sleep(config.burst_every_s)
                outcomes = await asyncio.gather(
                    *(
                        _stream(session, base, _body(rng, config.max_tokens), abandon=True)
                        for _ in range(config.burst_size)
                    ),
                    return_exceptions=True,
                )
                result.abandoned += sum(1 for o in outcomes if not isinstance(o, BaseException))
                for o in outcomes:
                    if isinstance(o, BaseException):
                        fail(f"burst: {type(o).__name__}: {o}")

        async def memory() -> None:
            await asyncio.sleep(min(config.warmup_s, config.duration_s / 2))
            result.rss_start_mib = rss_mib(pid)
            while time.monotonic() < end:
                sample = rss_mib(pid)
                if sample is not None:
                    result.rss_peak_mib = max(result.rss_peak_mib or 0.0, sample)
                await asyncio.sleep(1.0)

        await asyncio.gather(*(client(i) for i in range(config.streams)), bursts(), memory())

        # idle: no request running or queued, then read the KV gauges (a missing gauge is never idle)
        deadline = time.monotonic() + config.idle_timeout_s
        values: dict[str, float] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                values = await metrics(session, base)
                if all(values.get(name) == 0 for name in IDLE_GAUGES):
                    break
            await asyncio.sleep(0.2)
        missing = [name for name in (*IDLE_GAUGES, KV_CAPACITY) if name not in values]
        if missing:
            result.failures.append(f"/metrics lacks {', '.join(missing)}")
        result.kv_used_tokens_idle = values.get(KV_USED)
        result.server_aborted_requests = values.get("paged_experts:num_aborted_requests_total")
        result.server_generation_tokens = values.get("paged_experts:generation_tokens_total")
        result.kv_capacity_tokens = values.get(KV_CAPACITY)
        result.rss_end_mib = rss_mib(pid)
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(f"{base}/health") as resp:
                result.healthy_after = resp.status == 200


async def soak(config: SoakConfig, log_dir: Path) -> SoakResult:
    """Start the server, drive it for config.duration_s, check it, always stop it."""
    if config.model is None:
        from paged_experts.weights.synth import ensure_tiny

        model = str(ensure_tiny())
    else:
        model = config.model
    port = free_port()
    argv = [sys.executable, "-m", "paged_experts.server", "--model-path", model, "--port", str(port),
            "--max-running-requests", str(config.streams + config.burst_size),
            "--max-total-tokens", str(config.kv_capacity_tokens), "--log-level", "warning",
            *config.server_args]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    process = EngineProcess(argv, {"PYTHONUNBUFFERED": "1"}, log_dir / "soak-server.log", f"{base}/health", 600.0)
    result = SoakResult(duration_s=config.duration_s, streams=config.streams)
    async with process:
        assert process.pid is not None
        await drive(base, config, process.pid, result)
        result.server_alive = process.alive
        if not result.server_alive:
            result.failures.append(f"server exited ({process.returncode}):\n{process.log_tail()}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--burst-every-s", type=float, default=5.0)
    p.add_argument("--burst-size", type=int, default=16)
    p.add_argument("--warmup-s", type=float, default=10.0, help="load before the first RSS sample")
    p.add_argument("--model", help="checkpoint directory (default: the generated tiny model)")
    p.add_argument("--kv-capacity-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, help="write the figures as JSON here (also printed)")
    p.add_argument("server_args", nargs="*", help="flags for paged_experts.server.app after --")
    args = p.parse_args(argv)
    config = SoakConfig(
        duration_s=args.minutes * 60.0,
        streams=args.streams,
        max_tokens=args.max_tokens,
        burst_every_s=args.burst_every_s,
        burst_size=args.burst_size,
        warmup_s=args.warmup_s,
        model=args.model,
        kv_capacity_tokens=args.kv_capacity_tokens,
        **({"server_args": tuple(args.server_args)} if args.server_args else {}),
    )
    with tempfile.TemporaryDirectory(prefix="soak-") as log_dir:
        result = asyncio.run(soak(config, Path(log_dir)))
    text = json.dumps(result.to_dict(), indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
