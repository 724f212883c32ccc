"""How many threads torch's CPU work gets in the built-in server (no torch import: the benchsuite
adapter resolves the default when it writes the server's command line)."""

from __future__ import annotations

import os


def default_cpu_threads() -> int:
    """The cores this process may use, minus one for the event loop and the engine thread: torch's
    intra-op threads on every core oversubscribe the CPU while SSE streams are written (measured on a
    2-core box with the tiny model: c=4 decode 3.9x faster with 1 thread than with 2)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)
