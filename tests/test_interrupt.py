"""Ctrl-C at any moment ends with one line and no traceback (issue 27): the built-in server in its
first seconds (imports, binding, the model load) and `benchsuite report` / `benchsuite run` at
several moments. Before the fix the server printed a KeyboardInterrupt traceback when interrupted
before its event loop's handlers were installed."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "data" / "report_fixture"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def terminal_sigint() -> Iterator[None]:
    """Python's own SIGINT handler in force for an in-process test, as under a terminal: a test runner
    started in the background (`cmd &` in a script) ignores SIGINT, and the signals these tests send
    themselves would vanish. The handler found is put back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupted(argv: list[str], after_s: float, cwd: Path) -> tuple[int, str]:
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=cwd,
        # as a terminal's foreground job: a test runner started in the background ignores SIGINT,
        # and children would inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr + stdout  # `benchsuite run` says where its finished cells are on stdout


def assert_one_clean_line(rc: int, output: str, finished_ok: bool = False) -> None:
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    # killed before Python set its handler (-2), interrupted (130), or already done (0)
    assert rc in (-signal.SIGINT, 130) or (finished_ok and rc == 0), (rc, output)
    if rc == 130:
        assert [line for line in output.splitlines() if line.startswith("benchsuite: interrupted")], output


@pytest.mark.parametrize("after_s", [0.3, 1.0, 2.0, 4.0])
def test_the_server_interrupted_in_its_first_seconds(tiny_model_dir: Path, tmp_path: Path, after_s: float) -> None:
    argv = [sys.executable, "-m", "paged_experts.server", "--model-path", str(tiny_model_dir), "--port", "0",
            "--log-level", "warning"]  # fmt: skip
    rc, stderr = interrupted(argv, after_s, tmp_path)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    # once the loop's handlers are in, SIGINT is a clean shutdown (0); before, one line (130)
    assert rc in (-signal.SIGINT, 130, 0), (rc, stderr)
    if rc == 130:
        assert stderr.strip().splitlines()[-1] == "paged_experts.server: interrupted", stderr


@pytest.mark.parametrize("after_s", [0.3, 1.0, 3.0])
def test_benchsuite_report_interrupted(tmp_path: Path, after_s: float) -> None:
    argv = [sys.executable, "-m", "benchsuite", "report", str(FIXTURE), "--out", str(tmp_path / "out")]
    rc, output = interrupted(argv, after_s, tmp_path)
    assert_one_clean_line(rc, output, finished_ok=True)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]  # no half-written report left


@pytest.mark.parametrize("after_s", [0.5, 2.0, 5.0])
def test_benchsuite_run_interrupted(tiny_model_dir: Path, tmp_path: Path, after_s: float) -> None:
    matrix = tmp_path / "m.yaml"
    matrix.write_text(
        f"name: intr\noutput_root: {tmp_path / 'out'}\nfairness: {{kv_capacity_tokens: 512}}\n"
        f"engines: {{e: {{kind: builtin, options: {{model: {tiny_model_dir}, mode: resident}}}}}}\n"
        "workloads: {w: {concurrency: [1], num_requests: 4, warmup_requests: 0, output_tokens: 16}}\n"
    )
    argv = [sys.executable, "-m", "benchsuite", "run", str(matrix), "--quiet", "--no-report"]
    rc, output = interrupted(argv, after_s, tmp_path)
    assert_one_clean_line(rc, output, finished_ok=True)


def test_the_command_ignores_ctrl_c_once_it_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGINT during the interpreter's shutdown (an atexit finalizer such as torch's) printed
    "Exception ignored ... KeyboardInterrupt" after a finished run (test_benchsuite_run_interrupted[5.0],
    1 time in CI-like runs): the entry point keeps the exit status and ignores Ctrl-C from then on."""
    from benchsuite import cli

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(cli, "main", lambda: 0)
    try:
        assert cli.entry() == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_an_interrupt_inside_an_extensions_initialization_is_an_interrupt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while scipy's HiGHS extension initialized (`benchsuite report` importing its stats)
    arrived as "ImportError: initialization failed" raised from the KeyboardInterrupt, and printed a
    traceback (test_benchsuite_report_interrupted[1.0], once in CI). Any exception whose chain holds
    a KeyboardInterrupt is an interrupt; any other still propagates."""
    import argparse
    import types

    from benchsuite import cli
    from benchsuite.errors import RunError

    def failing_import(args: argparse.Namespace) -> int:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise ImportError("initialization failed") from exc

    def plain_failure(args: argparse.Namespace) -> int:
        raise ImportError("no module named nothing")

    def cleanup_error(args: argparse.Namespace) -> int:  # raised while Ctrl-C unwound, from another error
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            try:
                raise OSError("pipe closed")
            except OSError as inner:
                raise RuntimeError("stopping the engine failed") from inner

    def store_error(args: argparse.Namespace) -> int:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RunError("the store could not be closed") from None

    bodies = ((failing_import, 130), (cleanup_error, 130), (store_error, 130), (plain_failure, None))
    for body, expect in bodies:
        module = types.SimpleNamespace(configure=lambda p: None, main=body)
        parser = argparse.ArgumentParser()
        parser.add_argument("command")
        monkeypatch.setattr(cli, "_build_parser", lambda argv, m=module, p=parser: (p, p, m))
        if expect is None:
            with pytest.raises(ImportError, match="no module named nothing"):
                cli.main(["report"])
        else:
            assert cli.main(["report"]) == expect
            assert capsys.readouterr().err.strip() == "benchsuite: interrupted"


