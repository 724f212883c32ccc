"""Machine facts and provenance for the manifest: CPU, cores, RAM, GPU (name, driver, VRAM, PCIe
generation and width via nvidia-smi when present), OS, Python, package versions, and the git
commit and dirty flag of the benchsuite source; and the machine's noise around each cell (load
averages, CPU clock, CPU time other processes took: `noise_snapshot` / `cell_noise`). Every probe
that cannot answer gives None, never a made-up value, and no probe may fail a run.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
from pydantic import Field

from benchsuite.records import StoredFacts

PACKAGES = ("benchsuite", "torch", "aiohttp", "pydantic", "pandas", "pyarrow", "numpy", "sglang", "gguf")
_GPU_FIELDS = (
    "name",
    "driver_version",
    "memory.total",
    "pcie.link.gen.current",
    "pcie.link.width.current",
    "pcie.link.gen.max",
    "pcie.link.width.max",
    "uuid",
)
_PROBE_TIMEOUT_S = 10.0
GPU_PROBE_ANSWERED = "nvidia-smi answered"
GPU_PROBE_ABSENT = "no nvidia-smi"
_SOURCE_DIR = Path(__file__).resolve().parents[2]  # the checkout: benchsuite/tools/machine.py


class GpuFacts(StoredFacts):
    """One NVIDIA GPU as nvidia-smi describes it; None where it has no answer (e.g. [N/A])."""

    name: str | None = None
    driver: str | None = None
    vram_bytes: int | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    # the card itself (nvidia-smi's GPU-...): two boxes of one kind, same host name and driver, are still two cards
    # (2026-12-07: two such H100 boxes decoded one code ~9 us a paged MB apart); None in older records
    uuid: str | None = None


class MachineFacts(StoredFacts):
    """The manifest's `machine`: every field None where its probe has no answer."""

    hostname: str | None = None
    os: str | None = None
    wsl: bool | None = None
    python: str | None = None
    cpu_model: str | None = None
    cpu_cores_logical: int | None = None
    cpu_cores_physical: int | None = None
    ram_bytes: int | None = None
    gpus: list[GpuFacts] = Field(default_factory=list)
    # how `gpus` was known: GPU_PROBE_ANSWERED, GPU_PROBE_ABSENT (no nvidia-smi: no NVIDIA GPU), or why the probe
    # failed ("nvidia-smi failed: ..."), in which case `gpus` is empty but says nothing; None in older records
    gpu_probe: str | None = None
    packages: dict[str, str | None] = Field(default_factory=dict)  # distribution name -> version (None: absent)


class GitFacts(StoredFacts):
    """The manifest's `git` (and each invocation's): the source benchsuite ran from. Runs stored before
    `source` and `tree` were recorded have only `commit` and `dirty`."""

    commit: str | None = None
    dirty: bool | None = None
    tree: str | None = None  # the tree hash of the tracked files as they were (see working_tree_hash)
    source: str | None = None  # "package" or "working directory": where the checkout was found; FILES_SOURCE
    # without one (the code then named by its files' hashes only)
    # {package directory: its tree hash} of the code that measures (CODE_DIRS), without the results a run
    # writes into its own checkout: a resume compares it (benchsuite.results.store); absent in older runs
    code: dict[str, str] | None = None


def machine_facts() -> MachineFacts:
    """Everything about this machine a reader needs to compare numbers across boxes."""
    memory = psutil.virtual_memory()
    gpus, gpu_probe_text = gpu_probe()
    return MachineFacts(
        hostname=platform.node(),
        os=platform.platform(),
        wsl="microsoft" in platform.release().lower(),
        python=platform.python_version(),
        cpu_model=cpu_model(),
        cpu_cores_logical=os.cpu_count(),
        cpu_cores_physical=psutil.cpu_count(logical=False),
        ram_bytes=int(memory.total),
        gpus=gpus,
        gpu_probe=gpu_probe_text,
        packages=package_versions(),
    )


