"""`python -m paged_experts.server`: the built-in OpenAI-compatible server.

Ctrl-C in the first seconds (torch and the server importing, the arguments parsed, the event loop
starting) is noted by a handler installed before anything else and acted on once the loop's own
handlers are in (`app.serve`): a KeyboardInterrupt raised at an arbitrary point of an import can be
swallowed (inside a `__del__` or a library's broad `except`), and the server then ran on, the
interrupt lost (seen in 1 of ~8 interrupts 0.3 s after start)."""

import signal
import sys

_interrupts: list[int] = []
signal.signal(signal.SIGINT, lambda signum, frame: _interrupts.append(signum))

from paged_experts.server.app import interrupted, main  # noqa: E402 (after the handler: the imports take seconds)

if _interrupts:
    sys.exit(interrupted())
sys.exit(main(interrupted_early=lambda: bool(_interrupts)))