def test_a_real_ctrl_c_that_a_library_turns_into_its_own_error_is_an_interrupt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], terminal_sigint: None
) -> None:
    """Ctrl-C while pydantic-core built a schema on import (`benchsuite run` interrupted at 0.5 s) came out as
    "SchemaError: ... KeyboardInterrupt" with no KeyboardInterrupt in its chain, and printed a traceback
    (test_benchsuite_run_interrupted[0.5], once from a fresh clone). A SIGINT that arrived while the command
    ran makes its error an interrupt; the same error without one still propagates, and the handler the
    command found is back afterwards."""
    import argparse
    import types

    from benchsuite import cli

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # what a terminal's command runs under

    def library_error(signalled: bool) -> int:
        swallowed = False
        if signalled:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs at the next bytecode
            except KeyboardInterrupt:
                swallowed = True  # a C extension's build step catches it and reports its own error
        raise RuntimeError(f"SchemaError: Error building `literal` serializer (interrupted: {swallowed})")

    for signalled, expect in ((True, 130), (False, None)):
        module = types.SimpleNamespace(configure=lambda p: None, main=lambda args, s=signalled: library_error(s))
        parser = argparse.ArgumentParser()
        parser.add_argument("command")
        monkeypatch.setattr(cli, "_build_parser", lambda argv, m=module, p=parser: (p, p, m))
        if expect is None:
            with pytest.raises(RuntimeError, match="interrupted: False"):
                cli.main(["run"])
        else:
            assert cli.main(["run"]) == expect
            assert capsys.readouterr().err.strip() == "benchsuite: interrupted"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ---- Ctrl-C inside an event loop (benchsuite.interrupt.run_async) --------------------------------


async def _measurement_interrupted_mid_line(log: list[str], *, again_while_unwinding: bool = False) -> str:
    """A cell's shape: the run awaits its measurement through asyncio.wait_for, and SIGINT lands while
    the measurement's task runs Python code (CI's case: inside aiohttp's response release)."""

    async def measure() -> str:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the handler runs in here, inside this task, mid-line
            await asyncio.sleep(30)
            return "finished"
        finally:
            log.append("measurement unwound")
            if again_while_unwinding:
                os.kill(os.getpid(), signal.SIGINT)
                await asyncio.sleep(30)  # a slow cleanup the second Ctrl-C does not wait for

    try:
        return await asyncio.wait_for(measure(), 60)
    finally:
        log.append("run unwound")


