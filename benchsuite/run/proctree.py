"""Process-tree kill for engines: the leader's group, its descendants, and descendants that left.

An engine runs in its own session, so its pid is its process group id. `kill_tree` collects,
before signalling anything (a dead leader's children are re-parented and lost to the tree):
the leader's descendants, every process of the group, and every process of ours whose
environment carries the launch token (`TOKEN_ENV`, inherited by descendants), which finds
those that called setsid and were re-parented to init. Then SIGTERM (+SIGCONT so a stopped
process can act on it), each process signalled once, a grace period, SIGKILL for what is left
(with what carries the token but forked after the scan), and the leader reaped. A leader already
reaped (a crash seen by poll) has freed its pid, and an empty group its number: then neither its
descendants nor its group are looked up or signalled, only what carries the token.
`die_with_parent` asks the kernel to SIGKILL a child when its parent dies (Linux).

psutil finds the processes (descendants, users, environments) and signals them. Three parts stay
our own because psutil has no equivalent or does worse for this job: the process-group signal
(`os.killpg`: psutil has no group kill), the launch-token scan (nothing else finds a descendant
that called setsid after its parent died), and the wait after SIGTERM: `psutil.wait_procs` waits
for a zombie (a dead descendant its own dying parent has not reaped yet) as if it were alive, so a
stop would spend the whole grace period on a process that is already dead (measured with psutil
7: `wait_procs([zombie], timeout=2)` returned it alive after 2.04 s); `_is_running` counts
a zombie as dead, and the leader, our child, is reaped with `Popen.poll` so its exit code is kept.
Every Process object is made at the stop, never taken from `psutil.process_iter`'s cache: a pid
reused since that cache's last call comes back as the dead process's object, which reads as gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil

TOKEN_ENV = "BENCHSUITE_ENGINE_TOKEN"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec: ask the kernel for SIGKILL when the parent (thread) dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _tagged_or_grouped(pgid: int | None, token: str) -> list[psutil.Process]:
    """Our user's processes in group pgid (None: no group) or carrying the launch token in their environment.

    The token finds descendants that left the group (setsid) and were re-parented to init after
    the leader died, which neither the group nor the process tree can find any more.
    """
    found = []
    me = os.getuid()
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        try:
            # A fresh Process, not process_iter's: that cache keeps the object of whatever held a pid
            # at its last call, so a pid reused since then (a 32,768-pid box wraps in minutes of
            # compiling) came back as a dead process's object, and the wait below took the live
            # engine for gone (is_running False) and returned at popen.wait's 5 s without a SIGKILL.
            proc = psutil.Process(pid)
            if proc.uids().real != me:
                continue
            if (pgid is not None and os.getpgid(proc.pid) == pgid) or proc.environ().get(TOKEN_ENV) == token:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def _signal_all(pgid: int | None, procs: list[psutil.Process], sig: signal.Signals) -> None:
    """Send sig once to every process: the group by killpg, the others (those that left it) one by one.

    Once, not twice: llama-server reads a second SIGTERM as "terminate immediately" and skips its
    shutdown (an H200 llama-server log of 2026-12-01 ends "Received second interrupt"). pgid None:
    one by one only (psutil's send_signal refuses a pid reused since its object was made)."""
    grouped = False
    if pgid is not None:
        try:
            os.killpg(pgid, sig)
            grouped = True
        except (ProcessLookupError, PermissionError):
            pass  # no process of the group left (ESRCH), or none we may signal (EPERM): one by one
    for proc in procs:
        try:
            if grouped and os.getpgid(proc.pid) == pgid:
                continue  # in the group at this check: killpg reached it
            proc.send_signal(sig)
        except (psutil.Error, ProcessLookupError):
            continue


def kill_tree(popen: subprocess.Popen[bytes], token: str, grace_s: float) -> None:
    """Terminate the leader's group plus every descendant that moved to another group (after the leader was
    reaped: what carries the launch token)."""

    def group() -> int | None:
        # The leader's pid is its group's number (start_new_session), ours while the leader is unreaped. Once
        # reaped (here, or by a poll that saw it crash) the pid is free, and with the group empty so is the
        # number: either may name an unrelated process by then, so only signals one by one remain.
        return popen.pid if popen.returncode is None else None

    popen.poll()
    # Collect before signalling: once the leader dies its children are re-parented.
    procs = {p.pid: p for p in _descendants(popen.pid)} if group() is not None else {}
    for member in _tagged_or_grouped(group(), token):
        procs.setdefault(member.pid, member)
    if group() is not None:
        try:
            procs[popen.pid] = psutil.Process(popen.pid)  # made now, while the unreaped leader holds the pid
        except psutil.Error:
            pass
    targets = list(procs.values())
    _signal_all(group(), targets, signal.SIGTERM)
    # SIGCONT so a stopped (SIGSTOP'd) process can act on SIGTERM; harmless otherwise.
    _signal_all(group(), targets, signal.SIGCONT)
    deadline = time.monotonic() + max(grace_s, 0.0)
    while True:
        popen.poll()  # reap the leader so it does not linger as a zombie
        alive = [p for p in targets if _is_running(p)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    # What forked after the scan carries the token too: killed with what outlived the grace.
    alive += [p for p in _tagged_or_grouped(None, token) if p.pid not in procs and _is_running(p)]
    if alive:
        _signal_all(group(), alive, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while any(_is_running(p) for p in alive) and time.monotonic() < deadline:
            popen.poll()
            time.sleep(0.02)
    try:
        popen.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        # The leader outlived both waits (stuck in the kernel, or never counted alive): its group's SIGKILL once more.
        _signal_all(group(), [], signal.SIGKILL)
        try:
            popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass  # uninterruptible (D state): nothing more a signal can do


def _is_running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
