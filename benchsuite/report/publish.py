"""Publishing a report folder whole: its files are written into a fresh temporary folder beside the
target and moved into place under a lock (the previous folder renamed aside, the new one renamed in),
so a reader or a second writer never sees a mix of two reports, only, between the two renames, no
folder; a writer that dies leaves the previous report as it was, or, between the renames, in a
`.<name>.*.old` folder beside it.

Two `benchsuite report` runs into one `--out` publish one after the other (the lock serializes the
swap; each report is whole, the last one stays). A folder that cannot be written, or an existing
folder holding files a report does not write (the user's own), is refused with one line (UserError,
exit 2): publishing replaces the folder, and only a report folder may be replaced.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchsuite.errors import UserError

# what a report folder holds; a folder holding anything else is the user's, never replaced
REPORT_FILES = frozenset({"index.html", "tables.md", "tables.csv"})


@contextmanager
def report_folder(target: Path) -> Iterator[Path]:
    """Yields an empty staging folder; when the block ends without an error it becomes `target`."""
    target = Path(target).absolute()
    _check_replaceable(target)
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=parent))
    except OSError as exc:
        raise UserError(f"cannot write the report folder {target}: {exc.strerror or exc}") from None
    try:
        yield staging
        staging.chmod(0o755)  # mkdtemp makes it 0700
        with _lock(parent / f".{target.name}.lock"):
            _check_replaceable(target)  # another process may have created it meanwhile
            _swap_in(staging, target)
    except OSError as exc:
        raise UserError(f"cannot write the report folder {target}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_replaceable(target: Path) -> None:
    if not target.exists():
        return
    if not target.is_dir():
        raise UserError(f"--out {target} is a file, not a folder")
    if not os.access(target, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the report folder {target}: permission denied")
    foreign = sorted(p.name for p in target.iterdir() if p.name not in REPORT_FILES)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UserError(
            f"--out {target} holds files a report does not write ({shown}); a report replaces its whole "
            "folder: name a new or empty folder"
        )


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits for another writer's swap (milliseconds)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _swap_in(staging: Path, target: Path) -> None:
    if not target.exists():
        staging.rename(target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    target.rename(aside / target.name)
    try:
        staging.rename(target)
    except OSError:
        # put the previous report back; should that fail too, it stays in `aside` (never removed here)
        (aside / target.name).rename(target)
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)  # the new report is in place: the previous one goes
