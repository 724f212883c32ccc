"""Ctrl-C in the commands that run an event loop (`run`, `accuracy`, `canary`): `run_async`.

`asyncio.run` under the CLI's own SIGINT handler (cli._watch_interrupts) let Ctrl-C raise
KeyboardInterrupt at whatever line was running when it landed. Landing inside a task that another
awaits through `asyncio.wait_for` (a cell's measurement, in aiohttp's response release), it left that
task holding the KeyboardInterrupt while the loop closed; the loop's shutdown then handed it on to
the awaiting task, and asyncio logged a "Task exception was never retrieved" traceback after the
command's one line (CI, tests/test_faults.py's Ctrl-C test, about 1 run in 30). Here Ctrl-C cancels
the command's task instead: it stops at the await it is on, every `finally` runs inside the task
(servers stop, tables are rebuilt), and the command then raises KeyboardInterrupt, chained to
whatever the unwinding raised, so `errors.caused_by_interrupt` calls it an interrupt. A second Ctrl-C
does not wait for that cleanup. Python 3.11's `asyncio.wait_for` can swallow a cancellation that arrives as
the task it waits on finishes (gh-86296); `stop_if_cancelled` after it keeps Ctrl-C from being lost there."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from benchsuite.errors import caused_by_interrupt

T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on a fresh event loop, as asyncio.run does, with Ctrl-C cancelling it (above).
    Where Python's handler is not in force (outside the main thread; SIGINT ignored, as in a job a shell
    started in the background) this is asyncio.run, and Ctrl-C does what it did."""
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not callable(previous):  # not Python's handler or one wrapping it (cli._watch_interrupts): SIG_IGN, SIG_DFL
        return asyncio.run(main)
    try:
        with asyncio.Runner() as runner:
            loop = runner.get_loop()
            task = loop.create_task(main)
            interrupts: list[bool] = []

            def on_sigint() -> None:
                interrupts.append(True)
                if len(interrupts) > 1 or task.done():  # the second Ctrl-C, or one while other tasks unwind
                    raise KeyboardInterrupt
                task.cancel()

            # through the loop: the handler runs as a callback between tasks, never inside one
            loop.add_signal_handler(signal.SIGINT, on_sigint)
            try:
                return loop.run_until_complete(task)
            except BaseException as exc:
                if interrupts and not caused_by_interrupt(exc):
                    # CancelledError, or an engine or store error raised while the run unwound
                    raise KeyboardInterrupt from exc
                raise
            # the handler stays through the runner's close, which finishes the tasks left over
    finally:
        signal.signal(signal.SIGINT, previous)  # closing the loop set Python's default back


def stop_if_cancelled() -> None:
    """Raises CancelledError where the current task was cancelled and nothing raised it: after an
    `asyncio.wait_for` that returned its task's result although Ctrl-C cancelled the caller meanwhile
    (Python 3.11, gh-86296), so the run stops there instead of going on to its next cell."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
