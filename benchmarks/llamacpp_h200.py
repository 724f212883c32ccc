"""llama.cpp (CUDA) decode on the 48-layer `qwen3-30b-a3b-shape` model for --n-cpu-moe N = 0, 12,
24, 48 and the N llama.cpp's own fitting picks for a 16 GB GPU, batch 1 and 4, on one H200 machine
without internet. Subcommands, so the build can overlap other GPU work:

    python3 benchmarks/llamacpp_h200.py build --jobs 12 --out /tmp/llamacpp_h200
    python3 benchmarks/llamacpp_h200.py gguf --layers 48 --out-file /dev/shm/q48.gguf
    python3 benchmarks/llamacpp_h200.py bench --gguf /dev/shm/q48.gguf --build /tmp/llamacpp_h200 \
        --out $OUT [--n-cpu-moe 0,12,24,48] [--fit-budget-gb 16] [--deadline-s 480]
    python3 benchmarks/llamacpp_h200.py all --out $OUT      # the three above in one call
    python3 benchmarks/llamacpp_h200.py bench ... --cpu     # CPU build from the cache, -ngl 0
    python3 benchmarks/llamacpp_h200.py bench ... --extra='--load-mode none' --out $OUT/nommap

- build: `benchsuite.engines.llamacpp.build.build_llama_server(cuda=True)` (what `benchsuite install
  llama-server --cuda` runs) with BENCHSUITE_CACHE_DIR=<out>/cache, from the trimmed source tarball
  in `.devbuild/` copied to where `fetch_source` looks for the sdist, so nothing is downloaded.
  Writes <out>/build.log and <out>/build.json (status, binaries, version, flags, seconds).
- gguf: `benchsuite.engines.llamacpp.gguf_synth` (Q8_0 experts, bf16/f32 rest, seeded, streamed by parallel
  workers); prints one JSON line with its facts and keeps them in `<file>.json` for the bench.
- bench: see `llamacpp_h200_bench.py` (the cells, the fit, the JSON schema).

Recreating the carried folders (both are ignored by git; carry [".devbuild", ".whl"]):

    mkdir -p .devbuild /tmp/sdist
    python3 -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/sdist
    python3 benchmarks/llamacpp_h200.py pack-source \
        --sdist /tmp/sdist/llama_cpp_python-0.3.36.tar.gz --out .devbuild/llama_cpp_python-0.3.36.tar.gz
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 pyyaml==6.0.3
    # gguf imports yaml at import time (hence pyyaml); tqdm and requests only on paths unused here,
    # so install with --no-deps: python3 -m pip install --no-deps --target /tmp/site .whl/*.whl

`pack-source` keeps `vendor/llama.cpp` without models, docs, tests, examples, the web UI sources
and the GPU backends other than CUDA (25 MB of source, 4.3 MB gzip), byte-stable (sorted members,
no gzip name or mtime): sdist sha256 832db0699007f1be..., trimmed tarball sha256 09f1084483a2acfb....
A CPU build from it was checked (all four tools) and a CUDA configure + one sm_90 object.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from benchsuite.errors import UserError
from benchsuite.engines.llamacpp.build import LLAMA_CPP_PYTHON_VERSION, SDIST_NAME

DEVBUILD_TARBALL = REPO / ".devbuild" / SDIST_NAME
PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
# Under vendor/llama.cpp: nothing a CUDA/CPU build of the four tools reads.
_EXCLUDED = (
    "models/", "docs/", "media/", ".github/", ".devops/", "tests/", "examples/", "benches/",
    "gguf-py/", "conversion/", "pocs/", "ci/", "skills/", "app/", "requirements/", ".gemini/", ".pi/",
    "tools/ui/src/", "tools/ui/tests/", "tools/ui/static/", "tools/server/tests/", "tools/server/bench/",
    "tools/mtmd/tests/", "tools/mtmd/test-",
    *(f"ggml/src/ggml-{b}/" for b in (
        "vulkan", "sycl", "opencl", "hexagon", "metal", "webgpu", "cann", "openvino", "et", "virtgpu", "zdnn",
        "zendnn",
    )),
)  # fmt: skip
CUDA_BIN = Path("/usr/local/cuda/bin")


def pack_source(sdist: Path, out: Path) -> dict[str, Any]:
    """The trimmed, byte-stable copy of the sdist that `fetch_source` accepts."""
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    tmp = out.with_name(f".{out.name}.tmp")
    with (
        tarfile.open(sdist) as src,
        open(tmp, "wb") as raw,
        gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as dst,
    ):
        for m in sorted(src.getmembers(), key=lambda m: m.name):
            rel = m.name[len(PREFIX) :] if m.name.startswith(PREFIX) else None
            if rel is None or any(rel.startswith(x) for x in _EXCLUDED):
                continue
            m.uid = m.gid = 0
            m.uname = m.gname = ""
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
            kept += 1
    os.replace(tmp, out)
    return {"path": str(out), "bytes": out.stat().st_size, "members": kept, "sha256": _sha256(out)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _version_line(argv: list[str], contains: str = "version") -> str | None:
    """The first output line of `argv` that mentions `contains` (tool versions for the record)."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return next((x.strip() for x in (p.stdout + p.stderr).splitlines() if contains in x), None)


