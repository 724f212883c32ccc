"""`benchsuite gguf export MODEL_DIR --out FILE --type f32|f16|bf16|q8_0`: write a paged_experts
(HF Qwen3-MoE) checkpoint as a qwen3moe GGUF that llama-server loads (benchsuite.engines.llamacpp.gguf_export)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    from benchsuite.engines.llamacpp.gguf_export import EXPORT_TYPES

    sub = parser.add_subparsers(dest="gguf_command", metavar="ACTION", required=True)
    export = sub.add_parser(
        "export", help="export an HF Qwen3-MoE checkpoint directory to GGUF"
    )
    export.add_argument(
        "model_dir",
        help="checkpoint directory (config.json, safetensors, tokenizer.json), or `tiny`",
    )
    export.add_argument("--out", required=True, help="GGUF file to write")
    export.add_argument(
        "--type", dest="export_type", choices=EXPORT_TYPES, default="f32"
    )


def main(args: argparse.Namespace) -> int:
    from benchsuite.engines.llamacpp.gguf_export import export_gguf

    model_dir = args.model_dir
    if model_dir == "tiny":
        from paged_experts.synth import ensure_tiny

        model_dir = ensure_tiny()
    summary = export_gguf(model_dir, args.out, args.export_type)
    print(
        f"{summary.path}: {summary.num_tensors} tensors, {summary.tensor_bytes / 2**20:.1f} MiB "
        f"of tensor data ({summary.export_type})"
    )
    return 0
