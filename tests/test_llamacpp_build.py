"""llama-server build from the pinned sdist: flags, cache layout, reuse by stamp (no compile here)."""

from __future__ import annotations

import json
import stat

import pytest

from benchsuite.cli import main as cli_main
from benchsuite.engines.llamacpp import build as build


def _exe(path, body):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCHSUITE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cmake_flags_pin_the_server_tools_and_backend():
    cpu = dict(build.build_flags(cuda=False).cmake_defines)
    assert cpu["LLAMA_BUILD_SERVER"] == "ON" and cpu["LLAMA_BUILD_TOOLS"] == "ON"
    assert cpu["LLAMA_BUILD_EXAMPLES"] == "OFF" and cpu["LLAMA_BUILD_TESTS"] == "OFF"
    assert cpu["GGML_CUDA"] == "OFF" and cpu["CMAKE_BUILD_TYPE"] == "Release" and cpu["LLAMA_CURL"] == "OFF"
    assert "CMAKE_CUDA_ARCHITECTURES" not in cpu
    cuda = build.build_flags(cuda=True, cuda_architectures="90")
    assert dict(cuda.cmake_defines)["GGML_CUDA"] == "ON"
    assert dict(cuda.cmake_defines)["CMAKE_CUDA_ARCHITECTURES"] == "90"


def test_cuda_architectures_from_nvidia_smi(tmp_path, monkeypatch):
    _exe(tmp_path / "bin" / "nvidia-smi", "printf '9.0\\n9.0\\n8.9\\n'\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert build.detect_cuda_architectures() == "89;90"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert build.detect_cuda_architectures() == build.DEFAULT_CUDA_ARCH


def test_install_dir_is_per_version_and_backend(cache):
    assert build.install_dir(cuda=False) == cache / "llama.cpp" / f"{build.LLAMA_CPP_PYTHON_VERSION}-cpu"
    assert build.install_dir(cuda=True).name.endswith("-cuda")


def test_matching_stamp_reuses_the_build_without_compiling(cache, monkeypatch, capsys):
    dest = build.install_dir(cuda=False)
    _exe(dest / "bin" / "llama-server", "echo 'version: 7 (feedbee)' >&2\n")
    (dest / build.STAMP_NAME).write_text(json.dumps(build.build_flags(cuda=False).to_json()))
    monkeypatch.setattr(build, "fetch_source", lambda log: pytest.fail("must not fetch or compile"))
    assert cli_main(["install", "llama-server"]) == 0
    out = capsys.readouterr().out
    assert str(dest / "bin" / "llama-server") in out and "reused cached build" in out
    assert "version: 7 (feedbee)" in out
    assert build.cached_binary("llama-server") == dest / "bin" / "llama-server"


def test_changed_flags_rebuild(cache, monkeypatch):
    dest = build.install_dir(cuda=False)
    _exe(dest / "bin" / "llama-server", "exit 0\n")
    (dest / build.STAMP_NAME).write_text(json.dumps({"old": "flags"}))

    class Rebuilding(Exception):
        pass

    def fetch(log, sdist=None):
        raise Rebuilding

    monkeypatch.setattr(build, "fetch_source", fetch)
    with pytest.raises(Rebuilding):
        build.build_llama_server(cuda=False, jobs=1, log=None)


def test_optional_targets_only_when_the_source_has_them(tmp_path):
    assert build._available_targets(tmp_path) == list(build.REQUIRED_TARGETS)
    (tmp_path / "tools" / "fit-params").mkdir(parents=True)
    (tmp_path / "tools" / "fit-params" / "CMakeLists.txt").write_text("")
    assert build._available_targets(tmp_path)[-1] == "llama-fit-params"
