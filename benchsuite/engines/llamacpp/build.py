"""Building llama-server from source: the pinned llama-cpp-python sdist's vendored llama.cpp
(benchsuite.engines.llamacpp.source: downloaded, or a local full or trimmed copy), CMake, and a
per-user cache of finished builds.

Owns the cache layout
(`~/.cache/benchsuite/llama.cpp/<version>-<cpu|cuda>/bin`), the build stamp (the exact CMake flags,
reused to skip a rebuild and recorded by the engine as its build flags) and the binary lookup in
that cache. The engine adapter looks in the matrix, then PATH, then here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from benchsuite.engines.llamacpp.source import LLAMA_CPP_PYTHON_VERSION, unpack_source
from benchsuite.errors import RunError

STAMP_NAME = "build-stamp.json"
REQUIRED_TARGETS: tuple[str, ...] = (
    "llama-server",
    "llama-bench",
    "llama-batched-bench",
)
OPTIONAL_TARGETS: tuple[str, ...] = ("llama-fit-params",)
DEFAULT_CUDA_ARCH = "90"
CUDA_BIN = Path("/usr/local/cuda/bin")  # where CUDA toolkits install nvcc when it is not on PATH


@dataclass(frozen=True)
class BuildFlags:
    """Everything that decides the binaries; equal flags mean a cached build can be reused."""

    llama_cpp_python_version: str
    cuda: bool
    cuda_architectures: str | None
    cmake_defines: tuple[tuple[str, str], ...]

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["cmake_defines"] = dict(self.cmake_defines)
        return d


@dataclass(frozen=True)
class BuildResult:
    bin_dir: Path
    server_path: Path
    version_text: str
    reused: bool
    build_seconds: float
    flags: BuildFlags


def cache_root() -> Path:
    """Per-user cache; BENCHSUITE_CACHE_DIR overrides it (tests, CI)."""
    override = os.environ.get("BENCHSUITE_CACHE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "benchsuite"


def install_dir(cuda: bool, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_root() / "llama.cpp" / f"{version}-{'cuda' if cuda else 'cpu'}"


def detect_cuda_architectures() -> str:
    """Compute capabilities of the visible GPUs as CMake wants them ("90;89"), or the default."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return DEFAULT_CUDA_ARCH
    archs = sorted({line.strip().replace(".", "") for line in out.splitlines() if line.strip()})
    return ";".join(archs) or DEFAULT_CUDA_ARCH


def build_flags(cuda: bool, cuda_architectures: str | None = None) -> BuildFlags:
    defines: dict[str, str] = {
        "CMAKE_BUILD_TYPE": "Release",
        "BUILD_SHARED_LIBS": "OFF",  # static binaries stay runnable after being copied into bin/
        "LLAMA_BUILD_SERVER": "ON",
        "LLAMA_BUILD_TOOLS": "ON",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_APP": "OFF",
        "LLAMA_CURL": "OFF",
        # The web UI is fetched from the network by default; the benchmark never needs it.
        "LLAMA_BUILD_UI": "OFF",
        "LLAMA_USE_PREBUILT_UI": "OFF",
        "GGML_CUDA": "ON" if cuda else "OFF",
    }
    archs = None
    if cuda:
        archs = cuda_architectures or detect_cuda_architectures()
        defines["CMAKE_CUDA_ARCHITECTURES"] = archs
    return BuildFlags(
        llama_cpp_python_version=LLAMA_CPP_PYTHON_VERSION,
        cuda=cuda,
        cuda_architectures=archs,
        cmake_defines=tuple(sorted(defines.items())),
    )


def read_stamp(bin_dir: Path) -> dict[str, object] | None:
    path = bin_dir.parent / STAMP_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def cached_binary(name: str) -> Path | None:
    """A previously built `name` in the cache, preferring a CUDA build over a CPU one."""
    for cuda in (True, False):
        candidate = install_dir(cuda) / "bin" / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def binary_version(binary: Path) -> str:
    """`<binary> --version` output (llama.cpp prints it on stderr)."""
    try:
        proc = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"
    return (proc.stdout + proc.stderr).strip()


