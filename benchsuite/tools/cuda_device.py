"""Whether this process's torch can use a CUDA device, in one line: the plan-time check of `device:
cuda` (and of engines that need a CUDA GPU), so a run on a box without one stops before any server
starts instead of a server dying with an empty log tail.

`torch.cuda.is_available()` asks the driver for a device count without creating a context, and the
device's name is NVML's, so the GPU stays untouched for the engines; the answer is cached for the
process. `BENCHSUITE_CUDA_CHECK`
set to `absent` or `present` replaces the answer (tests of both sides on any machine).
"""

from __future__ import annotations

import functools
import os

from benchsuite.tools import device_memory

OVERRIDE_ENV = "BENCHSUITE_CUDA_CHECK"


@functools.lru_cache(maxsize=1)
def cuda_unavailable() -> str | None:
    """Why torch here cannot use CUDA, in words; None when it can."""
    override = os.environ.get(OVERRIDE_ENV, "")
    if override == "present":
        return None
    if override == "absent":
        return f"no CUDA device ({OVERRIDE_ENV}=absent)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device (no GPU or no driver)"
    return None


def cuda_description() -> str:
    """The device found, for a checklist line (call only when cuda_unavailable() is None)."""
    if os.environ.get(OVERRIDE_ENV) == "present":
        return f"assumed present ({OVERRIDE_ENV}=present)"
    # by NVML, not torch.cuda.get_device_name: that initializes CUDA in this process, which the engines'
    # device memory must not share with an orchestrator's context
    names = device_memory.gpu_names()
    if not names:
        return "a CUDA device (its name unread: NVML did not answer)"
    return f"{names[0]} ({len(names)} on this machine)"
