"""Connection limits of the built-in server: read timeouts, a cap on open connections below the
open-file limit, half-closed clients, and accept errors logged once per interval.

aiohttp (3.14) has no header or body read timeout (its keep-alive timer, started at connect,
is the only one), closes a connection whose client shut its write side before answering
(aio-libs/aiohttp#3659: `eof_received` returns None), and accepts until the process runs out of
file descriptors, when asyncio logs a traceback per failed accept. `GuardedRequestHandler` is
aiohttp's own `RequestHandler` with those three gaps closed; `GuardedSite` binds it in place of
`web.TCPSite`'s handler. Everything else (parsing, limits, keep-alive, pipelining) stays aiohttp's.

At the cap a new connection first evicts the oldest connection that holds no request (a partial
header, an idle keep-alive): a client that opens connections and never finishes them cannot lock
out `/health` or a load generator, whatever the read timeouts. Only when every open connection is
serving a request is the new one closed at once. Each early close is counted (`ConnectionCounts`,
exposed in `/metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

log = logging.getLogger("paged_experts.server")

# Seconds from the first byte of a request (or from connect) to the end of its header. Clients
# send a header in one write (a few hundred bytes); 10 s is what Go servers commonly set as
# ReadHeaderTimeout and leaves a loaded 2-core box plenty of slack.
HEADER_TIMEOUT_S = 10.0
# Seconds from the end of the header to the end of the body: the largest accepted body (64 MiB)
# still arrives at ~1 MB/s; loopback and LAN clients take milliseconds.
BODY_TIMEOUT_S = 60.0
# Idle keep-alive: longer than the clients' own idle timeouts (aiohttp's client pool: 15 s, httpx:
# 5 s) so the client closes first and never sends a request on a connection the server is closing.
KEEPALIVE_TIMEOUT_S = 75.0
LISTEN_BACKLOG = 128  # aiohttp's default; asyncio also accepts up to this many per loop tick
# File descriptors kept out of the connection cap: the process's own (checkpoint, tokenizer,
# logs, a routing trace, CUDA's handles; a tiny CPU server holds 7) and the sockets in flight
# at a burst. asyncio accepts up to a backlog per loop tick; an accepted socket's transport is
# made one tick later, admitted (evicting a victim) the tick after, and the victim's socket closes
# the tick after that. When the server is the slower side (a loaded 2-core box), each tick finds
# a full accept queue, so three backlogs are in flight beside the cap: with two reserved, 1,100
# partial headers at a 1,024-file limit hit EMFILE 7 times (CI, 2026-12-04; reproduced by
# throttling the server with SIGSTOP/SIGCONT).
FD_RESERVE = 3 * LISTEN_BACKLOG + 128
MAX_CONNECTIONS_CEILING = 65536  # with an unlimited or huge file limit
ACCEPT_ERROR_LOG_INTERVAL_S = 10.0
ACCEPT_ERROR_MESSAGE = "socket.accept() out of system resource"  # asyncio's context message

REASONS = ("evicted", "refused", "header_timeout", "body_timeout")
_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


def raise_open_file_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit (as Go's runtime does) and returns the soft
    limit now in force. A shell's `ulimit -n N` sets both, so it is honoured as given."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = MAX_CONNECTIONS_CEILING + FD_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return min(soft, hard) if soft != resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft
    return hard


def default_max_connections(open_file_limit: int) -> int:
    """The cap for a process allowed `open_file_limit` descriptors (at 1,024: 512)."""
    return max(16, min(MAX_CONNECTIONS_CEILING, open_file_limit - FD_RESERVE))


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
    open_file_limit: int = 0  # the RLIMIT_NOFILE the cap was derived from (0: not derived)


@dataclass(frozen=True)
class ConnectionCounts:
    """Cumulative since start, except `open`. `closed_early` maps each of REASONS to a count."""

    max_connections: int
    open: int
    accepted: int
    closed_early: dict[str, int]
    accept_errors: int


@dataclass
class ConnectionGuard:
    """The open connections in accept order, the cap, and the counters."""

    limits: ConnectionLimits
    accepted: int = 0
    accept_errors: int = 0
    closed_early: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    _open: dict[GuardedRequestHandler, None] = field(default_factory=dict)

    def admit(self, handler: GuardedRequestHandler) -> bool:
        """Registers a new connection; at the cap, makes room or closes it (False)."""
        self.accepted += 1
        if len(self._open) >= self.limits.max_connections:
            victim = next((h for h in self._open if h.holds_no_request()), None)
            if victim is None:
                self.closed_early["refused"] += 1
                handler.force_close()
                return False
            self.closed_early["evicted"] += 1
            self.release(victim)
            victim.force_close()
        self._open[handler] = None
        return True

    def release(self, handler: GuardedRequestHandler) -> None:
        self._open.pop(handler, None)

    def counts(self) -> ConnectionCounts:
        return ConnectionCounts(
            self.limits.max_connections, len(self._open), self.accepted, dict(self.closed_early), self.accept_errors
        )


class GuardedRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol plus read deadlines, the cap and half-close."""

    __slots__ = ("_guard", "_read_timer", "_reading_body", "_unanswered")

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading_body: StreamReader | None = None  # a request's body still arriving
        # requests parsed and not yet answered: aiohttp's own flags miss the step between taking a
        # request off its queue and starting its handler task
        self._unanswered = 0

    def holds_no_request(self) -> bool:
        """Nothing to lose by closing it: no request queued, handled or arriving with a body."""
        return self._unanswered == 0 and self._reading_body is None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._guard.admit(self):
            # an empty connection gets as long as a header does
            self._arm("header_timeout", self._guard.limits.header_timeout_s)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self._guard.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        queued = len(self._messages)  # start() pops them in a later task step, never inside this call
        super().data_received(data)
        if self._force_close or self._close:
            return
        new = list(self._messages)[queued:]
        if new:
            self._unanswered += len(new)
            self._disarm()
            payload = new[-1][1]
            self._reading_body = payload if isinstance(payload, StreamReader) and not payload.is_eof() else None
            if self._reading_body is not None:
                self._arm("body_timeout", self._guard.limits.body_timeout_s)
        elif self._reading_body is not None:
            if self._reading_body.is_eof():
                self._reading_body = None
                self._disarm()
        elif data and self._read_timer is None:
            self._arm("header_timeout", self._guard.limits.header_timeout_s)  # a next request begins

    def eof_received(self) -> bool:  # type: ignore[override]  # asyncio.Protocol's contract: True keeps it open
        """The client shut its write side. A complete request already received is still answered
        (the transport stays open for writing, then closes once it is done); otherwise close now."""
        if self._unanswered == 0 or self._reading_body is not None:
            return False
        self.close()  # no further requests on this connection; aiohttp closes after the response
        return True

    async def finish_response(
        self, request: BaseRequest, resp: StreamResponse, start_time: float | None
    ) -> tuple[StreamResponse, bool]:
        try:
            done = await super().finish_response(request, resp, start_time)
        finally:
            self._unanswered = max(0, self._unanswered - 1)
        if resp.status >= 400 and request.headers.get("Expect") and not request.content.is_eof():
            # refused before "100 Continue": the client holds its body back, so aiohttp's lingering
            # read (up to 10 s) would only wait; close once the answer is flushed
            self.force_close()
        return done

    def _arm(self, reason: str, delay_s: float) -> None:
        self._disarm()
        self._read_timer = self._loop.call_later(delay_s, self._read_timed_out, reason)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self, reason: str) -> None:
        self._read_timer = None
        if self._force_close or self.transport is None:
            return
        self._guard.closed_early[reason] += 1
        if reason == "header_timeout" and self._unanswered == 0:
            self.transport.write(_TIMEOUT_408)
        self._guard.release(self)
        self.force_close()


