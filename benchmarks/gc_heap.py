"""What the garbage collector walks in a loaded built-in server, and what a full collection of it costs,
with the server's heap freeze (`--enable-gc-freeze`, the default) and without it.

    PYTHONPATH=$PWD python benchmarks/gc_heap.py > benchmarks/results/cpu/2026-12-03-gc-heap.txt

The model is the H200 staging runs' structure, 48 layers x 128 experts, top-8, block-FP8 experts
(`qwen3-30b-a3b-fp8-shape`, a weightless directory: seeded weights built at load), with the dims cut so it
fits a CPU box (hidden 256, moe_intermediate 128, 4 heads of 64, 1 KV head): the objects the collector
tracks depend on the layers, experts and tensors, not on the tensors' sizes.

Each configuration runs in a process of its own (the script runs itself with `--child`). The server starts
in that process as `python -m paged_experts.server` starts it (`app.create_app` on a loopback port: the model
loads in a worker thread, then the freeze, then `/health` answers 200), mode paged, K=32, bfloat16, CPU.
Then it serves one request of a 2,048-token prompt and 64 output tokens, then 7 more (8, as in an H200
staging cell), one at a time. At each phase:
- tracked objects: `len(gc.get_objects())` after a full collection (the frozen ones are not in it);
- frozen objects: `gc.get_freeze_count()`;
- a full collection, `gc.collect(2)`, timed 5 times: the median and the least of the thread's CPU time
  (`time.thread_time`, what the server's GC clock counts) and of the wall time;
- the most numerous types, and the types the phase added most of;
- over the requests, the server's own GC clock (`gc_pauses`): collections per generation and their CPU time.
With `--compile-batches N` (the second pair of configurations) the process first torch.compiles the two
blocks an H200 server compiles with the triton backend (`attention.attention_in`, `attention.attention_out`)
for batch 1..N on the CPU, at this model's dims, before the server loads (the GPU server compiles during its
load, so its freeze takes that state too): what compiled state adds to the heap. Each process compiles with
an empty inductor cache (a server's first start; a warm cache adds fewer objects). CPU inductor writes C++
where the GPU's writes Triton; dynamo, FX and the guards are the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# (name, server gc_freeze, compile batches): plain servers, then ones whose process compiled the blocks first
CONFIGURATIONS: tuple[tuple[str, bool, int], ...] = (
    ("freeze off", False, 0),
    ("freeze on", True, 0),
    ("freeze off, compiled", False, 4),
    ("freeze on, compiled", True, 4),
)
SMALL_DIMS = {"hidden_size": 256, "moe_intermediate_size": 128, "intermediate_size": 1024, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": 64}  # fmt: skip
TOP_TYPES = 12
REPEATS = 5


def write_model(out: Path, layers: int) -> Path:
    """A weightless fp8-shape directory (48 x 128 experts) with SMALL_DIMS in its config.json."""
    from paged_experts.weights.synth_memory import write_weightless

    model = write_weightless("qwen3-30b-a3b-fp8-shape", out, layers=layers)
    config = json.loads((model / "config.json").read_text())
    config.update(SMALL_DIMS)
    (model / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model


# ---- one configuration, in its own process ----


def type_name(obj: object) -> str:
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def full_collection_s() -> dict[str, float]:
    """gc.collect(2) REPEATS times: median and least thread CPU and wall seconds."""
    cpu, wall = [], []
    for _ in range(REPEATS):
        c0, w0 = time.thread_time(), time.perf_counter()
        gc.collect(2)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"cpu_median": statistics.median(cpu), "cpu_min": min(cpu), "wall_median": statistics.median(wall),
            "wall_min": min(wall)}  # fmt: skip


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms" if seconds >= 1e-3 else f"{1e3 * seconds:.3f} ms"


Phase = tuple[dict[str, Any], collections.Counter[str]]


def phase(label: str, before: Phase | None) -> Phase:
    """Prints one phase's figures; returns them and its type counts (the next phase's growth is against them)."""
    gc.collect()
    types = collections.Counter(type_name(o) for o in gc.get_objects())
    timing = full_collection_s()
    figures = {"phase": label, "tracked": sum(types.values()), "frozen": gc.get_freeze_count(), **timing}
    print(f"-- {label}: {figures['tracked']:,} tracked, {figures['frozen']:,} frozen; gc.collect(2) CPU "
          f"{ms(timing['cpu_median'])} median ({ms(timing['cpu_min'])} least), wall {ms(timing['wall_median'])} "
          f"({ms(timing['wall_min'])})")  # fmt: skip
    print("   most numerous: " + ", ".join(f"{name} {n:,}" for name, n in types.most_common(TOP_TYPES)))
    if before is not None:
        previous, previous_types = before
        if figures["frozen"] > previous["frozen"]:  # the walked objects' growth means nothing across a freeze
            total = figures["tracked"] + figures["frozen"] - previous["tracked"] - previous["frozen"]
            print(f"   tracked or frozen {total:+,} since the last phase; the freeze took {figures['frozen']:,} out")
        else:
            grown = (types - previous_types).most_common(TOP_TYPES)
            added = figures["tracked"] - previous["tracked"]
            print(f"   added {added:+,}; most: " + ", ".join(f"{name} +{n:,}" for name, n in grown))
    sys.stdout.flush()
    return figures, types


def compile_blocks(model_dir: Path, batches: int) -> float:
    """torch.compile attention_in / attention_out for batch 1..`batches` at the model's dims; seconds taken."""
    import torch

    from paged_experts.attention import attention_in, attention_out

    cfg = json.loads((model_dir / "config.json").read_text())
    h, nh, kvh, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e, eps, dt = cfg["num_experts"], cfg["rms_norm_eps"], torch.bfloat16
    fn_in = torch.compile(attention_in, dynamic=False)
    fn_out = torch.compile(attention_out, dynamic=False)
    kv_k, kv_v = torch.zeros(64, kvh, d, dtype=dt), torch.zeros(64, kvh, d, dtype=dt)  # [slots, kvh, D]
    t0 = time.perf_counter()
    for b in range(1, batches + 1):
        x = torch.randn(b, h, dtype=dt)  # [B, H]
        q = fn_in(x, torch.ones(h, dtype=dt), torch.randn((nh + 2 * kvh) * d, h, dtype=dt), torch.ones(d, dtype=dt),
                  torch.ones(d, dtype=dt), kv_k, kv_v, torch.ones(b, d, dtype=dt), torch.zeros(b, d, dtype=dt),
                  torch.arange(b), nh, kvh, d, eps)  # fmt: skip  # [B, nh, D]
        fn_out(x, q.reshape(b, nh * d), torch.randn(h, nh * d, dtype=dt), torch.ones(h, dtype=dt),
               torch.randn(e, h, dtype=dt), eps)  # fmt: skip
    return time.perf_counter() - t0