def machine_kind(facts: Mapping[str, Any]) -> str:
    """What decides a figure beyond the engine: CPU model and logical cores, each GPU's name and memory (of a
    `MachineFacts` as JSON). A resume on another kind is refused (results.store), a run spread over several kinds
    says so (report.nodes). Two boxes of one kind are expected to measure alike, not known to: h100-duel-c's and
    h100-duelconfirm's (one kind, one host name, one driver) decoded one code ~9 us a paged MB apart, so a resumed
    run lists its cards (GPU uuids) where they differ (report.manifest_facts)."""
    if _gpu_probe_failed(facts):
        return f"{_cpu_kind(facts)}, GPUs unknown ({facts.get('gpu_probe')})"
    gpus = [f"{g.get('name', '?')} {round((g.get('vram_bytes') or 0) / 2**30)} GiB" for g in facts.get("gpus") or []]
    if not gpus:
        return f"{_cpu_kind(facts)}, no GPU"
    counted = {g: gpus.count(g) for g in dict.fromkeys(gpus)}
    return f"{_cpu_kind(facts)}, " + ", ".join(f"{n} x {g}" if n > 1 else g for g, n in counted.items())


def other_kind(before: MachineFacts, now: MachineFacts) -> tuple[str, str] | None:
    """(before's kind, now's) where the two are machines of different kinds; None where alike, or where it cannot
    be told: an nvidia-smi that failed on either side (a timeout, a driver mismatch; or no GPUs in a record older
    than `gpu_probe`) leaves the GPUs unknown, so only the CPUs are compared then (a probe's failure is not another
    machine)."""
    a, b = before.model_dump(mode="json"), now.model_dump(mode="json")
    if _gpus_unknown(a) or _gpus_unknown(b):
        return (machine_kind(a), machine_kind(b)) if _cpu_kind(a) != _cpu_kind(b) else None
    return (machine_kind(a), machine_kind(b)) if machine_kind(a) != machine_kind(b) else None


def _cpu_kind(facts: Mapping[str, Any]) -> str:
    return f"{facts.get('cpu_model') or 'unknown CPU'} x{facts.get('cpu_cores_logical') or '?'}"


def _gpu_probe_failed(facts: Mapping[str, Any]) -> bool:
    probe = facts.get("gpu_probe")
    return probe is not None and probe not in (GPU_PROBE_ANSWERED, GPU_PROBE_ABSENT)


def _gpus_unknown(facts: Mapping[str, Any]) -> bool:
    """The probe failed, or a record older than `gpu_probe` has no GPUs (its nvidia-smi may have failed silently)."""
    return _gpu_probe_failed(facts) or (facts.get("gpu_probe") is None and not facts.get("gpus"))


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def gpu_facts() -> list[GpuFacts]:
    """One entry per NVIDIA GPU from nvidia-smi; [] when there is none (or no nvidia-smi, or it failed)."""
    return gpu_probe()[0]


def gpu_probe() -> tuple[list[GpuFacts], str]:
    """gpu_facts and how they were known (MachineFacts.gpu_probe): a failed nvidia-smi is told apart from none."""
    argv = ["nvidia-smi", f"--query-gpu={','.join(_GPU_FIELDS)}", "--format=csv,noheader,nounits"]
    if shutil.which(argv[0]) is None:
        return [], GPU_PROBE_ABSENT
    out = _run(argv)
    if out is None:
        return [], f"nvidia-smi failed (an error exit, or no answer within {_PROBE_TIMEOUT_S:g} s)"
    return _parse_gpus(out), GPU_PROBE_ANSWERED


