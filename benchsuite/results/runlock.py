"""The lock of a run directory: one runner process at a time.

`RunLock.acquire(run_dir)` takes an exclusive `flock` on `<run_dir>/.lock` and writes the holder's
pid, host and start time into it. A second runner on the same directory fails at once with a
UserError (exit 2) naming the holder's pid. The kernel drops a flock when its process dies (kill -9
included), so a lock left by a dead runner is simply taken over; its non-empty file says so, and
the note names the dead pid. A clean release empties the file first, so only crashes leave a note.
Two runners on one directory would otherwise both start every server, measure every cell at
once and move each other's results to attempts/ (issue 18).

Within one process the lock is re-entrant (a count per directory): the run loop, its search and
tests may open the same store more than once.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path

import psutil

from benchsuite.errors import RunError, UserError

LOCK_NAME = ".lock"

Notify = Callable[[str], None]


class RunLock:
    _held: dict[Path, RunLock] = {}  # this process's locks, by resolved run directory

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._count = 1

    @classmethod
    def acquire(cls, run_dir: Path, notify: Notify) -> RunLock:
        key = Path(run_dir).resolve()
        held = cls._held.get(key)
        if held is not None:
            held._count += 1
            return held
        path = key / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunError(f"cannot write {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise UserError(
                f"{key} is in use by another benchsuite run ({holder or 'holder unknown'}); wait for it to end or "
                "stop it, or give this run another --run-id"
            ) from None
        previous = _read(fd)
        if previous:
            pid = _pid_of(previous)
            alive = pid is not None and psutil.pid_exists(pid)
            state = "no longer running" if not alive else "not holding it"
            notify(f"benchsuite: {path}: took over the lock left by {previous} ({state})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        lock = cls(path, fd)
        cls._held[key] = lock
        return lock

    def release(self) -> None:
        self._count -= 1
        if self._count > 0 or self._fd < 0:
            return
        RunLock._held.pop(self.path.parent, None)
        try:
            os.ftruncate(self._fd, 0)  # an empty file: released cleanly, nobody to take over from
        except OSError:
            pass  # the directory went read-only or away; the flock still ends with the close
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = -1


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _pid_of(text: str) -> int | None:
    parts = text.split()
    return int(parts[1]) if len(parts) > 1 and parts[0] == "pid" and parts[1].isdigit() else None
