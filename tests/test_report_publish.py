"""A report folder is published whole (issue 27): two `benchsuite report` runs into one `--out` give
whole reports in sequence, never a mix or a traceback; a folder that cannot be written, or that holds
the user's own files, gets one line and exit 2. Before the fix the two writers shared
`index.html.tmp` (one died with a traceback in 3 of 3 trials) and the folder mixed both runs' files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from benchsuite.cli import main as cli_main
from benchsuite.report import write_report

FIXTURE = Path(__file__).parent / "data" / "report_fixture"
REFERENCE_DIRS = [FIXTURE / "reference"]
ROOT = Path(__file__).resolve().parents[1]


def renamed_run(tmp_path: Path, run_id: str) -> Path:
    run = tmp_path / run_id
    shutil.copytree(FIXTURE, run)
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "run_id": run_id}))
    pd.read_parquet(run / "cells.parquet").assign(run_id=run_id).to_parquet(run / "cells.parquet", index=False)
    return run


def report_ids(folder: Path) -> dict[str, set[str]]:
    """Which run ids each of the three files speaks of."""
    ids = ("run-a", "run-b")
    return {
        name: {i for i in ids if i in (folder / name).read_text(encoding="utf-8")}
        for name in ("index.html", "tables.md", "tables.csv")
    }


def test_two_writers_into_one_folder_leave_one_whole_report(tmp_path: Path) -> None:
    runs = [renamed_run(tmp_path, "run-a"), renamed_run(tmp_path, "run-b")]
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(2):
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "benchsuite", "report", str(run), "--out", str(out)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )  # fmt: skip
            for run in runs
        ]
        results = [p.communicate(timeout=240) for p in procs]
        for proc, (stdout, stderr) in zip(procs, results, strict=True):
            assert "Traceback" not in stderr, stderr
            assert proc.returncode == 0, stderr
            assert stdout.strip() == str(out / "index.html")
        assert {p.name for p in tmp_path.iterdir()} <= {"out", "run-a", "run-b", ".out.lock"}
        assert {p.name for p in out.iterdir()} == {"index.html", "tables.md", "tables.csv"}
        seen = report_ids(out)
        assert seen["index.html"] in ({"run-a"}, {"run-b"}), seen
        assert seen["tables.md"] == seen["tables.csv"] == seen["index.html"], seen
        assert (out / "index.html").read_text(encoding="utf-8").rstrip().endswith("</html>")


def test_interleaved_writers_never_mix_their_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writes of two reports interleaved on purpose: run-b's tables.md late, run-a's tables.csv
    later still. Written in place, the folder ended as index/md from one run and csv from the other."""
    import threading
    import time

    from benchsuite.report import build

    def slowed(write: Any, delays_s: dict[str, float]) -> Any:
        def slow(path: Path, *args: Any) -> None:
            run = next((r for r in delays_s if r in str(args)), "")
            time.sleep(delays_s.get(run, 0.0))
            write(path, *args)

        return slow

    monkeypatch.setattr(build, "write_markdown", slowed(build.write_markdown, {"run-b": 3.0}))
    monkeypatch.setattr(build, "write_csv", slowed(build.write_csv, {"run-a": 6.0}))
    out = tmp_path / "out"
    errors: list[BaseException] = []

    def writer(run: Path) -> None:
        try:
            write_report([run], out, reference_dirs=REFERENCE_DIRS)
        except BaseException as exc:  # a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(renamed_run(tmp_path, r),)) for r in ("run-a", "run-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert errors == []
    seen = report_ids(out)
    assert (
        seen["index.html"] in ({"run-a"}, {"run-b"}) and seen["tables.md"] == seen["tables.csv"] == seen["index.html"]
    )


def test_a_rewrite_replaces_the_whole_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_report([renamed_run(tmp_path, "run-a")], out, reference_dirs=REFERENCE_DIRS)
    write_report([renamed_run(tmp_path, "run-b")], out, reference_dirs=REFERENCE_DIRS)
    assert report_ids(out) == {"index.html": {"run-b"}, "tables.md": {"run-b"}, "tables.csv": {"run-b"}}


def test_a_folder_with_the_users_files_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli_main(["report", str(FIXTURE), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "notes.txt" in err and str(out) in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("where", ["under-a-file", "a-file", "read-only"])
def test_an_unwritable_folder_gets_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = {"under-a-file": blocker / "report", "a-file": blocker, "read-only": tmp_path / "ro" / "report"}[where]
    if where == "read-only":
        out.parent.mkdir()
        out.parent.chmod(0o555)
        if os.access(out.parent, os.W_OK):  # root (CI): permissions do not stop writes; sysfs refuses anyone
            out = Path("/sys/benchsuite-report")
    try:
        assert cli_main(["report", str(FIXTURE), "--out", str(out)]) == 2
    finally:
        if where == "read-only":
            out.parent.chmod(0o755)
    err = capsys.readouterr().err
    assert err.startswith("benchsuite: error: ") and err.count("\n") == 1, err


def test_a_failed_swap_never_deletes_the_previous_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new report cannot be moved in and the previous one cannot be moved back: the previous
    report stays on disk (beside the target), never removed with the swap's scratch folder."""
    from benchsuite.errors import UserError
    from benchsuite.report import publish

    target = tmp_path / "out"
    target.mkdir()
    (target / "index.html").write_text("previous")
    real_rename = Path.rename

    def failing(self: Path, dest: Any) -> Path:
        if self.name.endswith(".partial") or Path(dest) == target.absolute():
            raise OSError(5, "I/O error")  # the new one's move in, then the old one's move back
        return real_rename(self, dest)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(UserError), publish.report_folder(target) as staging:
        (staging / "index.html").write_text("new")
    kept = [p.read_text() for p in tmp_path.rglob("index.html")]
    assert kept == ["previous"]
