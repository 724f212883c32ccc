"""Model-level decode micro-benchmark of the runtime's modes on Qwen3-30B-A3B-shaped layers.

Generates (or takes with --model) a `qwen3-30b-a3b-shape` checkpoint with a few layers, then for
each mode and batch size: one prefill step of B prompts, then `--decode` batched decode steps.
Reported per cell: decode tok/s, prefill seconds, and the runtime's own counters over the decode
steps (hit rate, union and waves per layer-step, host->device bytes per step, copy time share).
Routing is either the checkpoint's router on random weights (`--routing model`: close to uniform,
NOT natural-text locality) or a synthetic routing preset from `paged_experts.routing.sources`; the output
states which. Only the layers present are run, so tok/s is for those layers, not a 48-layer model.

    python benchmarks/paged_decode.py --out decode.json [--layers 4] [--modes resident,paged:16,offload]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights.synth import write_checkpoint


def runtime_for(mode: str, device: str, rows: str = "auto", dtype: str = "bfloat16") -> RuntimeConfig:
    """`rows`: RuntimeConfig.expert_rows (the host store's and device rows' layout of paged and offloaded layers)."""
    common: dict = {"device": device, "dtype": dtype, "expert_rows": rows}
    if mode.startswith("paged:"):
        return RuntimeConfig(mode="paged", resident_experts=int(mode.split(":")[1]), **common)
    if mode.startswith("cpu-experts:"):
        return RuntimeConfig(mode="cpu-experts", cpu_expert_layers=int(mode.split(":")[1]), **common)
    return RuntimeConfig(mode=mode, **common)  # type: ignore[arg-type]


def run_cell(model: MoeCausalLM, batch: int, prompt_tokens: int, decode_steps: int) -> dict[str, float]:
    vocab = model.config.vocab_size
    per_seq_tokens = -(-(prompt_tokens + decode_steps) // 16) * 16
    pool = KvPool.for_model(model, capacity_tokens=batch * per_seq_tokens)
    seqs = [pool.new_sequence() for _ in range(batch)]
    prompts = [[(31 * b + 7 * i) % vocab for i in range(prompt_tokens)] for b in range(batch)]
    t0 = time.perf_counter()
    logits = model.forward([SeqChunk(s, p, 0) for s, p in zip(seqs, prompts)])  # returns CPU logits: synced
    prefill_s = time.perf_counter() - t0
    model.counters.reset()
    t0 = time.perf_counter()
    for _ in range(decode_steps):
        next_ids = [int(lg[-1].argmax()) for lg in logits]
        logits = model.forward([SeqChunk(s, [t], s.num_tokens) for s, t in zip(seqs, next_ids)])
    decode_s = time.perf_counter() - t0
    snap = model.counters.snapshot().total
    layer_steps = max(snap.steps, 1)
    return {
        "batch": batch,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_tok_per_s": batch * decode_steps / decode_s,
        "hit_rate": snap.hit_rate if snap.hit_rate is not None else float("nan"),
        "union_per_layer_step": snap.union_sum / layer_steps,
        "waves_per_layer_step": snap.waves / layer_steps,
        "bytes_h2d_per_step": snap.bytes_h2d / decode_steps,
        "copy_time_share": snap.copy_time_s / decode_s,
        "h2d_gbps_while_copying": (snap.bytes_h2d / snap.copy_time_s / 1e9) if snap.copy_time_s else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", help="the runtime's dtype (the CPU server's default: float32)")
    ap.add_argument("--preset", default="qwen3-30b-a3b-shape", help="the generated checkpoint (without --model)")
    ap.add_argument(
        "--expert-rows", default="auto", help="comma list of RuntimeConfig.expert_rows layouts, each mode run in each"
    )
    ap.add_argument("--modes", default="resident,paged:8,paged:16,paged:32,paged:64,offload")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument(
        "--routing", default="model", help="'model' or a paged_experts.routing.sources spec, e.g. qwen3-30b-a3b"
    )
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    tmp = tempfile.TemporaryDirectory(prefix="pe-decode-")
    model_dir = args.model or write_checkpoint(args.preset, Path(tmp.name) / "m", layers=args.layers)
    rows = []
    for mode, layout in ((m, r) for m in args.modes.split(",") for r in args.expert_rows.split(",")):
        model = MoeCausalLM.from_pretrained(model_dir, runtime_for(mode, args.device, layout, args.dtype))
        if args.routing != "model":
            from paged_experts.routing.sources import make_router

            model.router_override = make_router(args.routing, model.config, 0)
        for batch in (int(b) for b in args.batches.split(",")):
            run_cell(model, batch, args.prompt, 2)  # warmup: allocator, kernels, pinned paths
            rows_in_force = model.moe_layers[0].host.packed is not None  # 'auto' resolved by the runtime
            ran = {"expert_rows": layout, "rows_layout": "packed" if rows_in_force else "split"}
            row = {"mode": mode, **ran, **run_cell(model, batch, args.prompt, args.decode)}
            rows.append(row)
            print(
                f"{mode:>14} {ran['rows_layout']:>6} B={batch}: {row['decode_tok_per_s']:8.1f} tok/s  "
                f"prefill {row['prefill_s'] * 1e3:7.1f} ms  "
                f"hit {row['hit_rate']:.3f}  union {row['union_per_layer_step']:5.1f}  "
                f"waves {row['waves_per_layer_step']:4.2f}  "
                f"h2d {row['bytes_h2d_per_step'] / 1e6:7.1f} MB/step  copy {row['copy_time_share']:.0%}  "
                f"{row['h2d_gbps_while_copying']:5.1f} GB/s",
                flush=True,
            )
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "routing": "model router, random weights (not natural locality)"
        if args.routing == "model"
        else f"synthetic: {args.routing}",
        "layers": args.layers if args.model is None else "from --model",
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
