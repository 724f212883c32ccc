"""Whether a workload's dataset file can give the run its prompts, checked before anything starts.

Owns `dataset_problems(plan)`: one line per ShareGPT file (dataset `sharegpt`) that exists but cannot
serve its workload (unreadable, not JSON nor JSON Lines, no usable conversation, fewer than the
workload's requests), naming the file and what is wrong (the first bad line of a JSON Lines file).
A file that does not exist is the matrix's problem (benchsuite.config.matrix) and is not repeated.

The check reads the file the way `benchsuite.load.datasets.load_sharegpt` does (a JSON list of
conversations, else JSON Lines; the first human turn of each) but streams it, one conversation at a
time, and stops once it has the prompts the workload needs; then it reads the file's last 64 KiB to
catch a truncated download (a JSON list that never closes, a cut last line). Its cost is bounded by
the prompts the run needs, not by the file: a 600 MB ShareGPT dump is checked in milliseconds. What
it does not read (a defect in the middle of a big file) the loader still reports, in one line, at
the first cell that needs the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from benchsuite.config.plan import Plan

_CHUNK_CHARS = 1 << 16
MAX_ITEM_CHARS = 1 << 24  # a conversation that does not decode within 16 Mi characters is called malformed
TAIL_BYTES = 1 << 16  # how much of the file's end is read for a truncated download
_HUMAN_ROLES = ("human", "user")  # as benchsuite.load.datasets reads a conversation
_FORMAT = '[{"id": ..., "conversations": [{"from": "human", "value": ...}, ...]}]'


class _Bad(Exception):
    """What is wrong with the file, in words."""


@dataclass
class _Count:
    items: int = 0
    with_conversations: int = 0
    usable: int = 0  # conversations that start with a non-empty human turn


def dataset_problems(plan: Plan) -> list[str]:
    """One line per workload whose ShareGPT file exists here but cannot give it its prompts."""
    matrix = plan.matrix
    lines = []
    for name, workload in matrix.matrix.workloads.items():
        if workload.dataset != "sharegpt" or not workload.path:
            continue
        path = Path(workload.path)
        if not path.is_file():  # listed by the matrix as no such file (a dry run: as unresolved)
            continue
        problem = sharegpt_problem(path, workload.num_requests)
        if problem is not None:
            lines.append(f"{matrix.source}: workloads.{name}.path: {path}: {problem}")
    return list(dict.fromkeys(lines))


def sharegpt_problem(path: Path, needed: int) -> str | None:
    """What stops `path` from giving `needed` ShareGPT prompts, or None when it can."""
    if path.is_dir():
        return "is a directory, not a ShareGPT JSON file"
    count = _Count()
    try:
        with path.open(encoding="utf-8", errors="replace") as stream:  # as the loader decodes it
            first = _first_char(stream)
            if first == "":
                return "the file is empty"
            stream.seek(0)
            items = _list_items(stream) if first == "[" else _lines(stream)
            for item in items:
                _tally(count, item)
                if count.usable >= needed:
                    break
        _check_tail(path, first)
    except OSError as exc:
        return f"cannot read ({exc.strerror or exc})"
    except _Bad as bad:
        return str(bad)
    if count.items == 0:
        return f"holds no conversation; expected the ShareGPT format {_FORMAT}"
    if count.with_conversations == 0:
        return f"no item has a 'conversations' list; expected the ShareGPT format {_FORMAT}"
    if count.usable < needed:
        return f"only {count.usable} conversations start with a human turn, the workload sends {needed} requests"
    return None


def _tally(count: _Count, item: Any) -> None:
    count.items += 1
    turns = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(turns, list):
        return
    count.with_conversations += 1
    first = next((t for t in turns if isinstance(t, dict) and t.get("from") in _HUMAN_ROLES), None)
    if first is not None and isinstance(first.get("value"), str) and first["value"].strip():
        count.usable += 1


def _first_char(stream: TextIO) -> str:
    while True:
        chunk = stream.read(_CHUNK_CHARS)
        if not chunk:
            return ""
        stripped = chunk.lstrip()
        if stripped:
            return stripped[0]


def _list_items(stream: TextIO) -> Iterator[Any]:
    """The items of a JSON list, decoded one at a time from a buffer refilled in chunks."""
    decoder = json.JSONDecoder()
    buffer, line_before = "", 1  # line_before: the file line where `buffer` starts
    at_eof = False

    def refill(chars: int = _CHUNK_CHARS) -> bool:
        nonlocal buffer, at_eof
        chunk = stream.read(chars)
        at_eof = not chunk
        buffer += chunk
        return bool(chunk)

    def skip_space() -> None:
        nonlocal buffer, line_before
        while True:
            stripped = buffer.lstrip()
            line_before += buffer.count("\n", 0, len(buffer) - len(stripped))
            buffer = stripped
            if buffer or not refill():
                return

    def not_json(reason: str, offset: int = 0) -> _Bad:
        line = line_before + buffer.count("\n", 0, offset)
        return _Bad(f"not valid JSON ({reason} at line {line})")

    refill()
    skip_space()
    buffer = buffer[1:]  # the opening "["
    skip_space()
    if buffer.startswith("]"):
        return
    while True:
        chars = _CHUNK_CHARS
        while True:  # decode one item; a chunk may end inside it: read twice as much each retry
            try:
                item, end = decoder.raw_decode(buffer)
                break
            except json.JSONDecodeError as exc:
                if at_eof or len(buffer) > MAX_ITEM_CHARS or not refill(chars):
                    raise not_json(exc.msg, exc.pos) from None
                chars *= 2
        if end == len(buffer) and not at_eof:
            refill()  # a number could go on in the next chunk: decode it whole
            try:
                item, end = decoder.raw_decode(buffer)
            except json.JSONDecodeError as exc:
                raise not_json(exc.msg, exc.pos) from None
        line_before += buffer.count("\n", 0, end)
        buffer = buffer[end:]
        yield item
        skip_space()
        if buffer.startswith("]"):
            return
        if not buffer.startswith(","):
            raise not_json("expected ',' or ']' after a conversation" if buffer else "the list never closes")
        buffer = buffer[1:]
        skip_space()


def _lines(stream: TextIO) -> Iterator[Any]:
    """JSON Lines: each non-blank line one JSON value; the first that is not one is reported."""
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            raise _bad_line(number, exc) from None


def _bad_line(number: int, exc: json.JSONDecodeError) -> _Bad:
    return _Bad(f"line {number} is not valid JSON ({exc.msg}): neither a JSON list nor JSON Lines")


def _check_tail(path: Path, first: str) -> None:
    """A truncated download: a JSON list must end with "]", a JSON Lines file's last line must parse
    (the line is named by its number, as the first bad line would be)."""
    size = path.stat().st_size
    with path.open("rb") as raw:
        raw.seek(max(0, size - TAIL_BYTES))
        tail = raw.read().decode("utf-8", errors="replace").rstrip()
    if first == "[":
        if not tail.endswith("]"):
            raise _Bad("not valid JSON: the list does not end with ']' (a truncated download?)")
        return
    last_start = tail.rfind("\n") + 1
    if last_start == 0 and size > TAIL_BYTES:
        return  # the last line is longer than the tail read: left to the loader
    try:
        json.loads(tail[last_start:])
    except json.JSONDecodeError as exc:
        raise _bad_line(_line_count(path), exc) from None


def _line_count(path: Path) -> int:
    """The number of the file's last non-blank line (counted in bytes: bounded memory)."""
    number, last = 0, 0
    with path.open("rb") as raw:
        for number, line in enumerate(raw, 1):  # noqa: B007 - the count is the result
            if line.strip():
                last = number
    return last