def _asyncio_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    gc.collect()  # a task left holding an exception says so when it is collected
    return [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_ctrl_c_inside_a_waited_task_cancels_the_run_and_leaves_no_task_holding_it(
    caplog: pytest.LogCaptureFixture, terminal_sigint: None
) -> None:
    """CI, tests/test_faults.py's Ctrl-C test, once: `benchsuite run` printed its one line and then asyncio's
    "Task exception was never retrieved" traceback. The KeyboardInterrupt had landed inside the task
    `asyncio.wait_for` ran a cell's measurement in; the loop closed with that task holding it. Through
    run_async Ctrl-C cancels the run at its await: both `finally` blocks run inside the loop, the command
    gets a KeyboardInterrupt (its one line, exit 130), and asyncio has nothing to report. The control runs
    the same coroutine through asyncio.run under the CLI's handler and shows the old failure."""
    from benchsuite.cli import _watch_interrupts
    from benchsuite.interrupt import run_async

    caplog.set_level(logging.ERROR, logger="asyncio")
    _, restore = _watch_interrupts()
    try:
        handler = signal.getsignal(signal.SIGINT)
        log: list[str] = []
        with pytest.raises(KeyboardInterrupt) as raised:
            run_async(_measurement_interrupted_mid_line(log))
        assert isinstance(raised.value.__cause__, asyncio.CancelledError)
        assert log == ["measurement unwound", "run unwound"]
        assert _asyncio_errors(caplog) == []
        assert signal.getsignal(signal.SIGINT) is handler  # the CLI's handler is back

        log.clear()
        with pytest.raises(KeyboardInterrupt):  # the control: the old call
            asyncio.run(_measurement_interrupted_mid_line(log))
        assert "Task exception was never retrieved" in " ".join(_asyncio_errors(caplog))
    finally:
        restore()


def test_a_ctrl_c_python_ignored_in_a_callback_is_delivered_again(
    terminal_sigint: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C landing in a weakref callback (the import system's module locks: `benchsuite report` interrupted
    at 1.0 s under load printed "Exception ignored ... KeyboardInterrupt" and went on): Python ignores an
    exception there, so the command sends the interrupt again once the callback is over, and it stops."""
    import weakref

    from benchsuite.cli import _watch_interrupts

    class Held:
        pass

    def callback(_: object) -> None:
        raise KeyboardInterrupt  # what SIGINT's handler raises when the signal lands inside the callback

    arrived, restore = _watch_interrupts()
    try:
        held = Held()
        ref = weakref.ref(held, callback)
        with pytest.raises(KeyboardInterrupt):
            del held  # the callback runs, its KeyboardInterrupt is ignored by Python: the hook sends SIGINT again
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.001)
        assert ref() is None and arrived == [True]  # the second delivery went through the command's handler
    finally:
        restore()
    assert "Exception ignored" not in capsys.readouterr().err


def test_an_error_raised_while_ctrl_c_unwinds_the_run_is_an_interrupt(terminal_sigint: None) -> None:
    """An engine or store error raised by the cleanup that the cancellation runs (an engine that died of
    the same Ctrl-C, say) comes out as a KeyboardInterrupt chained to it: errors.caused_by_interrupt."""
    from benchsuite.errors import RunError, caused_by_interrupt
    from benchsuite.interrupt import run_async

    async def run() -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(30)
        finally:
            raise RunError("the engine exited with -2 before the cell ended")

    with pytest.raises(KeyboardInterrupt) as raised:
        run_async(run())
    assert isinstance(raised.value.__cause__, RunError) and caused_by_interrupt(raised.value)

    async def fine() -> int:
        return 7

    async def failing() -> None:
        raise RunError("no engine")

    assert run_async(fine()) == 7  # and without Ctrl-C it is asyncio.run: results and errors as they are
    with pytest.raises(RunError, match="no engine") as plain:
        run_async(failing())
    assert not caused_by_interrupt(plain.value)


def test_a_second_ctrl_c_does_not_wait_for_the_cleanup(terminal_sigint: None) -> None:
    from benchsuite.interrupt import run_async

    log: list[str] = []
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_async(_measurement_interrupted_mid_line(log, again_while_unwinding=True))
    assert time.monotonic() - start < 10  # not the cleanup's 30 s
    assert log[0] == "measurement unwound"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_command_started_with_sigint_ignored_keeps_ignoring_it() -> None:
    """A shell starts a background job (`benchsuite run m.yaml &`) with SIGINT ignored, so that Ctrl-C at the
    terminal leaves it running; run_async keeps that, as Python and asyncio.run do."""
    from benchsuite.interrupt import run_async

    async def run() -> str:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.2)
        return "finished"

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert run_async(run()) == "finished"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_cancellation_that_wait_for_swallowed_still_stops_the_run() -> None:
    """Python 3.11's asyncio.wait_for returns its task's result when the caller is cancelled just as that task
    finishes (gh-86296): Ctrl-C then cancelled nothing, and the run went on to its next cell.
    `stop_if_cancelled`, right after measure_cell's wait_for, raises the cancellation there. The control, the
    same steps without it, shows the swallow where this Python has it."""
    from benchsuite.interrupt import stop_if_cancelled

    async def quick() -> int:
        return 5

    async def measured(check: bool) -> int:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # Ctrl-C lands as the cell's task is about to finish: it runs first, then the cancel
        got = await asyncio.wait_for(quick(), 10)
        if check:
            stop_if_cancelled()
        return got

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(measured(check=True))
    if sys.version_info < (3, 12):  # the control: 3.12 rewrote wait_for, which then raises by itself
        assert asyncio.run(measured(check=False)) == 5