def build(out: Path, jobs: int | None, source: Path, cuda: bool, force: bool) -> int:
    """Build into <out>/cache; <out>/build.json says how it went (written last, also on failure)."""
    from benchsuite.engines.llamacpp.build import build_llama_server

    out.mkdir(parents=True, exist_ok=True)
    status_path = out / "build.json"
    previous = json.loads(status_path.read_text()) if status_path.is_file() else {}
    status_path.unlink(missing_ok=True)
    (out / "build.started").write_text(f"{os.getpid()} {time.time()}\n")
    os.environ["BENCHSUITE_CACHE_DIR"] = str(out / "cache")
    if cuda and shutil.which("nvcc") is None and (CUDA_BIN / "nvcc").is_file():
        # CMake's CUDA language check looks on PATH (and CUDACXX) for nvcc.
        os.environ["PATH"] = f"{CUDA_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        os.environ.setdefault("CUDACXX", str(CUDA_BIN / "nvcc"))
    record: dict[str, Any] = {
        "source": str(source), "source_sha256": _sha256(source) if source.is_file() else None, "jobs": jobs,
        "cmake_version": _version_line(["cmake", "--version"]),
        "nvcc_version": _version_line(["nvcc", "--version"], "release") if cuda else None,
    }  # fmt: skip
    started = time.perf_counter()
    try:
        if not source.is_file():
            raise FileNotFoundError(f"{source} is missing (see this script's docstring to recreate .devbuild/)")
        sdist = out / "cache" / "llama.cpp" / "src" / SDIST_NAME
        sdist.parent.mkdir(parents=True, exist_ok=True)
        if not sdist.is_file() or _sha256(sdist) != record["source_sha256"]:
            shutil.copyfile(source, sdist)
        with open(out / "build.log", "a") as log:
            result = build_llama_server(cuda=cuda, jobs=jobs, log=log, force=force)
        record |= {
            "status": "ok", "bin_dir": str(result.bin_dir), "version_text": result.version_text,
            "reused": result.reused, "build_s": round(result.build_seconds, 1), "flags": result.flags.to_json(),
        }  # fmt: skip
        if result.reused and previous.get("status") == "ok":  # a reuse keeps the seconds of the real build
            record |= {"build_s": previous.get("build_s"), "jobs": previous.get("jobs")}
    except Exception as exc:  # noqa: BLE001 - the status file must say why, whatever failed
        record |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "log_tail": _tail(out / "build.log")}
    record["wall_s"] = round(time.perf_counter() - started, 1)
    _write_json(status_path, record)
    print(json.dumps({k: v for k, v in record.items() if k != "log_tail"}, indent=1))
    if record["status"] != "ok":
        print(record.get("log_tail", ""), file=sys.stderr)
    return 0 if record["status"] == "ok" else 1


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def gguf(out_file: Path, layers: int, seed: int, workers: int | None, preset: str) -> dict[str, Any]:
    from benchsuite.engines.llamacpp.gguf_synth import write_synthetic_gguf

    s = write_synthetic_gguf(out_file, preset=preset, layers=layers, seed=seed, workers=workers)
    facts = {
        "path": str(s.path), "bytes": s.bytes, "layers": s.layers, "expert_type": s.expert_type.upper(),
        "expert_bytes": s.expert_bytes, "write_s": round(s.write_s, 2), "seed": s.seed, "preset": preset,
        "dense_type": s.dense_type, "workers": s.workers,
    }  # fmt: skip
    _write_json(gguf_facts_path(s.path), facts)
    print(json.dumps(facts))
    return facts


