"""benchmarks/llamacpp_flags_h200.py: its `adapter` set is the adapter's command line; each step changes one thing."""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

from benchsuite.engines.base import Fairness, ServerSpec
from benchsuite.engines.llamacpp import tuning
from benchsuite.engines.llamacpp.adapter import LlamaCppAdapter, LlamaCppOptions

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "llamacpp_flags_h200.py"
HELP = "--n-cpu-moe N\n--kv-unified\n--load-mode MODE\n--log-verbosity N\n--no-cache-prompt\n--cache-ram N\n"


def _script():
    spec = importlib.util.spec_from_file_location("llamacpp_flags_h200", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pairs(argv: list[str]) -> dict[str, str | None]:
    """flag -> its value (None for a bare flag)."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("-") and not arg.lstrip("-").isdigit():
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = nxt if nxt is not None and not nxt.startswith("--") and not nxt.startswith("-") else None
    return out


def test_the_adapter_set_is_the_adapters_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "physical_cores", lambda: 6)
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\ncat <<'EOT'\n{HELP}EOT\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    options = LlamaCppOptions(model=str(model), binary=str(binary), n_cpu_moe=30)
    spec = ServerSpec("s", "llamacpp", options, Fairness(8192), 4, "s")
    adapter_argv = _pairs(LlamaCppAdapter().launch_plan(spec, 1).argv)
    script_set = _pairs(_script().flag_sets(6)["adapter"])
    assert {flag: adapter_argv.get(flag, "absent") for flag in script_set} == script_set
    tuned = {"-fa", "-b", "-ub", "-t", "--load-mode", "-lv", "-np", "--kv-unified", "--metrics"}
    assert tuned <= set(script_set)


def test_each_set_changes_one_thing_from_the_previous():
    sets = list(_script().flag_sets(6).values())
    for before, after in zip(sets[:-1], sets[1:]):
        b, a = _pairs(before), _pairs(after)
        changed = {f for f in b.keys() | a.keys() if b.get(f, "absent") != a.get(f, "absent")}
        assert 1 <= len(changed) <= 3, (before, after)  # -b/-ub go together; np1 drops -np's partners


def test_missing_files_are_a_one_line_error(tmp_path, capsys):
    rc = _script().main(
        ["--server", str(tmp_path / "nope"), "--model", str(tmp_path / "m.gguf"), "--out", str(tmp_path)]
    )
    assert rc == 2 and "does not exist" in capsys.readouterr().err