class GuardedSite(web.TCPSite):
    """`web.TCPSite` whose connections are `GuardedRequestHandler`s sharing one `ConnectionGuard`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner, host, port, backlog=LISTEN_BACKLOG)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner; TCPSite.start would bind aiohttp's handler
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        keepalive_s = self.guard.limits.keepalive_timeout_s

        def protocol() -> GuardedRequestHandler:
            return GuardedRequestHandler(server, self.guard, loop=loop, access_log=None, keepalive_timeout=keepalive_s)

        self._server = await loop.create_server(protocol, self._host, self._port, backlog=self._backlog)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port


class AcceptErrorLog:
    """A loop exception handler: failed accepts (out of descriptors or memory) are counted and
    logged once per interval with their count, not as a traceback per attempt; asyncio retries the
    accept by itself. Every other context goes to the loop's default handler."""

    def __init__(self, guard: ConnectionGuard, interval_s: float = ACCEPT_ERROR_LOG_INTERVAL_S) -> None:
        self.guard = guard
        self.interval_s = interval_s
        self._last_log_s = -float("inf")
        self._since_log = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_ERROR_MESSAGE:
            loop.default_exception_handler(context)
            return
        self.guard.accept_errors += 1
        self._since_log += 1
        now = time.monotonic()
        if now - self._last_log_s >= self.interval_s:
            limits = self.guard.limits
            log.warning(
                "accept failed %d time(s) since the last report: %s (open-file limit %d, connection cap %d, "
                "%d open); asyncio retries it",
                self._since_log, context.get("exception"), limits.open_file_limit, limits.max_connections,
                self.guard.counts().open,
            )  # fmt: skip
            self._last_log_s = now
            self._since_log = 0
