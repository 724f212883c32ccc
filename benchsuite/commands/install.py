"""`benchsuite install llama-server [--cuda] [--jobs N] [--force] [--source SDIST]`: build llama.cpp's
server from the pinned source into the per-user cache (benchsuite.engines.llamacpp.build) and print
where it is. `--source` builds from a local copy of the llama-cpp-python sdist, full or trimmed (a
GPU box without internet). `--pack-source OUT.tar.gz [--source SDIST]` builds nothing: it writes the
trimmed, byte-stable copy of the sdist (downloaded first when no --source is given) to carry there
(benchsuite.engines.llamacpp.source)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ENGINES = ("llama-server",)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine", choices=ENGINES)
    parser.add_argument("--cuda", action="store_true", help="build with GGML_CUDA=ON")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache matches")
    parser.add_argument(
        "--source",
        type=Path,
        metavar="SDIST",
        help="a local llama-cpp-python sdist (full or trimmed by --pack-source) instead of the download",
    )
    parser.add_argument(
        "--pack-source",
        type=Path,
        metavar="OUT",
        help="write the trimmed source tarball to OUT (for a machine without internet) and build nothing",
    )


def main(args: argparse.Namespace) -> int:
    from benchsuite.engines.llamacpp.build import build_llama_server, cache_root
    from benchsuite.engines.llamacpp.source import check_sdist, download_sdist, pack_source

    if args.source is not None:
        check_sdist(args.source)  # before a cached build could be reused: a bad --source is always said
    if args.pack_source is not None:
        sdist = args.source or download_sdist(cache_root() / "llama.cpp" / "src", sys.stderr)
        print(json.dumps(pack_source(sdist, args.pack_source).to_json()))
        return 0
    result = build_llama_server(cuda=args.cuda, jobs=args.jobs, log=sys.stderr, force=args.force, sdist=args.source)
    how = "reused cached build" if result.reused else f"built in {result.build_seconds:.0f} s"
    print(f"{result.server_path} ({how})")
    print(result.version_text)
    return 0
