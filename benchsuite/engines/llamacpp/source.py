"""The pinned llama.cpp source: the llama-cpp-python sdist that vendors it, from PyPI or a local file,
unpacked into the cache; and its trimmed, byte-stable copy for GPU boxes without internet.

Owns the sdist's name and layout (`llama_cpp_python-<version>/vendor/llama.cpp/`), the check that a
local file is that sdist, the unpacking, and `pack_source`: only what a CPU or CUDA build of the
server tools reads (no models, docs, tests, examples, web UI sources, or GPU backends other than
CUDA: 25 MB of source, about 4.3 MB gzipped for 0.3.36, from a 60 MB sdist), members sorted, owners
and the gzip name and time cleared, so the same sdist always packs to the same bytes. Either the
full sdist or the trimmed copy builds (benchsuite.engines.llamacpp.build).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchsuite.errors import RunError, UserError

# llama-cpp-python's sdist vendors a llama.cpp tree; pinning the Python package pins llama.cpp.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
VENDOR_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
# Under vendor/llama.cpp: nothing a CUDA or CPU build of the server tools reads.
TRIMMED_PREFIXES: tuple[str, ...] = (
    "models/", "docs/", "media/", ".github/", ".devops/", "tests/", "examples/", "benches/",
    "gguf-py/", "conversion/", "pocs/", "ci/", "skills/", "app/", "requirements/", ".gemini/", ".pi/",
    "tools/ui/src/", "tools/ui/tests/", "tools/ui/static/", "tools/server/tests/", "tools/server/bench/",
    "tools/mtmd/tests/", "tools/mtmd/test-",
    *(f"ggml/src/ggml-{b}/" for b in (
        "vulkan", "sycl", "opencl", "hexagon", "metal", "webgpu", "cann", "openvino", "et", "virtgpu", "zdnn",
        "zendnn",
    )),
)  # fmt: skip


@dataclass(frozen=True)
class PackedSource:
    path: Path
    bytes: int
    members: int
    sha256: str
    sdist_sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "bytes": self.bytes, "members": self.members, "sha256": self.sha256,
                "sdist_sha256": self.sdist_sha256}  # fmt: skip


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sdist(sdist: Path) -> None:
    """UserError unless `sdist` is a tarball holding the pinned version's vendor/llama.cpp tree."""
    if not sdist.is_file():
        raise UserError(f"--source {sdist}: no such file")
    try:
        with tarfile.open(sdist) as tar:
            names = tar.getnames()
    except (tarfile.TarError, OSError) as exc:
        raise UserError(f"--source {sdist}: not a readable tarball ({exc})") from None
    if VENDOR_PREFIX + "CMakeLists.txt" not in names:
        raise UserError(
            f"--source {sdist}: not the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist "
            f"(no {VENDOR_PREFIX}CMakeLists.txt); get it with `pip download --no-deps --no-binary :all: "
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}`"
        )


def download_sdist(dest_dir: Path, log: Any) -> Path:
    """`pip download` the pinned sdist into `dest_dir` (once); needs the network."""
    sdist = dest_dir / SDIST_NAME
    if sdist.is_file():
        return sdist
    dest_dir.mkdir(parents=True, exist_ok=True)
    # --no-binary only for this package: build deps (used for metadata) may stay wheels.
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dest_dir)]  # fmt: skip
    print("+ " + " ".join(argv), file=log, flush=True)
    proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0 or not sdist.is_file():
        raise RunError(
            f"pip download of llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} failed (status {proc.returncode}); "
            "without internet, pass --source with a local copy of the sdist"
        )
    return sdist


def unpack_source(src_root: Path, log: Any, sdist: Path | None = None) -> Path:
    """The vendored llama.cpp tree under `src_root`, unpacked once from `sdist` (a local full or
    trimmed sdist) or from the sdist downloaded from PyPI when none is given."""
    src_dir = src_root / VENDOR_PREFIX.rstrip("/")
    if (src_dir / "CMakeLists.txt").is_file():
        return src_dir
    if sdist is None:
        sdist = download_sdist(src_root, log)
    else:
        check_sdist(sdist)
    src_root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(VENDOR_PREFIX)]
        tar.extractall(src_root, members=members, filter="data")
    if not (src_dir / "CMakeLists.txt").is_file():
        raise RunError(f"{sdist} has no {VENDOR_PREFIX}CMakeLists.txt")
    return src_dir


def pack_source(sdist: Path, out: Path) -> PackedSource:
    """Write the trimmed, byte-stable copy of `sdist` to `out` (atomically)."""
    check_sdist(sdist)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with (
            tarfile.open(sdist) as src,
            open(tmp, "wb") as raw,
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as dst,
        ):
            for m in sorted(src.getmembers(), key=lambda m: m.name):
                rel = m.name[len(VENDOR_PREFIX) :] if m.name.startswith(VENDOR_PREFIX) else None
                if rel is None or rel.startswith(TRIMMED_PREFIXES):
                    continue
                m.uid = m.gid = 0
                m.uname = m.gname = ""
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)
                kept += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return PackedSource(out, out.stat().st_size, kept, sha256_file(out), sha256_file(sdist))
