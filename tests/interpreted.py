"""Runs a test module's check under Triton's interpreter (TRITON_INTERPRET=1) in a child process: the
variable is read when triton is first imported, so the process that runs the rest of the suite (with
the compiler) cannot switch to it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_interpreted(module: str, check: str, timeout_s: float = 600) -> str:
    """`module.check()` from tests/ in a child under the interpreter; its stdout (asserted to exit 0)."""
    code = f"import sys; sys.path.insert(0, sys.argv[1]); import {module} as t; t.{check}()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(TESTS)], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout
