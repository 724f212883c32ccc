"""`benchsuite install llama-server` is quiet by default: a line per phase, the compiler's thousands of
lines in build.log (its path printed), the log's last lines on a failure; `--verbose` streams it all.
A fake `cmake` on PATH stands in for the 11-minute compile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchsuite.cli import main
from benchsuite.commands.install import FAIL_TAIL_LINES
from benchsuite.engines.llamacpp import build

FAKE_CMAKE = """#!/bin/sh
if [ "$1" = "--build" ]; then
  i=1
  while [ $i -le 200 ]; do
    echo "[$i/200] Building CXX object ggml/src/file$i.cpp.o"
    echo "ggml/src/file$i.cpp:10:5: warning: unused variable 'x$i' [-Wunused-variable]"
    i=$((i + 1))
  done
  if [ -n "$FAKE_CMAKE_FAIL" ]; then echo "error: the compiler gave up"; exit 1; fi
  mkdir -p "$2/bin"
  for t in llama-server llama-bench llama-batched-bench; do
    printf '#!/bin/sh\\necho "version: 1 (fake)"\\n' > "$2/bin/$t"; chmod +x "$2/bin/$t"
  done
else
  echo "-- The C compiler identification is GNU"
fi
"""


@pytest.fixture
def fake_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    cmake = bin_dir / "cmake"
    cmake.write_text(FAKE_CMAKE)
    cmake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("BENCHSUITE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    monkeypatch.setattr(build, "fetch_source", lambda log, sdist=None: src)
    return build.install_dir(cuda=False) / "build.log"


def test_a_build_prints_its_phases_and_keeps_the_compiler_output_in_a_log(
    fake_build: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "llama-server", "--jobs", "1"]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert err[0].startswith("building llama-server: about 11 minutes") and err[0].endswith(f"full log: {fake_build}")
    assert err[1:] == [
        "  unpacking the pinned llama.cpp source",
        "  configuring (cmake)",
        "  compiling",
        "  compiling: 50/200",  # a log, not a terminal: every quarter
        "  compiling: 100/200",
        "  compiling: 150/200",
        "  compiling: 200/200",
    ]
    assert "built in" in captured.out and "warning" not in captured.out + captured.err
    log = fake_build.read_text()
    assert log.count("warning: unused variable") == 200 and "-- The C compiler identification" in log


def test_a_failed_build_shows_the_logs_last_lines_and_its_path(
    fake_build: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "1")
    assert main(["install", "llama-server", "--jobs", "1"]) == 1
    err = capsys.readouterr().err
    tail = err[err.index(f"--- last {FAIL_TAIL_LINES} lines of {fake_build} ---") :].splitlines()
    assert len(tail) == 1 + FAIL_TAIL_LINES + 2  # header, the lines, the full log's path, the error
    assert tail[FAIL_TAIL_LINES] == "error: the compiler gave up"
    assert tail[-2] == f"--- full log: {fake_build}"
    assert tail[-1].startswith("benchsuite: error: command failed with status 1: cmake --build")


def test_verbose_streams_everything(fake_build: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["install", "llama-server", "--jobs", "1", "--verbose"]) == 0
    err = capfd.readouterr().err
    assert err.count("warning: unused variable") == 200 and not fake_build.exists()
