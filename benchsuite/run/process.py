"""Engine processes: launch in their own session, readiness with a crash watch, whole-group kill.

`EngineProcess` owns one engine server for its lifetime:
- `start()` launches argv in a new session (the child leads its own process group) with stdout and
  stderr appended to a log file, after checking that the health URL's port is free (UserError).
- `await wait_ready()` polls the health URL until HTTP 200 while watching the process (an exit fails
  fast) and the new part of the log (crash patterns fail fast); on failure or timeout the group is
  killed and RunError carries a one-line cause plus the log tail.
- `stop(grace_s)` kills the whole process tree (benchsuite.run.proctree: group, descendants, and those
  that left the group, found by a launch token in the environment): SIGTERM, grace_s, SIGKILL.
  It is idempotent. Every started process is also registered so that an exception, Ctrl-C,
  SIGTERM/SIGHUP or normal interpreter exit in the parent stops it (atexit and chained signal
  handlers); when started from the main thread the child also gets SIGKILL from the
  kernel if the parent dies without running any Python (PR_SET_PDEATHSIG).

`free_port()` returns a loopback TCP port that is free now.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from urllib.parse import urlsplit

import aiohttp

from benchsuite.errors import RunError, UserError
from benchsuite.run.proctree import TOKEN_ENV, die_with_parent, kill_tree

CRASH_PATTERNS: tuple[str, ...] = (
    r"^Traceback \(most recent call last\)",
    r"Segmentation fault",
    r"core dumped",
    r"CUDA error",
    r"CUDA out of memory",
    r"[Aa]ddress already in use",
    r"Fatal Python error",
    r"terminate called after throwing",
    r"^Aborted",
    r"GGML_ASSERT",
)
"""Log lines that mean the engine is dying even if the process has not exited yet."""

LOG_TAIL_LINES = 20
_POLL_INTERVAL_S = 0.1
_PROBE_TIMEOUT_S = 2.0
_TAIL_BLOCK_BYTES = 64 * 1024


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick for an ephemeral bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when binding host:port fails, i.e. someone already listens there (or holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


class EngineProcess:
    """One engine server process group; see the module docstring for the lifecycle.

    `env` entries are added to the parent's environment, or with `inherit_env=False` are the whole
    environment (the runner passes benchsuite.config.engine_env's filtered one).
    `__enter__` only starts; `__aenter__` starts and waits until ready. Both exits stop the group.
    """

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str] | None,
        log_path: Path,
        health_url: str,
        startup_timeout_s: float,
        *,
        crash_patterns: tuple[str, ...] = CRASH_PATTERNS,
        inherit_env: bool = True,
    ) -> None:
        if not argv:
            raise UserError("engine command line is empty")
        self.argv = list(argv)
        self.env = dict(env or {})
        self.inherit_env = inherit_env
        self.log_path = Path(log_path)
        self.health_url = health_url
        self.startup_timeout_s = startup_timeout_s
        self._crash_re = re.compile("|".join(f"(?:{p})" for p in crash_patterns), re.MULTILINE)
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_start_offset = 0
        self._scan_offset = 0
        self._scan_carry = b""
        self._stopped = False
        self._token = uuid.uuid4().hex
        self._lock = threading.RLock()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._popen is not None:
            raise RuntimeError("EngineProcess.start() called twice")
        port = self._health_port()
        host = urlsplit(self.health_url).hostname or "127.0.0.1"
        if port is not None and port_in_use(port, host if host != "localhost" else "127.0.0.1"):
            raise UserError(
                f"port {port} is already in use on {host}: stop whatever listens there or pick another port"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**(os.environ if self.inherit_env else {}), **self.env, TOKEN_ENV: self._token}
        with open(self.log_path, "ab") as log:
            self._log_start_offset = log.tell()
            log.write(f"# benchsuite: starting {_quote(self.argv)}\n".encode())
            log.flush()
            self._scan_offset = log.tell()
            try:
                self._popen = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    # Only from the main thread: the kernel ties PDEATHSIG to the forking thread.
                    preexec_fn=die_with_parent if _in_main_thread() else None,  # noqa: PLW1509
                )
            except OSError as exc:
                raise RunError(f"cannot start engine {self.argv[0]!r}: {exc}") from exc
        _REGISTRY.add(self)

    async def wait_ready(self) -> None:
        """Poll the health URL until HTTP 200; raise RunError (group killed) on exit, crash or timeout."""
        if self._popen is None:
            raise RuntimeError("EngineProcess.wait_ready() before start()")
        deadline = time.monotonic() + self.startup_timeout_s
        last_probe = "no answer yet"
        timeout = aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                self._check_alive_and_log()
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    self._fail(f"engine not ready after {self.startup_timeout_s:g} s (last health probe: {last_probe})")
                probe_timeout = aiohttp.ClientTimeout(total=min(_PROBE_TIMEOUT_S, max(remaining_s, 0.05)))
                try:
                    async with session.get(self.health_url, timeout=probe_timeout) as resp:
                        if resp.status == 200:
                            self._check_alive_and_log()
                            return
                        last_probe = f"HTTP {resp.status}"
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    last_probe = type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(min(_POLL_INTERVAL_S, max(deadline - time.monotonic(), 0)))

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole group and its descendants, SIGKILL after grace_s. Idempotent."""
        # Reentrant: a SIGTERM handler may call stop() while this thread is inside it. The flag
        # is set only once the kill has finished, so an interrupted stop is redone (at exit too).
        with self._lock:
            if self._popen is None or self._stopped:
                return
            kill_tree(self._popen, self._token, grace_s)
            self._stopped = True
            _REGISTRY.discard(self)

    async def astop(self, grace_s: float = 5.0) -> None:
        await asyncio.to_thread(self.stop, grace_s)

    # ---- state -----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    @property
    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last n lines this launch wrote to the log (earlier launches' lines excluded)."""
        try:
            with open(self.log_path, "rb") as log:
                end = log.seek(0, os.SEEK_END)
                start = end
                data = b""
                # Read backwards in blocks: engine logs can be large, the tail is small.
                while start > self._log_start_offset and data.count(b"\n") <= n:
                    start = max(self._log_start_offset, start - _TAIL_BLOCK_BYTES)
                    log.seek(start)
                    data = log.read(end - start)
        except OSError:
            return ""
        lines = data.rstrip(b"\n").split(b"\n")[-n:] if n > 0 else []
        return b"\n".join(lines).decode("utf-8", "replace")

    # ---- context managers ------------------------------------------------------------------

    def __enter__(self) -> EngineProcess:  # noqa: PYI034
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EngineProcess:  # noqa: PYI034
        self.start()
        try:
            await self.wait_ready()
        except BaseException:
            await self.astop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.astop()

    # ---- internals -------------------------------------------------------------------------

    def _health_port(self) -> int | None:
        parts = urlsplit(self.health_url)
        if parts.port is not None:
            return parts.port
        return {"http": 80, "https": 443}.get(parts.scheme)

    def _check_alive_and_log(self) -> None:
        crash_line = self._scan_log()
        if crash_line is not None:
            self._fail(f"engine log shows a crash: {crash_line.strip()}")
        code = self.returncode
        if code is not None:
            self._fail(f"engine exited with {_describe_returncode(code)} before it became ready")

    def _scan_log(self) -> str | None:
        """The first crash line in the log written since the last scan, if any."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._scan_offset)
                fresh = log.read()
        except OSError:
            return None
        if not fresh:
            return None
        self._scan_offset += len(fresh)
        raw = self._scan_carry + fresh
        # The unterminated last line is scanned now (a dying process's last words may lack a
        # newline) and again with the rest of it next time, so a pattern split by a read is seen.
        self._scan_carry = raw[raw.rfind(b"\n") + 1 :]
        text = raw.decode("utf-8", "replace")
        match = self._crash_re.search(text)
        return None if match is None else _line_at(text, match.start())

    def _fail(self, cause: str) -> None:
        self.stop(grace_s=2.0)
        tail = self.log_tail()
        raise RunError(f"{cause}; log {self.log_path}, last lines:\n{tail}")


def _line_at(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start : end if end != -1 else len(text)]


def _describe_returncode(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _quote(argv: list[str]) -> str:
    import shlex

    return shlex.join(argv)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Registry:
    """Every started, not yet stopped EngineProcess; stopped at exit and on SIGTERM/SIGHUP."""

    def __init__(self) -> None:
        self._procs: dict[int, EngineProcess] = {}
        self._lock = threading.RLock()  # reentrant: signal handlers run on the main thread
        self._installed = False
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def add(self, proc: EngineProcess) -> None:
        with self._lock:
            self._procs[id(proc)] = proc
            if not self._installed:
                self._install()

    def discard(self, proc: EngineProcess) -> None:
        with self._lock:
            self._procs.pop(id(proc), None)

    def stop_all(self, grace_s: float = 2.0) -> None:
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            try:
                proc.stop(grace_s)
            except Exception:  # noqa: BLE001, S112 - best effort at shutdown; keep stopping the rest
                continue

    def _install(self) -> None:
        atexit.register(self.stop_all)
        self._installed = True
        if not _in_main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous = signal.getsignal(sig)
            self._previous[sig] = previous
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_all(grace_s=1.0)
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        # Default action: restore it and re-deliver so the parent dies the way it was told to.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


_REGISTRY = _Registry()
