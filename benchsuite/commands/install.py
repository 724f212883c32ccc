"""`benchsuite install llama-server [--cuda] [--jobs N] [--force]`: build llama.cpp's server from the
pinned source into the per-user cache (see benchsuite.engines.llamacpp.build) and print where it is."""

from __future__ import annotations

import argparse
import sys

ENGINES = ("llama-server",)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine", choices=ENGINES)
    parser.add_argument("--cuda", action="store_true", help="build with GGML_CUDA=ON")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="parallel compile jobs (default: all cores)",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even when the cache matches"
    )


def main(args: argparse.Namespace) -> int:
    from benchsuite.engines.llamacpp.build import build_llama_server

    result = build_llama_server(
        cuda=args.cuda, jobs=args.jobs, log=sys.stderr, force=args.force
    )
    how = (
        "reused cached build"
        if result.reused
        else f"built in {result.build_seconds:.0f} s"
    )
    print(f"{result.server_path} ({how})")
    print(result.version_text)
    return 0
