"""Thin command line: `benchsuite <command> ...`. Each subcommand lives in its own module under
benchsuite.commands (imported lazily so `benchsuite --help` stays fast and a heavy dependency of
one command never breaks another)."""

from __future__ import annotations

import argparse
import difflib
import importlib
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType, ModuleType
from typing import TYPE_CHECKING

from benchsuite.errors import RunError, UserError, caused_by_interrupt

if TYPE_CHECKING:
    from sys import UnraisableHookArgs

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("benchsuite.commands.run", "run a benchmark matrix (matrix.yaml) and write results + report"),
    "report": ("benchsuite.commands.report", "write the HTML report and tables for one or more result runs"),
    "compare": (
        "benchsuite.commands.compare",
        "compare two runs (or two sets of reruns) per configuration, tested over repeats or runs",
    ),
    "preflight": ("benchsuite.commands.preflight", "memory, K, batch-cap and link arithmetic before a sweep"),
    "linkbw": ("benchsuite.commands.linkbw", "measure host<->device copy bandwidth on this GPU"),
    "simulate": ("benchsuite.commands.simulate", "replay a routing trace through the residency policies"),
    "trace": ("benchsuite.commands.trace", "make, import and inspect routing traces"),
    "install": ("benchsuite.commands.install", "build engines from source (llama-server)"),
    "gguf": ("benchsuite.commands.gguf", "export a paged_experts checkpoint to GGUF, or write a synthetic one"),
    "accuracy": ("benchsuite.commands.accuracy", "compare two engines' greedy tokens and logprobs"),
    "canary": ("benchsuite.commands.canary", "check an engine for cross-request leaks"),
}


DESCRIPTION = (
    "Benchmark MoE serving engines (built-in paged experts, SGLang, llama.cpp) on models bigger than the "
    "GPU: run a matrix, report it, compare runs."
)
EPILOG = (
    "Start with `benchsuite run configs/quickstart.yaml`; `benchsuite COMMAND --help` lists a command's flags. "
    "Exit status: 0 ok, 1 some cells failed, 2 a bad matrix or flag (one line per problem), 130 interrupted."
)


def _build_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, ModuleType | None]:
    """(the parser, the wanted command's own parser (the top one when none is named), its module)."""
    parser = argparse.ArgumentParser(prog="benchsuite", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    if wanted is not None and wanted not in COMMANDS:
        close = difflib.get_close_matches(wanted, list(COMMANDS), n=1, cutoff=0.6)
        if close:
            raise UserError(f"unknown command {wanted!r}; did you mean {close[0]}? (benchsuite --help lists them)")
    module: ModuleType | None = None
    own = parser
    for name, (module_path, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            module, own = importlib.import_module(module_path), p
            module.configure(p)
    return parser, own, module


def unknown_arguments(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """What argparse left over, in one line: each unknown `--flag` with the closest flag of the
    command (difflib; argparse's own abbreviations, `--dry` for `--dry-run`, are accepted before this)."""
    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    parts = []
    for extra in extras:
        name = extra.split("=", 1)[0]
        close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6) if name.startswith("--") else []
        parts.append(f"{extra} (did you mean {close[0]}?)" if close else extra)
    return f"{parser.prog}: unrecognized arguments: {' '.join(parts)}"


REDELIVER_S = 0.01  # a Ctrl-C Python ignored (in a weakref callback) is sent again after this long


def _watch_interrupts() -> tuple[list[bool], Callable[[], None]]:
    """([True] once a SIGINT arrived, a function that puts the previous handler back). Ctrl-C while a
    library builds itself on import can reach us as that library's own error with no KeyboardInterrupt
    in its chain: pydantic-core's "SchemaError: ... KeyboardInterrupt" while `benchsuite run` imported
    its schema (tests/test_interrupt.py, interrupted at 0.5 s). The flag says it was an interrupt all
    the same. Where Python's own handler is not in force (a thread, a test runner) nothing is changed."""
    arrived: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        return arrived, lambda: None
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return arrived, lambda: None

    def record(signum: int, frame: FrameType | None) -> None:
        arrived.append(True)
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as before

    hook = sys.unraisablehook

    def unraisable(info: UnraisableHookArgs) -> None:
        """Ctrl-C inside a callback whose exceptions Python ignores (a weakref callback of the import
        system's module locks, under load: tests/test_interrupt.py report at 1.0 s) printed "Exception
        ignored ... KeyboardInterrupt" and the command went on. It is delivered again a moment later, once
        this hook has returned, where it can stop the command."""
        if info.exc_type is not KeyboardInterrupt:
            hook(info)
            return
        timer = threading.Timer(REDELIVER_S, signal.raise_signal, (signal.SIGINT,))
        timer.daemon = True
        timer.start()

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook

    signal.signal(signal.SIGINT, record)
    sys.unraisablehook = unraisable
    return arrived, restore


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    interrupts, restore = _watch_interrupts()
    try:
        return _main(argv, interrupts)
    finally:
        restore()


def _main(argv: list[str], interrupts: list[bool]) -> int:
    try:
        parser, own, module = _build_parser(argv)
        args, extras = parser.parse_known_args(argv)
        if extras:
            raise UserError(unknown_arguments(own, extras))
        if module is None:
            parser.print_help()
            return 2
        return int(module.main(args) or 0)
    except (UserError, RunError) as exc:
        if caused_by_interrupt(exc) or interrupts:  # a store or engine error raised while Ctrl-C unwound the run
            print("benchsuite: interrupted", file=sys.stderr)
            return 130
        print(f"benchsuite: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("benchsuite: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not (caused_by_interrupt(exc) or interrupts):
            raise
        print("benchsuite: interrupted", file=sys.stderr)
        return 130


def entry() -> int:
    """The `benchsuite` command: main(), then Ctrl-C ignored while the interpreter shuts down. The
    command is done and its exit status stands; a SIGINT landing in an atexit finalizer (torch's
    library cleanup, say) would print "Exception ignored ... KeyboardInterrupt" and change nothing."""
    try:
        code = main()
    except KeyboardInterrupt:  # between main's own handler and here
        print("benchsuite: interrupted", file=sys.stderr)
        code = 130
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(entry())