def gguf_facts_path(gguf_path: Path) -> Path:
    return gguf_path.with_name(gguf_path.name + ".json")


def default_gguf_path(size_bytes: int) -> Path:
    """/dev/shm when it holds the file with 4 GB to spare (no disk in the way), else /tmp."""
    try:
        if shutil.disk_usage("/dev/shm").free > size_bytes + 4e9:
            return Path("/dev/shm/llamacpp_h200.gguf")
    except OSError:
        pass
    return Path("/tmp/llamacpp_h200.gguf")


def run_all(args: argparse.Namespace) -> int:
    """Build in a child process while the GGUF is written with the cores left over, then bench."""
    build_dir = Path(args.build_dir)
    build_argv = [sys.executable, __file__, "build", "--jobs", str(args.jobs), "--out", str(build_dir)]
    child = subprocess.Popen(
        [*build_argv, *(["--cpu"] if args.cpu else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        cores = len(os.sched_getaffinity(0))
        gguf_path = Path(args.gguf_file) if args.gguf_file else default_gguf_path(int(33e9 * args.layers / 48))
        if not gguf_path.is_file() or not gguf_facts_path(gguf_path).is_file():
            gguf(gguf_path, args.layers, args.seed, max(2, cores - args.jobs), args.preset)
        try:
            child.wait(timeout=args.build_timeout_s)
        except subprocess.TimeoutExpired:
            print(f"the build overran {args.build_timeout_s:.0f} s; see {build_dir}/build.log", file=sys.stderr)
    finally:
        if child.poll() is None:  # gguf failed or the build overran: the build dies with its group
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    from llamacpp_h200_bench import bench_main

    bench_argv = ["--gguf", str(gguf_path), "--build", str(build_dir), "--out", str(args.out), "--wait-build-s", "0"]
    return bench_main([*bench_argv, *(["--cpu"] if args.cpu else []), *args.bench_args], command=sys.argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from llamacpp_h200_bench import bench_main

        return bench_main(argv[1:], command=[sys.argv[0], *argv])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("bench", help="measure (see --help of `bench`)")
    b = sub.add_parser("build", help="build llama.cpp from the carried source")
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--jobs", type=int, default=None)
    b.add_argument("--source", type=Path, default=DEVBUILD_TARBALL)
    b.add_argument("--cpu", action="store_true", help="GGML_CUDA=OFF")
    b.add_argument("--force", action="store_true")
    g = sub.add_parser("gguf", help="write the synthetic GGUF")
    g.add_argument("--out-file", required=True, type=Path)
    g.add_argument("--layers", type=int, default=48)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--workers", type=int, default=None, help="default: every core")
    g.add_argument("--preset", default="qwen3-30b-a3b-shape")
    p = sub.add_parser("pack-source", help="trim the llama-cpp-python sdist into .devbuild/")
    p.add_argument("--sdist", required=True, type=Path)
    p.add_argument("--out", type=Path, default=DEVBUILD_TARBALL)
    a = sub.add_parser("all", help="build (background) + gguf, then bench; extra args after -- go to bench")
    a.add_argument("--out", required=True, type=Path)
    a.add_argument("--build-dir", default="/tmp/llamacpp_h200")
    a.add_argument("--gguf-file", default=None, help="default: /dev/shm if it has room, else /tmp")
    a.add_argument("--jobs", type=int, default=12)
    a.add_argument("--build-timeout-s", type=float, default=900.0)
    a.add_argument("--layers", type=int, default=48)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--preset", default="qwen3-30b-a3b-shape")
    a.add_argument("--cpu", action="store_true", help="CPU build and -ngl 0 (for a dry run without a GPU)")
    a.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    try:
        return _dispatch(args)
    except UserError as exc:  # no space for the GGUF, unknown preset: one line, not a traceback
        print(f"llamacpp_h200: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "build":
        return build(args.out, args.jobs, args.source, cuda=not args.cpu, force=args.force)
    if args.cmd == "gguf":
        gguf(args.out_file, args.layers, args.seed, args.workers, args.preset)
        return 0
    if args.cmd == "pack-source":
        print(json.dumps(pack_source(args.sdist, args.out)))
        return 0
    args.bench_args = [x for x in args.bench_args if x != "--"]
    return run_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
