"""Where a decode step's time goes: torch.profiler over a few decode steps of a synthetic model,
per mode variant, kernels sorted by device time (the question behind a slow tok/s figure). With
`--prefill-tokens N` the profiled step is instead one prompt of N random tokens on a fresh sequence
(a paged prompt of more than K / top_k tokens runs the host-planned waves: where a TTFT goes).

    python benchmarks/profile_step.py --layers 4 --variants resident,resident/graphs,paged:32/graphs --out prof.txt
    python benchmarks/profile_step.py --layers 8 --preset qwen3-30b-a3b-fp8-shape --routing qwen3-30b-a3b \
        --variants resident/graphs+triton,paged:54/graphs+triton --out decode.txt
    python benchmarks/profile_step.py --layers 8 --preset qwen3-30b-a3b-fp8-shape --variants resident,paged:42 \
        --prefill-tokens 2048 --steps 3 --host-profile 25 --out prefill.txt --trace-dir traces
(with --prefill-tokens and --trace-dir, each variant's layer boundaries too: benchmarks/prefill_timeline.py)
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_h200 import apply_plan_option, parse_variant, runtime_for  # noqa: E402
from prefill_timeline import layer_boundaries, summary  # noqa: E402

from paged_experts.kv import KvPool  # noqa: E402
from paged_experts.model import MoeCausalLM, SeqChunk  # noqa: E402
from paged_experts.routing.sources import SyntheticRouter, make_router  # noqa: E402


def stream_summary(trace: dict, steps: int) -> str:
    """Per CUDA stream: kernel time per step, and the span from the first to the last kernel per
    step; where the main stream's busy time is below the span, the step waited (on a copy, or the host)."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return "  (no kernel events)"
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    out = [f"  kernels over {steps} steps: span {(end - start) / 1e3 / steps:.3f} ms/step"]
    for tid in sorted({e["tid"] for e in kernels}, key=str):
        mine = [e for e in kernels if e["tid"] == tid]
        busy_us = sum(e["dur"] for e in mine)
        top: dict[str, float] = {}
        for e in mine:
            top[e["name"][:40]] = top.get(e["name"][:40], 0.0) + e["dur"]
        names = ", ".join(f"{n} {us / 1e3 / steps:.3f}" for n, us in sorted(top.items(), key=lambda kv: -kv[1])[:4])
        out.append(
            f"  stream {tid}: {len(mine) / steps:.0f} kernels, busy {busy_us / 1e3 / steps:.3f} ms/step ({names})"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variants", default="resident,resident/graphs,paged:32,paged:32/graphs")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="qwen3-30b-a3b-shape")
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--prefill-tokens", type=int, default=0,
                    help="profile one prompt of this many tokens per step instead of decode steps")  # fmt: skip
    ap.add_argument("--copy-programs", type=int, default=None,
                    help="paged modes planned on the device: the page-in copy kernel's grid cap")  # fmt: skip
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also the host's N costliest functions (cProfile, own time) over more steps")  # fmt: skip
    ap.add_argument("--host-stats", type=Path, default=None, metavar="DIR",
                    help="with --host-profile, each variant's whole cProfile stats here (VARIANT.prof)")  # fmt: skip
    ap.add_argument("--routing", default=None, metavar="SPEC",
                    help="a synthetic routing source (e.g. qwen3-30b-a3b, the calibrated one) instead of the "
                         "random model's own router, as a server's --routing-source")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--trace-dir", type=Path, default=None, help="also write each variant's Chrome trace (.json.gz) here"
    )
    args = ap.parse_args(argv)
    lines: list[str] = []
    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sort_key = "cuda_time_total" if cuda else "cpu_time_total"
    for spec in args.variants.split(","):
        mode, options = parse_variant(spec)
        runtime = runtime_for(mode, args.device, options, args.copy_programs)
        model = MoeCausalLM.synthetic(args.preset, runtime, layers=args.layers, seed=0)
        apply_plan_option(model, options)
        router = None
        if args.routing is not None:  # before the graphs: their captured steps take the router's ids as input
            router = make_router(args.routing, model.config, 0)
            model.router_override = router
        if "graphs" in options:
            model.enable_cuda_graphs([args.batch], compile_layers="compile" in options)
        pool = KvPool.for_model(model, capacity_tokens=max(args.batch * 128, args.prefill_tokens + 16))
        seqs = [pool.new_sequence() for _ in range(args.batch)]
        logits = model.forward([SeqChunk(s, [1 + b, 2, 3], 0) for b, s in enumerate(seqs)])
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size

        def step(
            model: MoeCausalLM = model,
            seqs: list = seqs,
            pool: KvPool = pool,
            router: SyntheticRouter | None = router,
            gen: torch.Generator = gen,
            vocab: int = vocab,
        ) -> None:  # this variant's objects, bound now
            nonlocal logits
            if args.prefill_tokens:  # one fresh prompt: the previous one's KV rows freed first
                for s in seqs:
                    pool.free(s)
                    if router is not None:  # its per-sequence state, as a server's free hook drops it
                        router.forget(s.seq_id)
                seqs[:] = [pool.new_sequence()]
                prompt = torch.randint(0, vocab, (args.prefill_tokens,), generator=gen).tolist()
                logits = model.forward([SeqChunk(seqs[0], prompt, 0)])
                return
            logits = model.forward([SeqChunk(s, [int(lg[-1].argmax())], s.num_tokens) for s, lg in zip(seqs, logits)])

        for _ in range(3):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        wall_ms = 1e3 * (time.perf_counter() - t0) / args.steps
        host = cProfile.Profile() if args.host_profile else None
        if host is not None:  # steps of their own: the wall above stays unprofiled
            host.enable()
            for _ in range(args.steps):
                step()
            sync()
            host.disable()
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            sync()
        table = prof.key_averages().table(sort_by=sort_key, row_limit=args.rows, max_name_column_width=70)
        what = f"one {args.prefill_tokens}-token prompt" if args.prefill_tokens else f"batch {args.batch}"
        override = model.router_override  # what the steps were routed by, not what was asked for
        routing = f"routing {override.spec} (synthetic)" if isinstance(override, SyntheticRouter) else (
            "the model's own routing"
        )  # fmt: skip
        head = (
            f"=== {spec}: {args.layers} layers, {what}, {routing}, {wall_ms:.2f} ms/step wall (unprofiled), "
            f"replays {model.graph_replays}"
        )
        print(head, flush=True)
        lines += [head, table]
        if host is not None:  # where the host's time goes (a host-bound step: the GPU waits on it)
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(args.host_profile)
            lines.append(f"host, {args.steps} more steps under cProfile (it slows the host):")
            lines.append(text.getvalue())
            if args.host_stats is not None:  # the whole profile, for pstats here (sort by cumulative, callers, ...)
                args.host_stats.mkdir(parents=True, exist_ok=True)
                host.dump_stats(
                    str(args.host_stats / (spec.replace("/", "_").replace(":", "").replace("+", "-") + ".prof"))
                )
        if args.trace_dir is not None and cuda:
            args.trace_dir.mkdir(parents=True, exist_ok=True)
            raw = args.trace_dir / (spec.replace("/", "_").replace(":", "").replace("+", "-") + ".json")
            prof.export_chrome_trace(str(raw))
            trace = json.loads(raw.read_text())
            streams = stream_summary(trace, args.steps)
            if args.prefill_tokens:  # where the link idles at each layer boundary (prefill_timeline.py)
                streams += "\n" + summary(layer_boundaries(trace))
            with gzip.open(f"{raw}.gz", "wt") as f:
                f.write(raw.read_text())
            raw.unlink()
            print(streams, flush=True)
            lines.append(streams)
        args.out.write_text("\n".join(lines))
        del model
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
