"""`benchsuite install llama-server [--cuda] [--jobs N] [--force] [--source SDIST]`: build llama.cpp's
server from the pinned source into the per-user cache (benchsuite.engines.llamacpp.build) and print
where it is. `--source` builds from a local copy of the llama-cpp-python sdist, full or trimmed (a
GPU box without internet). `--pack-source OUT.tar.gz [--source SDIST]` builds nothing: it writes the
trimmed, byte-stable copy of the sdist (downloaded first when no --source is given) to carry there
(benchsuite.engines.llamacpp.source).

Quiet by default: one line per build phase on stderr (the compile phase with its step count: a live
line on a terminal, every quarter in a log), the whole CMake and compiler output (some 15,000
lines, mostly warnings) in `build.log` beside the binaries, its path printed first; on a failure,
its last FAIL_TAIL_LINES lines and its path. `--verbose` streams all of it to stderr instead."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import deque
from pathlib import Path
from typing import TextIO

from benchsuite.errors import RunError

ENGINES = ("llama-server",)
FAIL_TAIL_LINES = 40
EXPECTED = "about 11 minutes on 2 cores the first time (CUDA: about 7 on 16), reused afterwards"
PHASES = {
    "source": "unpacking the pinned llama.cpp source",
    "configure": "configuring (cmake)",
    "compile": "compiling",
}
# ninja prints "[12/345] Building CXX object ...", make "[ 42%] Building ..."
_STEP = re.compile(r"^\[\s*(\d+)/(\d+)\]|^\[\s*(\d+)%\]")


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
    parser.add_argument(
        "--verbose", action="store_true", help="stream the whole build output to stderr (default: into build.log)"
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
    if args.verbose:
        result = build_llama_server(args.cuda, args.jobs, sys.stderr, force=args.force, sdist=args.source)
    else:
        result = _quiet_build(args)
    how = "reused cached build" if result.reused else f"built in {result.build_seconds:.0f} s"
    print(f"{result.server_path} ({how})")
    print(result.version_text)
    return 0


def _quiet_build(args: argparse.Namespace):
    """The build with its output in build.log and a line per phase on stderr; on failure, the log's tail."""
    from benchsuite.engines.llamacpp.build import build_llama_server, install_dir

    log_path = install_dir(args.cuda) / "build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    progress = _Progress(sys.stderr)
    with log_path.open("a") as log:  # a reused build adds nothing; a new one follows the last
        try:
            return build_llama_server(
                args.cuda, args.jobs, log, force=args.force, sdist=args.source,
                phase=lambda name: progress.phase(name, log_path), on_line=progress.line,
            )  # fmt: skip
        except RunError:
            progress.end()
            log.flush()
            print(f"--- last {FAIL_TAIL_LINES} lines of {log_path} ---", file=sys.stderr)
            sys.stderr.writelines(_tail(log_path, FAIL_TAIL_LINES))
            print(f"--- full log: {log_path}", file=sys.stderr)
            raise
        finally:
            progress.end()


class _Progress:
    """Phase lines, and the compile step count: rewritten in place on a terminal, every quarter otherwise."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._tty = out.isatty()
        self._started = False
        self._quarter = 0
        self._live = False

    def phase(self, name: str, log_path: Path) -> None:
        if not self._started:
            self._started = True
            print(f"building llama-server: {EXPECTED}; full log: {log_path}", file=self._out, flush=True)
        self.end()
        print(f"  {PHASES.get(name, name)}", file=self._out, flush=True)

    def line(self, text: str) -> None:
        match = _STEP.match(text)
        if match is None:
            return
        done, total = (int(match[1]), int(match[2])) if match[1] else (int(match[3]), 100)
        if self._tty:
            self._out.write(f"\r  compiling: {done}/{total}")
            self._out.flush()
            self._live = True
        elif done * 4 // total > self._quarter:
            self._quarter = done * 4 // total
            print(f"  compiling: {done}/{total}", file=self._out, flush=True)

    def end(self) -> None:
        """Ends a live line (before the next phase or a failure's tail)."""
        if self._live:
            self._out.write("\n")
            self._live = False


def _tail(path: Path, lines: int) -> list[str]:
    with path.open(errors="replace") as f:
        return list(deque(f, maxlen=lines))
