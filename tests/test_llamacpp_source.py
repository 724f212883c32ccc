"""The pinned llama.cpp source from local files: `benchsuite install llama-server --pack-source`
trims an sdist byte-stably, and `--source` builds from a local sdist (full or trimmed) without the
network: here a stand-in sdist whose CMake project makes the three server tools from one C file."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from benchsuite.cli import main as cli_main
from benchsuite.engines.llamacpp import build
from benchsuite.engines.llamacpp.source import VENDOR_PREFIX

TOP = VENDOR_PREFIX.split("/", 1)[0] + "/"
TOOL_C = b'#include <stdio.h>\nint main(void) { fprintf(stderr, "version: 1 (offline)\\n"); return 0; }\n'
CMAKE = b"""cmake_minimum_required(VERSION 3.14)
project(standin C)
foreach(t llama-server llama-bench llama-batched-bench)
  add_executable(${t} tool.c)
  set_target_properties(${t} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
endforeach()
"""


def write_sdist(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.uid, info.uname = 1000, "someone"
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def sdist(tmp_path: Path) -> Path:
    return write_sdist(tmp_path / "sdist.tar.gz", {
        TOP + "llama_cpp/__init__.py": b"x",
        VENDOR_PREFIX + "CMakeLists.txt": CMAKE,
        VENDOR_PREFIX + "tool.c": TOOL_C,
        VENDOR_PREFIX + "ggml/src/ggml-cuda/mmq.cu": b"cuda",
        VENDOR_PREFIX + "ggml/src/ggml-vulkan/v.cpp": b"vk",
        VENDOR_PREFIX + "models/ggml-vocab.gguf": b"big",
        VENDOR_PREFIX + "tools/server/server.cpp": b"srv",
        VENDOR_PREFIX + "tools/server/tests/t.py": b"t",
    })  # fmt: skip


def test_pack_source_keeps_the_build_tree_only_and_is_byte_stable(
    sdist: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        cli_main(["install", "llama-server", "--source", str(sdist), "--pack-source", str(tmp_path / "a" / "s.tar.gz")])
        == 0
    )
    a = json.loads(capsys.readouterr().out)
    assert (
        cli_main(["install", "llama-server", "--source", str(sdist), "--pack-source", str(tmp_path / "b" / "s.tar.gz")])
        == 0
    )
    b = json.loads(capsys.readouterr().out)
    assert (
        a["sha256"] == b["sha256"] and a["members"] == 4 and a["bytes"] == (tmp_path / "a" / "s.tar.gz").stat().st_size
    )
    with tarfile.open(a["path"]) as tar:
        names = sorted(tar.getnames())
        assert {m.uname for m in tar.getmembers()} == {""}
    kept = ("CMakeLists.txt", "ggml/src/ggml-cuda/mmq.cu", "tool.c", "tools/server/server.cpp")
    assert names == sorted(VENDOR_PREFIX + n for n in kept)


def test_a_file_that_is_not_the_pinned_sdist_is_refused_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = write_sdist(tmp_path / "other.tar.gz", {"llama_cpp_python-0.0.1/vendor/llama.cpp/CMakeLists.txt": b""})
    assert cli_main(["install", "llama-server", "--source", str(other)]) == 2
    assert f"not the llama-cpp-python {build.LLAMA_CPP_PYTHON_VERSION} sdist" in capsys.readouterr().err
    assert cli_main(["install", "llama-server", "--source", str(tmp_path / "none.tar.gz")]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("cc") is None, reason="needs cmake and a C compiler")
def test_install_builds_from_a_local_trimmed_sdist_without_the_network(
    sdist: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BENCHSUITE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(
        "benchsuite.engines.llamacpp.source.download_sdist", lambda *a: pytest.fail("must not download")
    )
    trimmed = tmp_path / "trimmed.tar.gz"
    assert cli_main(["install", "llama-server", "--source", str(sdist), "--pack-source", str(trimmed)]) == 0
    assert cli_main(["install", "llama-server", "--source", str(trimmed), "--jobs", "1"]) == 0
    out = capfd.readouterr().out
    server = build.install_dir(cuda=False) / "bin" / "llama-server"
    assert f"{server} (built in" in out and "version: 1 (offline)" in out
    assert build.cached_binary("llama-bench") == server.parent / "llama-bench"