def _run(cmd: list[str], log, env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None) -> None:
    """Run `cmd` with its output in `log`; `on_line` also sees each output line as it comes (progress)."""
    print("+ " + " ".join(cmd), file=log, flush=True)
    if on_line is None:
        returncode = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False, env=env).returncode
    else:
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                on_line(line)
        returncode = proc.returncode
        log.flush()
    if returncode != 0:
        raise RunError(f"command failed with status {returncode}: {' '.join(cmd)}")


def fetch_source(log, sdist: Path | None = None) -> Path:
    """The vendored llama.cpp tree in the cache: from `sdist` (a local full or trimmed sdist, for a
    box without internet), else downloaded once from PyPI (benchsuite.engines.llamacpp.source)."""
    return unpack_source(cache_root() / "llama.cpp" / "src", log, sdist)


def _available_targets(src_dir: Path) -> list[str]:
    targets = list(REQUIRED_TARGETS)
    for name in OPTIONAL_TARGETS:
        tool = name.removeprefix("llama-")
        if (src_dir / "tools" / tool / "CMakeLists.txt").is_file():
            targets.append(name)
    return targets


def cuda_build_env(cuda: bool) -> dict[str, str] | None:
    """The environment for CMake: CMake's CUDA check looks for nvcc on PATH (or CUDACXX); a
    toolkit in /usr/local/cuda that is not on PATH is added (common on fresh GPU boxes)."""
    if not cuda or shutil.which("nvcc") is not None or not (CUDA_BIN / "nvcc").is_file():
        return None
    env = dict(os.environ)
    env["PATH"] = f"{CUDA_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("CUDACXX", str(CUDA_BIN / "nvcc"))
    return env


def build_llama_server(
    cuda: bool,
    jobs: int | None,
    log,
    force: bool = False,
    sdist: Path | None = None,
    phase: Callable[[str], None] = lambda _: None,
    on_line: Callable[[str], None] | None = None,
) -> BuildResult:
    """Build (or reuse) the binaries; `log` receives the CMake output. `sdist`: a local copy of
    the pinned sdist (full or trimmed) instead of the download. `phase` hears each step's name as
    it starts, `on_line` every line the compiler prints (benchsuite.commands.install's progress)."""
    flags = build_flags(cuda)
    dest = install_dir(cuda)
    bin_dir = dest / "bin"
    server = bin_dir / "llama-server"
    if not force and server.is_file() and read_stamp(bin_dir) == flags.to_json():
        return BuildResult(bin_dir, server, binary_version(server), True, 0.0, flags)
    started = time.perf_counter()
    phase("source")
    src_dir = fetch_source(log, sdist)
    build_dir = dest / "build"
    env = cuda_build_env(cuda)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    phase("configure")
    _run(
        [
            "cmake",
            "-S",
            str(src_dir),
            "-B",
            str(build_dir),
            *generator,
            *[f"-D{k}={v}" for k, v in flags.cmake_defines],
        ],
        log,
        env,
    )
    targets = _available_targets(src_dir)
    jobs_n = jobs or os.cpu_count() or 1
    phase("compile")
    _run(["cmake", "--build", str(build_dir), "--target", *targets, "-j", str(jobs_n)], log, env, on_line)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in targets:
        built = build_dir / "bin" / name
        if not built.is_file():
            raise RunError(f"build finished but {built} is missing")
        shutil.copy2(built, bin_dir / name)
    (dest / STAMP_NAME).write_text(json.dumps(flags.to_json(), indent=2, sort_keys=True))
    seconds = time.perf_counter() - started
    return BuildResult(bin_dir, server, binary_version(server), False, seconds, flags)
