"""The environment an engine process gets: what engines need to run, plus what the matrix declares.

Engines read settings from their environment (llama-server's `LLAMA_ARG_*` set any flag, OpenMP and
torch read thread counts, SGLang reads `SGLANG_*`), so a variable left in the user's shell could
change a measurement without a trace. `engine_environment` passes through only PASSED variables
(locations, locale, which GPUs, caches) from the runner's environment, then the adapter's own
(`LaunchPlan.env`), then the matrix's `env:` (matrix level, then engine level); `recorded` is what
the manifest keeps of it, with the values of secret-looking names (token, key, secret, password)
replaced by `<set>`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

PASSED = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP",
    "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH",  # where the engine's code and libraries are
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "HIP_VISIBLE_DEVICES",
    "XDG_CACHE_HOME", "BENCHSUITE_CACHE_DIR", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRITON_CACHE_DIR",
    "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR",
})  # fmt: skip
PASSED_PREFIXES = ("LC_",)
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)


def engine_environment(parent: Mapping[str, str], adapter_env: Mapping[str, str],
                       declared: Mapping[str, str]) -> dict[str, str]:  # fmt: skip
    """The whole environment of an engine process (nothing else is inherited)."""
    passed = {k: v for k, v in parent.items() if k in PASSED or k.startswith(PASSED_PREFIXES)}
    return {**passed, **adapter_env, **declared}


def recorded(env: Mapping[str, str]) -> dict[str, str]:
    """The environment as the manifest records it: secrets named, never written."""
    return {k: ("<set>" if _SECRET.search(k) else v) for k, v in sorted(env.items())}
