"""`benchsuite gguf export MODEL_DIR --out FILE --type f32|f16|bf16|q8_0`: write a paged_experts
(HF Qwen3-MoE) checkpoint as a qwen3moe GGUF that llama-server loads (benchsuite.engines.llamacpp.gguf_export).

`benchsuite gguf synth --preset P [--layers N] [--seed S] --out FILE`: a seeded synthetic GGUF of a
preset's shape with the built-in engine's weights for that preset, layers and seed (Q8_0 experts and,
by default, Q8_0 attention projections that equal its bf16 values), with no checkpoint in between, and
beside it FILE.json (its facts: seed, shape, bytes per expert, the source-weights fingerprint; recorded by
the llamacpp engine) and FILE.hf/ (the preset's tokenizer, for exact-length prompts)
(benchsuite.engines.llamacpp.gguf_synth).
An export writes FILE.json too (its checkpoint's fingerprint and directory)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    from benchsuite.engines.llamacpp.gguf_export import EXPORT_TYPES

    sub = parser.add_subparsers(dest="gguf_command", metavar="ACTION", required=True)
    export = sub.add_parser("export", help="export an HF Qwen3-MoE checkpoint directory to GGUF")
    export.add_argument(
        "model_dir",
        help="checkpoint directory (config.json, safetensors, tokenizer.json), or `tiny`",
    )
    export.add_argument("--out", required=True, help="GGUF file to write")
    export.add_argument("--type", dest="export_type", choices=EXPORT_TYPES, default="f32")
    synth = sub.add_parser(
        "synth", help="write a seeded synthetic GGUF (Q8_0 experts) of a preset's shape, facts beside it"
    )
    synth.add_argument(
        "--preset", default="qwen3-30b-a3b-shape", help="a paged_experts.weights.synth preset (default: %(default)s)"
    )
    synth.add_argument("--layers", type=int, default=None, help="MoE layers (default: the preset's)")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--out", required=True, type=Path, help="GGUF file to write (FILE.json and FILE.hf/ beside it)")
    synth.add_argument("--workers", type=int, default=None, help="writer processes (default: every core)")
    synth.add_argument(
        "--attention-type",
        choices=("q8_0", "bf16"),
        default="q8_0",
        help="the attention projections' type beside the Q8_0 experts: q8_0 (the default, as llama-quantize types a "
        "Q8_0 file: 8-bit like the block-FP8 attention the built-in engine keeps) or bf16 (the layout before "
        "2026-12-03)",
    )


_SUMMARY_KEYS = ("path", "bytes", "layers", "seed", "expert_type", "attention_type", "expert_bytes", "write_s")


def main(args: argparse.Namespace) -> int:
    if args.gguf_command == "synth":
        return _synth(args)
    from benchsuite.engines.llamacpp.gguf_export import export_gguf

    model_dir = args.model_dir
    if model_dir == "tiny":
        from paged_experts.weights.synth import ensure_tiny

        model_dir = ensure_tiny()
    summary = export_gguf(model_dir, args.out, args.export_type)
    print(
        f"{summary.path}: {summary.num_tensors} tensors, {summary.tensor_bytes / 2**20:.1f} MiB "
        f"of tensor data ({summary.export_type})"
    )
    return 0


def _synth(args: argparse.Namespace) -> int:
    from benchsuite.engines.llamacpp.gguf_synth import facts_path, write_with_facts
    from benchsuite.errors import UserError
    from paged_experts.weights.synth import PRESETS

    if args.preset not in PRESETS:
        raise UserError(f"--preset {args.preset!r}: not a preset (known: {', '.join(sorted(PRESETS))})")
    if args.layers is not None and args.layers < 1:
        raise UserError(f"--layers must be >= 1, got {args.layers}")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    facts = write_with_facts(
        args.out, args.preset, args.layers, args.seed, args.workers, attention_type=args.attention_type
    )
    print(
        json.dumps(
            {
                k: facts[k]
                for k in ("path", "bytes", "layers", "seed", "expert_type", "attention_type", "expert_bytes", "write_s")
            }
        )
    )
    print(f"facts: {facts_path(Path(facts['path']))}; tokenizer: {facts['hf_dir']}")
    return 0