async def serve_and_measure(args: argparse.Namespace, figures: list[dict[str, Any]], last: Phase) -> dict[str, Any]:
    import aiohttp
    from aiohttp.test_utils import TestServer

    from paged_experts.server.app import create_app
    from paged_experts.server.gc_pauses import GcPauseClock
    from paged_experts.server.options import ServeOptions

    options = ServeOptions(model_path=str(args.model_dir), mode="paged", resident_experts=args.resident_experts,
                           dtype="bfloat16", max_running_requests=8, gc_freeze=args.gc_freeze)  # fmt: skip
    t0 = time.perf_counter()
    server = TestServer(create_app(options), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        while True:
            async with http.get(f"{url}/health") as resp:
                if resp.status == 200:
                    break
            await asyncio.sleep(0.1)
        print(f"   server ready in {time.perf_counter() - t0:.1f} s")
        last = phase("server ready (loaded; frozen when on)", last)
        figures.append(last[0])
        vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        body = {"max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True}
        request_s: list[float] = []
        watch = GcPauseClock()  # the requests' collections only: this script's own are outside install/uninstall
        watch.install()
        for i in range(args.requests):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
            t_req = time.perf_counter()
            async with http.post(f"{url}/v1/completions", json={**body, "prompt": prompt}) as resp:
                answer = await resp.json()
            request_s.append(time.perf_counter() - t_req)
            assert resp.status == 200 and answer["usage"]["completion_tokens"] == args.output_tokens, answer
            if i == 0:
                watch.uninstall()
                clocks = {"request 1": _clock(watch)}
                last = phase(f"after 1 request ({args.prompt_tokens} + {args.output_tokens} tokens)", last)
                figures.append(last[0])
                watch = GcPauseClock()
                watch.install()
        watch.uninstall()
        clocks[f"requests 2..{args.requests}"] = _clock(watch)
        print(f"   request seconds: {', '.join(f'{s:.1f}' for s in request_s)}")
        for span, c in clocks.items():
            print(f"   GC during {span}: collections per generation {c['collections']}, CPU {ms(c['pause_s'])}, "
                  f"longest {ms(c['max_pause_s'])}")  # fmt: skip
        last = phase(f"after {args.requests} requests", last)
        figures.append(last[0])
        async with http.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
        frozen_line = next(line for line in metrics.splitlines() if line.startswith("paged_experts:gc_frozen_objects"))
        print(f"   /metrics {frozen_line}")
    await server.close()
    return {"clocks": clocks, "request_s": request_s}


def _clock(watch: Any) -> dict[str, Any]:
    totals = watch.snapshot()
    return {"collections": list(totals.collections), "pause_s": sum(totals.pause_s), "max_pause_s": totals.max_pause_s}


def child(args: argparse.Namespace) -> int:
    import torch

    import paged_experts.server.app  # noqa: F401  (the server's imports, before the first phase)

    torch.set_num_threads(args.cpu_threads)
    figures: list[dict[str, Any]] = []
    last = phase("imports (torch, the server)", None)
    figures.append(last[0])
    if args.compile_batches:
        seconds = compile_blocks(args.model_dir, args.compile_batches)
        print(f"   torch.compile attention_in + attention_out, batch 1..{args.compile_batches}: {seconds:.0f} s")
        last = phase("compiled (before the server loads)", last)
        figures.append(last[0])
    served = asyncio.run(serve_and_measure(args, figures, last))
    print("SUMMARY " + json.dumps({"phases": figures, **served}))
    return 0


# ---- the parent: every configuration, then a summary table ----


def provenance() -> str:
    import torch

    from benchsuite.tools.machine import git_facts

    git = git_facts()
    return (f"commit {git.commit}{' (dirty)' if git.dirty else ''}, python {platform.python_version()}, "
            f"torch {torch.__version__}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
            f"load average {os.getloadavg()[0]:.1f} at start")  # fmt: skip


def run_all(args: argparse.Namespace) -> int:
    print(f"# benchmarks/gc_heap.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"# {provenance()}")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "q48-fp8-small", args.layers)
        print(f"# model: qwen3-30b-a3b-fp8-shape, {args.layers} layers, dims {SMALL_DIMS}; mode paged, "
              f"K={args.resident_experts}, bfloat16, CPU; {args.requests} requests of {args.prompt_tokens} + "
              f"{args.output_tokens} tokens")  # fmt: skip
        summaries: dict[str, dict[str, Any]] = {}
        for i, (name, freeze, batches) in enumerate(CONFIGURATIONS):
            print(f"\n== {name}", flush=True)
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor-{i}"}  # each compiles cold
            argv = [sys.executable, __file__, "--child", "--model-dir", str(model), "--compile-batches",
                    str(batches), "--gc-freeze" if freeze else "--no-gc-freeze", *_shared_argv(args)]  # fmt: skip
            done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
            for line in done.stdout.splitlines():
                if line.startswith("SUMMARY "):
                    summaries[name] = json.loads(line.removeprefix("SUMMARY "))
                else:
                    print(line)
            if done.returncode != 0:
                print(done.stderr[-4000:])
                return done.returncode
    print(summary_table(summaries))
    return 0


def _shared_argv(args: argparse.Namespace) -> list[str]:
    return ["--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
            str(args.output_tokens), "--resident-experts", str(args.resident_experts), "--cpu-threads",
            str(args.cpu_threads)]  # fmt: skip


def summary_table(summaries: dict[str, dict[str, Any]]) -> str:
    header = f"{'configuration':<22} {'phase':<40} {'tracked':>9} {'frozen':>9} {'CPU ms':>7} {'wall ms':>8}"
    lines = ["\n== summary: a full collection, gc.collect(2), thread CPU ms (median of 5), and what it walks", header]
    for name, summary in summaries.items():
        for p in summary["phases"]:
            lines.append(f"{name:<22} {p['phase'][:40]:<40} {p['tracked']:>9,} {p['frozen']:>9,} "
                         f"{1e3 * p['cpu_median']:>7.2f} {1e3 * p['wall_median']:>8.2f}")  # fmt: skip
    lines.append("\ncollections while serving (gc_pauses.GcPauseClock): per generation [0, 1, 2], CPU ms, longest ms")
    for name, summary in summaries.items():
        for span, c in summary["clocks"].items():
            lines.append(f"{name:<22} {span:<14} {str(c['collections']):<16} {1e3 * c['pause_s']:>8.1f} "
                         f"{1e3 * c['max_pause_s']:>8.2f}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--resident-experts", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--cpu-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--compile-batches", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    return child(args) if args.child else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
