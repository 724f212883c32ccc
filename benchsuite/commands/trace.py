"""`benchsuite trace synth|import-sglang|show|ids-only`: make a synthetic trace, import SGLang routed experts,
summarise a trace, copy one without its routing weights (paged_experts.routing.trace owns the format)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import zipfile
from pathlib import Path

import numpy as np

from benchsuite.errors import UserError
from benchsuite.tools.preflight import load_shape
from paged_experts.routing.specs import PRESETS, parse_spec
from paged_experts.routing.trace import Trace, import_sglang_routed_experts, read_trace, save_trace, synthesize_trace

# Shapes of the presets' target model (Qwen3-30B-A3B: 48 MoE layers, E=128, top_k=8).
PRESET_SHAPES = {"qwen3-30b-a3b": (48, 128, 8)}


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    s = sub.add_parser("synth", help="write a synthetic (labelled) routing trace")
    s.add_argument("--preset", choices=sorted(PRESETS), help="calibrated routing preset")
    s.add_argument("--spec", help="uniform, zipf:<s>, reuse:<p> (comma-joined parts allowed)")
    s.add_argument("--tokens", type=int, required=True, help="decode tokens per request")
    s.add_argument("--requests", type=int, default=1)
    s.add_argument("--prompt-tokens", type=int, default=0, help="prefill chunk per request (0: decode only)")
    s.add_argument("--model", help="config.json (or dir) giving layers / experts / top_k")
    s.add_argument("--layers", type=int)
    s.add_argument("--experts", type=int)
    s.add_argument("--top-k", type=int)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("-o", "--out", required=True, help="trace file to write")
    i = sub.add_parser("import-sglang", help="SGLang responses (JSON lines) with routed_experts -> trace")
    i.add_argument("responses", help="JSONL: one SGLang response object per line")
    i.add_argument("--model", help="config.json (or dir) giving layers / experts / top_k")
    i.add_argument("--layers", type=int, help="num_hidden_layers of the model (SGLang's layer axis)")
    i.add_argument("--experts", type=int)
    i.add_argument("--top-k", type=int)
    i.add_argument("-o", "--out", required=True)
    w = sub.add_parser("show", help="summarise a trace")
    w.add_argument("trace")
    w.add_argument("--json", action="store_true")
    d = sub.add_parser("ids-only", help="copy a trace without its routing weights (what the simulator replays)")
    d.add_argument("trace")
    d.add_argument("-o", "--out", required=True, help="trace file to write")


def _shape(args: argparse.Namespace, default: tuple[int, int, int] | None) -> tuple[int, int, int, str]:
    if args.model:
        s = load_shape(args.model)
        return s.num_layers, s.num_experts, s.top_k, s.name
    given = (args.layers, args.experts, args.top_k)
    if all(v is not None for v in given):
        return (*given, "")
    if default is not None:
        layers, experts, top_k = (g if g is not None else d for g, d in zip(given, default))
        return layers, experts, top_k, ""
    raise UserError("give --model or --layers --experts --top-k")


def summarize(trace: Trace) -> dict:
    meta = trace.meta
    chunk_tokens = [c.num_tokens for step in trace.steps for c in step]
    shared = []  # per consecutive decode pair of one request: [L, k] bool, token's expert also in predecessor's
    for chunks in trace.requests().values():
        rows = trace.ids[[c.row_start for c in chunks if c.num_tokens == 1]]  # [D, L, k]
        if rows.shape[0] > 1:
            shared.append((rows[1:, :, :, None] == rows[:-1, :, None, :]).any(axis=3))
    overlap = None
    if shared:
        same = np.concatenate(shared).mean(axis=(0, 2))  # [L]
        overlap = {"mean": float(same.mean()), "min": float(same.min()), "max": float(same.max())}
    return {
        "label": "SYNTHETIC routing" if meta.synthetic else f"routing from {meta.source}",
        "meta": dataclasses.asdict(meta),
        "steps": len(trace.steps),
        "tokens": trace.num_tokens,
        "requests": len(trace.requests()),
        "prefill_chunks": sum(1 for n in chunk_tokens if n > 1),
        "decode_tokens": sum(1 for n in chunk_tokens if n == 1),
        "max_tokens_per_step": int(max(np.diff(trace.step_row_start), default=0)),
        "consecutive_decode_overlap": overlap,  # share of a token's experts its predecessor also used
    }


def ids_only(trace: Trace) -> Trace:
    """The trace without its routing weights: the ids, steps and requests the simulator and the Belady replay read
    (a third of a recorded trace's bytes: uint8 ids against float16 weights), said in its notes."""
    if trace.weights is None:
        return trace
    note = "routing weights dropped (benchsuite trace ids-only)"
    notes = f"{trace.meta.notes}; {note}" if trace.meta.notes else note
    return dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, weights="absent", notes=notes), weights=None)


def _render(summary: dict) -> str:
    m = summary["meta"]
    lines = [
        f"{summary['label']}  (source {m['source']}, model {m['model'] or '-'})",
        f"{m['num_layers']} layers x E={m['num_experts']} x top_k={m['top_k']}, weights {m['weights']}",
        f"{summary['steps']} steps, {summary['tokens']} tokens, {summary['requests']} requests,"
        f" {summary['prefill_chunks']} prefill chunks, {summary['decode_tokens']} decode tokens,"
        f" at most {summary['max_tokens_per_step']} tokens per step",
    ]
    ov = summary["consecutive_decode_overlap"]
    if ov:
        lines.append(f"consecutive decode-token overlap {ov['mean']:.1%} (layers {ov['min']:.1%}-{ov['max']:.1%})")
    if m["notes"]:
        lines.append(m["notes"])
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.trace_command == "synth":
        if bool(args.preset) == bool(args.spec):
            raise UserError("give exactly one of --preset or --spec")
        spec = args.preset or args.spec
        try:
            parse_spec(spec)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        layers, experts, top_k, model = _shape(args, PRESET_SHAPES.get(spec, PRESET_SHAPES["qwen3-30b-a3b"]))
        trace = synthesize_trace(spec, layers, experts, top_k, requests=args.requests, tokens_per_request=args.tokens,
                                 prompt_tokens=args.prompt_tokens, seed=args.seed, model=model)  # fmt: skip
        save_trace(trace, args.out)
        print(f"wrote {args.out}: SYNTHETIC routing {trace.meta.source}, {trace.num_tokens} tokens")
        return 0
    if args.trace_command == "import-sglang":
        layers, experts, top_k, model = _shape(args, None)
        path = Path(args.responses)
        if not path.is_file():
            raise UserError(f"no such file {path}")
        responses = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        try:
            trace = import_sglang_routed_experts(responses, experts, layers, top_k, model=model)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        save_trace(trace, args.out)
        print(f"wrote {args.out}: {len(responses)} SGLang requests, {trace.num_tokens} tokens (no weights)")
        return 0
    try:
        trace = read_trace(args.trace)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise UserError(f"cannot read trace {args.trace}: {exc}") from None
    if args.trace_command == "ids-only":
        try:
            save_trace(ids_only(trace), args.out)
        except OSError as exc:
            raise UserError(f"cannot write {args.out}: {exc}") from None
        print(f"wrote {args.out}: {trace.num_tokens} tokens, ids only")
        return 0
    summary = summarize(trace)
    print(json.dumps(summary, indent=2) if args.json else _render(summary))
    return 0