def _parse_gpus(out: str) -> list[GpuFacts]:
    gpus = []
    for line in out.splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(_GPU_FIELDS):
            continue
        name, driver, mem_mib, gen, width, gen_max, width_max, uuid = values
        gpus.append(
            GpuFacts(
                name=name,
                driver=driver,
                vram_bytes=_int(mem_mib, scale=1024 * 1024),
                pcie_gen=_int(gen),
                pcie_width=_int(width),
                pcie_gen_max=_int(gen_max),
                pcie_width_max=_int(width_max),
                uuid=uuid if uuid.startswith("GPU-") else None,
            )
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


def git_facts(source_dir: Path = _SOURCE_DIR) -> GitFacts:
    """Commit and dirty flag of the source tree benchsuite runs from; for a non-editable install
    (no checkout around the package) those of the working directory, said so in `source`."""
    for where, label in ((source_dir, "package"), (Path.cwd(), "working directory")):
        commit = _run(["git", "-C", str(where), "rev-parse", "HEAD"])
        if commit is not None:
            status = _run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"])
            dirty = None if status is None else bool(status.strip())
            tree = working_tree_hash(where) if dirty else commit_tree(where)
            return GitFacts(commit=commit.strip(), dirty=dirty, tree=tree, source=label, code=code_trees(where, tree))
    # no checkout (an unpacked archive, an installed wheel): the code is still named, by its files' content
    code = installed_code_trees()
    return GitFacts(commit=None, dirty=None, tree=None, source=FILES_SOURCE if code else None, code=code)


CODE_DIRS = ("benchsuite", "paged_experts")  # what measures: the engine, the load generator, the records


def code_trees(where: Path, tree: str | None) -> dict[str, str] | None:
    """{directory: its tree hash inside `tree`} for CODE_DIRS (None without a tree or any of them)."""
    if tree is None:
        return None
    code = {}
    for name in CODE_DIRS:
        out = _run(["git", "-C", str(where), "rev-parse", f"{tree}:{name}"])
        if out is None:
            return None
        code[name] = out.strip()
    return code


FILES_SOURCE = "files (no git checkout)"
# what a checkout's tracked files never hold but a running copy does (bytecode, an install's metadata)
_NOT_SOURCE_DIRS = ("__pycache__",)
_NOT_SOURCE_SUFFIXES = (".pyc", ".pyo", ".egg-info", ".dist-info")


def package_dir(name: str) -> Path | None:
    """Where Python imports package `name` from (a linked directory resolved), or None where it finds none."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(places[0]).resolve() if places else None


def installed_code_trees(locate: Callable[[str], Path | None] = package_dir) -> dict[str, str] | None:
    """{directory: content_tree_hash} of CODE_DIRS where `locate` finds them (None when one is missing or cannot
    be read: a probe never fails a run): the same hashes a checkout's `git rev-parse COMMIT:benchsuite` gives,
    where the files are that commit's."""
    code = {}
    for name in CODE_DIRS:
        place = locate(name)
        try:
            digest = content_tree_hash(place) if place is not None else None
        except OSError:  # a file unreadable or gone mid-walk
            return None
        if digest is None:
            return None
        code[name] = digest
    return code


def content_tree_hash(directory: Path) -> str | None:
    """Git's tree hash of a directory's files as they are on disk, computed without git (None when it is not a
    directory): blobs of each file's bytes (a symlink's target), modes 100644 / 100755 / 120000 / 40000, entries
    sorted as git sorts them (a directory's name with a '/' after it), empty directories left out as git leaves
    them. Bytecode and install metadata (_NOT_SOURCE_DIRS, _NOT_SOURCE_SUFFIXES) are skipped, so an unpacked
    `git archive` of a commit hashes to that commit's tree of the directory whether or not it ran."""
    import hashlib

    if not directory.is_dir() or directory.is_symlink():
        return None

    def git_object(kind: bytes, body: bytes) -> bytes:
        return hashlib.sha1(kind + b" " + str(len(body)).encode() + b"\0" + body).digest()  # noqa: S324 (git's hash)

    entries: list[tuple[bytes, bytes, bytes]] = []  # (sort key, mode, digest) ... name kept in the key
    for path in directory.iterdir():
        name = path.name
        if name in _NOT_SOURCE_DIRS or name.endswith(_NOT_SOURCE_SUFFIXES):
            continue
        raw = os.fsencode(name)
        if path.is_symlink():
            entries.append((raw, b"120000", git_object(b"blob", os.fsencode(os.readlink(path)))))
        elif path.is_dir():
            sub = content_tree_hash(path)
            if sub is not None and _has_source_files(path):
                entries.append((raw + b"/", b"40000", bytes.fromhex(sub)))
        elif path.is_file():
            # git's rule: the owner's execute bit alone (not who may run it here, root or a noexec mount)
            mode = b"100755" if path.lstat().st_mode & stat.S_IXUSR else b"100644"
            entries.append((raw, mode, git_object(b"blob", path.read_bytes())))
    body = b"".join(mode + b" " + key.rstrip(b"/") + b"\0" + digest for key, mode, digest in sorted(entries))
    return git_object(b"tree", body).hex()


def _has_source_files(directory: Path) -> bool:
    """Whether content_tree_hash hashes any file under a directory (none: git keeps no tree for it)."""
    for path in directory.rglob("*"):
        parts = path.relative_to(directory).parts
        if any(p in _NOT_SOURCE_DIRS or p.endswith(_NOT_SOURCE_SUFFIXES) for p in parts):
            continue
        if path.is_file() or path.is_symlink():
            return True
    return False


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
            # -A: files the lagging index does not know yet count too (ignored ones never), so a copy
            # of a clean checkout gives exactly its commit's tree
            add = subprocess.run(
                ["git", "-C", str(where), "add", "-A"], env=env, capture_output=True, timeout=60, check=False
            )
            tree = subprocess.run(
                ["git", "-C", str(where), "write-tree"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
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


# ---- machine noise around a cell -------------------------------------------------------------

BUSY_OTHER_CORES_FRACTION = 0.25
"""A cell ran on a busy machine when processes other than ours (the runner and the engine's process
tree) kept more than this fraction of the logical cores busy, on average, over the cell."""


def noise_snapshot(own_pids: Sequence[int] = ()) -> dict[str, Any]:
    """Load averages, the mean CPU clock (MHz, where readable), the machine's busy CPU seconds and
    those of our own processes (this one, its children, and `own_pids` with their descendants)."""
    times = psutil.cpu_times()
    busy_s = float(sum(times)) - float(times.idle) - float(getattr(times, "iowait", 0.0))
    try:
        loads: tuple[float | None, float | None, float | None] = os.getloadavg()
    except OSError:
        loads = (None, None, None)
    load_1m, load_5m, load_15m = loads
    return {
        "t_s": time.monotonic(),
        "load_1m": load_1m,
        "load_5m": load_5m,
        "load_15m": load_15m,
        "cpu_mhz": cpu_mhz(),
        "cpu_busy_s": busy_s,
        "own_cpu_s": _own_cpu_s(own_pids),
        "cpus": os.cpu_count(),
    }


def cpu_mhz() -> float | None:
    """Mean current clock over the logical CPUs: cpufreq (psutil), else /proc/cpuinfo; None where unreadable."""
    try:
        freq = psutil.cpu_freq()
    except (OSError, NotImplementedError, AttributeError):
        freq = None
    if freq is not None and freq.current:
        return float(freq.current)
    try:
        values = [
            float(line.split(":", 1)[1])
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("cpu MHz")
        ]
    except (OSError, ValueError):
        return None
    return sum(values) / len(values) if values else None


def _own_cpu_s(own_pids: Sequence[int]) -> float:
    total = 0.0
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    for pid in own_pids:
        try:
            leader = psutil.Process(pid)
            procs += [leader, *leader.children(recursive=True)]
        except psutil.Error:
            continue
    seen: set[int] = set()
    for proc in procs:
        if proc.pid in seen:
            continue
        seen.add(proc.pid)
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def cell_noise(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The cell's noise record: both snapshots, the cores other processes kept busy on average
    (other_cores = (machine busy CPU s - our CPU s) / wall s), the cores our own processes kept busy (own_cores:
    the runner with its load generator and sampler, the server and their children, as the snapshots found them; a
    process that starts or ends between them moves it), and `busy` with its reason."""
    wall_s = after["t_s"] - before["t_s"]
    own_s = after["own_cpu_s"] - before["own_cpu_s"]
    other_s = (after["cpu_busy_s"] - before["cpu_busy_s"]) - own_s
    cpus = before.get("cpus") or 1
    other_cores = max(0.0, other_s / wall_s) if wall_s > 0 else None
    busy = other_cores is not None and other_cores > BUSY_OTHER_CORES_FRACTION * cpus
    reason = (
        (
            f"other processes kept {other_cores:.2f} of {cpus} cores busy during the cell "
            f"(load average {before.get('load_1m') or 0:.2f} before, {after.get('load_1m') or 0:.2f} after)"
        )
        if busy
        else None
    )
    strip = ("t_s", "cpu_busy_s", "own_cpu_s")
    return {
        "before": {k: v for k, v in before.items() if k not in strip},
        "after": {k: v for k, v in after.items() if k not in strip},
        "wall_s": wall_s,
        "other_cores": other_cores,
        "own_cores": max(0.0, own_s / wall_s) if wall_s > 0 else None,
        "busy": busy,
        "busy_reason": reason,
    }
