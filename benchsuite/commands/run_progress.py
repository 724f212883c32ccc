"""What `benchsuite run` shows while it runs: the `RunEvents` of benchsuite.run.context drawn for a person.

Owns the progress of a run: cells done of the total, the time since the first cell started, and the
time left, estimated from the cells measured so far (`Eta`: the run's elapsed time per finished
cell, server starts and warmups included, times the cells still to run). On a terminal a live line
on stderr (rich) says which cell runs now; every finished cell gets one line on stdout, prefixed with
the same counter, so a log (not a TTY: no live line) still shows how far the run is and how long it
has left. `--quiet` shows nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from benchsuite.config.plan import CellSpec
from benchsuite.engines.base import SHORT_NAMES, ServerSpec
from benchsuite.records import CellResult


@dataclass
class Eta:
    """Cells done of the total and the time left, from the cells measured in this run (an injected
    clock for tests). A search adds cells as it goes: the total grows with them."""

    total: int
    clock: Callable[[], float] = time.perf_counter
    done: int = 0
    started_s: float | None = field(default=None)

    def start(self) -> None:
        if self.started_s is None:
            self.started_s = self.clock()

    def finish_one(self) -> None:
        self.start()
        self.done += 1
        self.total = max(self.total, self.done)

    @property
    def elapsed_s(self) -> float:
        return 0.0 if self.started_s is None else self.clock() - self.started_s

    @property
    def left_s(self) -> float | None:
        """None until a cell has finished (nothing measured yet to estimate from)."""
        if self.done == 0:
            return None
        return self.elapsed_s / self.done * (self.total - self.done)

    def text(self) -> str:
        """ "12/45 cells, 3m10s, ~8m44s left" (no estimate before the first cell ends)."""
        left = self.left_s
        tail = "" if left is None else f", ~{clock_text(left)} left"
        return f"{self.done}/{self.total} cells, {clock_text(self.elapsed_s)}{tail}"


def clock_text(seconds: float) -> str:
    """65 -> "1m05s", 3725 -> "1h02m", 9 -> "9s"."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressEvents:
    """run.context.RunEvents: a live line on stderr where it is a terminal, one line per finished cell."""

    def __init__(self, console: Console, total_cells: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self._console = console
        self._eta = Eta(total_cells, clock)
        live = Console(stderr=True, quiet=console.quiet, highlight=False)
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[timing]}"),
            console=live, transient=True, disable=live.quiet or not live.is_terminal,
        )  # fmt: skip
        self._task = self._progress.add_task("starting", total=total_cells, timing="")

    def __enter__(self) -> ProgressEvents:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def server_starting(self, spec: ServerSpec, cells: int) -> None:
        self._eta.start()
        self._update(f"starting {spec.name} (server {spec.server_id})")

    def cell_started(self, cell: CellSpec) -> None:
        self._eta.start()
        self._update(cell_label(cell))

    def cell_finished(self, cell: CellSpec, result: CellResult) -> None:
        self._eta.finish_one()
        self._progress.update(self._task, total=self._eta.total, completed=self._eta.done)
        self._update(cell_label(cell))
        self._console.print(
            f"[{self._eta.text()}] {result.status:7} {cell_label(cell)}  {outcome(result)}",
            markup=False, highlight=False, soft_wrap=True,
        )  # fmt: skip

    def _update(self, description: str) -> None:
        self._progress.update(self._task, description=description, timing=self._eta.text().partition(", ")[2])


def cell_label(cell: CellSpec) -> str:
    where = f"{cell.workload}/{cell.prompt_class} c={cell.concurrency} r={cell.repeat}"
    return f"{cell.engine}{params_text(cell.params)} {where}"


def outcome(result: CellResult) -> str:
    """A finished cell in a few words: its decode rate, or why it failed: the reason's first line and,
    where the reason carries a log tail, the log's last line (the engine's own error, e.g. a server
    that died at start), not a header that announces lines the terminal would never show."""
    if result.status != "failed":
        if result.concurrency > 1:  # the report's figure at c>=2: all streams' decode-phase aggregate
            agg, one = result.decode_agg_tok_s, result.decode_tok_s_p50
            text = f"decode {'-' if agg is None else format(agg, '.1f')} tok/s all streams"
            return text + ("" if one is None else f" ({one:.1f} one stream's median)")
        rate = result.decode_tok_s_p50
        return f"decode {'-' if rate is None else format(rate, '.1f')} tok/s"
    lines = [line.strip() for line in (result.reason or "").splitlines() if line.strip()]
    if not lines:
        return "failed (no reason recorded)"
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def params_text(params: object, short: bool = False) -> str:
    items = params.items() if isinstance(params, Mapping) else []
    return "".join(f" {SHORT_NAMES.get(k, k) if short else k}={v}" for k, v in items)
