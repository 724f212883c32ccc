"""Decode tok/s of the built-in server at concurrency 1 and 4 (or any list), over real HTTP.

Either measures a running server (`--url`) or starts `python -m paged_experts.server` itself on a
free loopback port with the flags after `--`, in its own session, and kills the group at the end:

    python benchmarks/serve_decode.py --model tiny --out decode.json
    python benchmarks/serve_decode.py --model /ckpt/qwen3-30b-a3b-shape --out paged32.json \
        -- --device cuda --mode paged --resident-experts 32 --max-total-tokens 10240

Every request streams (`stream_options.include_usage`), is greedy with `ignore_eos`, and has a
distinct token-id prompt of `--prompt-tokens` tokens. Definitions, per request:
- ttft_s = first non-empty text chunk - request sent;
- decode_tok_s = (completion_tokens - 1) / (last chunk - first text chunk), tokens from `usage`;
per round of `c` concurrent requests: aggregate decode tok/s = sum of the requests' decode_tok_s,
and wall output tok/s = all completion tokens / round wall time (prefill included).
A warmup round at each concurrency is discarded. Paging counters are the server's
`/metrics` deltas over the measured rounds (hit rate = hits / (hits + misses)).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchsuite.machine import git_facts, machine_facts

SCHEMA_VERSION = 1
COUNTERS = ("expert_hits_total", "expert_misses_total", "expert_activations_total", "bytes_paged_total",
            "copy_seconds_total", "waves_total", "moe_steps_total", "union_experts_total", "routed_pairs_total",
            "generation_tokens_total")  # fmt: skip


@dataclass(frozen=True)
class RequestTiming:
    completion_tokens: int
    ttft_s: float
    decode_s: float  # first text chunk -> last chunk
    e2e_s: float

    @property
    def decode_tok_s(self) -> float | None:
        return (self.completion_tokens - 1) / self.decode_s if self.completion_tokens > 1 and self.decode_s > 0 else None


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first = last = None
    tokens = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            if event["choices"] and event["choices"][0]["text"]:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
    end = time.perf_counter()
    if tokens is None or first is None or last is None:
        raise RuntimeError("stream ended without usage or without any text: a failed request, not a zero")
    return RequestTiming(tokens, first - t0, last - first, end - t0)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("paged_experts:") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("paged_experts:")] = float(value)
    return out


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


async def measure(url: str, concurrencies: list[int], args: argparse.Namespace) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{url}/server_info") as resp:
            info = await resp.json()
        vocab = int(info["model"]["vocab_size"])
        results = []
        for c in concurrencies:
            warm = prompts(c, args.prompt_tokens, vocab, seed=10_000 + c)
            await asyncio.gather(*(one_request(session, url, p, min(8, args.max_tokens)) for p in warm))
            before = await scrape(session, url)
            rounds = []
            for r in range(args.rounds):
                batch = prompts(c, args.prompt_tokens, vocab, seed=c * 1000 + r)
                t0 = time.perf_counter()
                timings = await asyncio.gather(*(one_request(session, url, p, args.max_tokens) for p in batch))
                rounds.append((time.perf_counter() - t0, timings))
            after = await scrape(session, url)
            results.append(summarize(c, rounds, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}))
            print(f"concurrency {c}: decode {results[-1]['decode_tok_s_aggregate_median']:.1f} tok/s aggregate, "
                  f"{results[-1]['decode_tok_s_per_stream_median']:.1f} tok/s per stream, "
                  f"TTFT p50 {results[-1]['ttft_s_median'] * 1e3:.1f} ms, hit rate {results[-1]['hit_rate']}")  # fmt: skip
            write_record(args, {"server_info": info, "results": results}, complete=False)  # a later kill loses nothing
    return {"server_info": info, "results": results}


def write_record(args: argparse.Namespace, body: dict[str, Any], complete: bool) -> None:
    """The results file, rewritten after every concurrency level (`complete` false until the end)."""
    record = {**args.record_base, "complete": complete, "routing": body["server_info"]["routing"], **body}
    Path(args.out).write_text(json.dumps(record, indent=2))


def summarize(c: int, rounds: list[tuple[float, list[RequestTiming]]], delta: dict[str, float]) -> dict[str, Any]:
    per_stream = [t.decode_tok_s for _, ts in rounds for t in ts if t.decode_tok_s is not None]
    aggregate = [sum(t.decode_tok_s or 0.0 for t in ts) for _, ts in rounds]
    wall = [sum(t.completion_tokens for t in ts) / w for w, ts in rounds]
    served = delta["expert_hits_total"] + delta["expert_misses_total"]
    return {
        "concurrency": c,
        "rounds": len(rounds),
        "decode_tok_s_per_stream_median": statistics.median(per_stream),
        "decode_tok_s_aggregate_median": statistics.median(aggregate),
        "decode_tok_s_aggregate_rounds": aggregate,
        "output_tok_s_wall_median": statistics.median(wall),
        "ttft_s_median": statistics.median(t.ttft_s for _, ts in rounds for t in ts),
        "hit_rate": delta["expert_hits_total"] / served if served else None,
        "waves_per_moe_step": delta["waves_total"] / delta["moe_steps_total"] if delta["moe_steps_total"] else None,
        "union_per_moe_step": delta["union_experts_total"] / delta["moe_steps_total"] if delta["moe_steps_total"] else None,
        "counters_delta": delta,
        "requests": [asdict(t) for _, ts in rounds for t in ts],
    }


def start_server(model: str, server_args: list[str], log_path: Path) -> tuple[subprocess.Popen[bytes], str, list[str]]:
    from benchsuite.process import free_port

    if model == "tiny":
        from paged_experts.synth import ensure_tiny

        model = str(ensure_tiny())
    port = free_port()
    argv = [sys.executable, "-m", "paged_experts.server.app", "--model-path", model, "--host", "127.0.0.1",
            "--port", str(port), *server_args]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", argv


async def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; log {log_path}:\n{log_path.read_text()[-2000:]}")
            try:
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s} s; log {log_path}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def run(args: argparse.Namespace, server_args: list[str]) -> dict[str, Any]:
    if args.url:
        return {"server_argv": None, **await measure(args.url.rstrip("/"), args.concurrency, args)}
    log_path = Path(args.out).with_suffix(".server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc, url, argv = start_server(args.model, server_args, log_path)
    try:
        await wait_ready(proc, url, args.startup_timeout_s, log_path)
        return {"server_argv": argv, "server_log": str(log_path), **await measure(url, args.concurrency, args)}
    finally:
        stop_server(proc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000")
    target.add_argument("--model", help="checkpoint directory (or 'tiny') for a server this script starts")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--request-timeout-s", type=float, default=1800.0)
    args = p.parse_args(own)
    args.record_base = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "serve_decode",
        "command": ["python", "benchmarks/serve_decode.py", *argv],
        "started_unix_s": time.time(),
        "settings": {k: v for k, v in vars(args).items()},
        "machine": machine_facts(),
        "git": git_facts(),
    }
    body = asyncio.run(run(args, server_args))
    write_record(args, body, complete=True)
    print(f"wrote {args.out} (routing: {body['server_info']['routing']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
