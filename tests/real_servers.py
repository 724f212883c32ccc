"""Real engine processes for tests that need one on loopback (several test modules share them)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from benchsuite.run.process import EngineProcess, free_port


@contextmanager
def builtin_server(model_dir: Path, log_dir: Path, *flags: str, launcher: Sequence[str] = ()) -> Iterator[str]:
    """A real `python -m paged_experts.server` on a free loopback port (tiny model, CPU):
    yields its base URL; afterwards it must still be alive and its log free of tracebacks.
    `launcher` goes before the interpreter (e.g. `prlimit --nofile=1024:1024`)."""
    port = free_port()
    argv = [*launcher, sys.executable, "-m", "paged_experts.server", "--model-path", str(model_dir),
            "--port", str(port), "--log-level", "warning", *flags]  # fmt: skip
    log = log_dir / "server.log"
    proc = EngineProcess(argv, {}, log, f"http://127.0.0.1:{port}/health", startup_timeout_s=300.0)
    proc.start()
    try:
        asyncio.run(proc.wait_ready())
        yield f"http://127.0.0.1:{port}"
        assert proc.alive, f"the server died:\n{proc.log_tail()}"
        assert "Traceback" not in log.read_text(), proc.log_tail(60)
    finally:
        proc.stop()


# Text prompts both engines are sent in the agreement tests (the same greedy tokens expected)
TEXT_PROMPTS = (
    "The quick brown fox",
    "Once upon a time, in a small village",
    "In 1969 the first",
    "Water boils at",
    "The capital of France is",
    "def add(a, b):",
    "Mixture of experts models route each token",
    "A cat sat on the",
)
