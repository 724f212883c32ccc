"""Machine facts and provenance for the manifest: CPU, cores, RAM, GPU (name, driver, VRAM, PCIe
generation and width via nvidia-smi when present), OS, Python, package versions, and the git
commit and dirty flag of the benchsuite source. Every probe that cannot answer gives None, never
a made-up value, and no probe may fail a run.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import psutil

PACKAGES = ("benchsuite", "torch", "aiohttp", "pydantic", "pandas", "pyarrow", "numpy", "sglang", "gguf")
_GPU_FIELDS = (
    "name",
    "driver_version",
    "memory.total",
    "pcie.link.gen.current",
    "pcie.link.width.current",
    "pcie.link.gen.max",
    "pcie.link.width.max",
)
_PROBE_TIMEOUT_S = 10.0
_SOURCE_DIR = Path(__file__).resolve().parent.parent


def machine_facts() -> dict[str, Any]:
    """Everything about this machine a reader needs to compare numbers across boxes."""
    memory = psutil.virtual_memory()
    return {
        "hostname": platform.node(),
        "os": platform.platform(),
        "wsl": "microsoft" in platform.release().lower(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_cores_logical": os.cpu_count(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "ram_bytes": int(memory.total),
        "gpus": gpu_facts(),
        "packages": package_versions(),
    }


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def gpu_facts() -> list[dict[str, Any]]:
    """One entry per NVIDIA GPU from nvidia-smi; [] when there is none (or no nvidia-smi)."""
    out = _run(["nvidia-smi", f"--query-gpu={','.join(_GPU_FIELDS)}", "--format=csv,noheader,nounits"])
    if out is None:
        return []
    gpus = []
    for line in out.splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(_GPU_FIELDS):
            continue
        name, driver, mem_mib, gen, width, gen_max, width_max = values
        gpus.append(
            {
                "name": name,
                "driver": driver,
                "vram_bytes": _int(mem_mib, scale=1024 * 1024),
                "pcie_gen": _int(gen),
                "pcie_width": _int(width),
                "pcie_gen_max": _int(gen_max),
                "pcie_width_max": _int(width_max),
            }
        )
    return gpus


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_facts(source_dir: Path = _SOURCE_DIR) -> dict[str, Any]:
    """Commit and dirty flag of the source tree benchsuite runs from; for a non-editable install
    (no checkout around the package) those of the working directory, said so in `source`."""
    for where, label in ((source_dir, "package"), (Path.cwd(), "working directory")):
        commit = _run(["git", "-C", str(where), "rev-parse", "HEAD"])
        if commit is not None:
            status = _run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"])
            dirty = None if status is None else bool(status.strip())
            tree = working_tree_hash(where) if dirty else commit_tree(where)
            return {"commit": commit.strip(), "dirty": dirty, "tree": tree, "source": label}
    return {"commit": None, "dirty": None, "tree": None, "source": None}


def commit_tree(where: Path) -> str | None:
    out = _run(["git", "-C", str(where), "rev-parse", "HEAD^{tree}"])
    return out.strip() if out else None


def working_tree_hash(where: Path) -> str | None:
    """Git tree hash of the tracked files as they are on disk (a throw-away index; HEAD and the
    real index untouched). A copy of a checkout whose .git lags its files (a remote machine's copy
    of a working tree, say) still names its code: the commit whose tree this is
    (`git log --format='%H %T' | grep TREE`)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        index = Path(tmp) / "index"
        real = _run(["git", "-C", str(where), "rev-parse", "--git-path", "index"])
        if real is None:
            return None
        real_path = Path(real.strip())
        real_path = real_path if real_path.is_absolute() else Path(where) / real_path
        if real_path.is_file():
            index.write_bytes(real_path.read_bytes())
        env = {**os.environ, "GIT_INDEX_FILE": str(index)}
        try:
            add = subprocess.run(["git", "-C", str(where), "add", "-u"], env=env, capture_output=True, timeout=60, check=False)
            tree = subprocess.run(["git", "-C", str(where), "write-tree"], env=env, capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return tree.stdout.strip() if add.returncode == 0 and tree.returncode == 0 else None


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _int(text: str, scale: int = 1) -> int | None:
    try:
        return int(float(text)) * scale
    except ValueError:
        return None
