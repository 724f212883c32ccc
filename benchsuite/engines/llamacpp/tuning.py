"""How the adapter tunes llama-server beyond N: the flags of LlamaCppOptions' tuning fields.

The defaults are the configuration llama.cpp's own users run for MoE expert offload
(docs/llamacpp-tuning.md has the sources and the measurements):
- `-fa on`: flash attention; on the H200 (N=30, 2,048-token prompt) 10.1 s -> 9.2 s TTFT.
- `-b 2048 -ub 2048`: the physical micro-batch decides how often a prompt re-uploads every host
  expert tensor: with experts on the host, llama.cpp computes a micro-batch of >= 32 tokens on the
  GPU and copies each host expert tensor it needs there, once per micro-batch (op offload). With
  the default -ub 512 a 2,048-token prompt copies them four times; with 2048 once (H200: 9.2 s ->
  2.8 s). It costs compute buffer on the GPU, which fit.py projects with the same value.
- `--load-mode none` (`mmap: false`): in this build an expert tensor overridden to the CPU
  (`--n-cpu-moe`) is placed in the GPU backend's host buffer type, i.e. pinned memory (CUDA_Host),
  unless the model is mmap'ed, in which case the loader downgrades it to pageable mapped pages
  (src/llama-model-loader.cpp; it logs "tensor overrides to CPU are used with mmap enabled -
  consider using --load-mode none"). Pinned host experts upload at the link's full speed.
  Builds older than `--load-mode` spell it `--no-mmap`.
- `-t <physical cores>`: llama.cpp's own default counts every physical core of the host from
  /sys (common/common.cpp, cpu_get_num_physical_cores), ignoring the CPU affinity and the cgroup
  CPU quota a container runs under; a 16-core slice of a 2 x 96-core host would start ~96
  threads that spin-wait on 16 cores. We count the cores this process may run on (one thread
  per core: SMT siblings share the FPUs and the memory bus the expert matmuls are bound by).
The log verbosity stays at 4 (trace, not debug: debug is 5): every memory line the report reads
is logged at 4 in this build (llama's INFO maps to trace, common/log.cpp; the exit breakdown is
LOG_TRC), and nothing is logged per token at 4 (docs/llamacpp-tuning.md, measured).
"""

from __future__ import annotations

import math
import os
from collections.abc import Set
from pathlib import Path

DEFAULT_BATCH_TOKENS = 2048
DEFAULT_UBATCH_TOKENS = 2048
LOG_VERBOSITY = 4  # trace: the memory lines (logs.py); debug would be 5
_SYS_CPU = Path("/sys/devices/system/cpu")
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def physical_cores(
    cpus: set[int] | None = None, sys_cpu: Path = _SYS_CPU, cgroup_cpu_max: Path = _CGROUP_CPU_MAX
) -> int:
    """Cores this process may use: its affinity, one per (package, core), capped by the cgroup quota."""
    allowed = cpus if cpus is not None else os.sched_getaffinity(0)
    cores = set()
    for cpu in allowed:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add(
                (topo.joinpath("physical_package_id").read_text().strip(), topo.joinpath("core_id").read_text().strip())
            )
        except OSError:  # no topology (some containers): count the CPU as its own core
            cores.add(("cpu", str(cpu)))
    count = max(1, len(cores))
    quota = _cgroup_cpus(cgroup_cpu_max)
    return min(count, quota) if quota else count


def _cgroup_cpus(path: Path) -> int | None:
    """`<quota> <period>` of cgroup v2 cpu.max -> whole CPUs (rounded up); None when unlimited."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def load_args(mmap: bool, flags: Set[str]) -> list[str]:
    """The flags that make host experts mmap'ed pages (mmap) or a read copy, pinned on GPU builds."""
    if "--load-mode" in flags:
        return ["--load-mode", "mmap" if mmap else "none"]
    if not mmap and "--no-mmap" in flags:
        return ["--no-mmap"]
    if mmap and "--mmap" in flags:
        return ["--mmap"]
    return []
