"""The friction a new user met, each fixed: K outside [top_k, E] caught when the matrix loads, a
missing model caught before anything is written, every matrix problem in one pass, preflight's
--vram-gb honoured with explicit shapes, every swept value visible in the summary table, and a
complete `benchsuite --help`. Exit status 2 for each bad input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from benchsuite.cli import COMMANDS, DESCRIPTION
from benchsuite.cli import main as cli_main
from benchsuite.commands.run import summary_table
from benchsuite.config.matrix import MatrixError, load_matrix
from benchsuite.config.plan import build_plan
from benchsuite.records import CellResult

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


def write_matrix(tmp_path: Path, engines: dict, **top: object) -> Path:
    body = {
        "name": "f",
        "output_root": str(tmp_path / "results"),
        "engines": engines,
        "workloads": {"w": {"num_requests": 2, "concurrency": [1]}},
        **top,
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_k_outside_top_k_and_e_is_caught_when_the_matrix_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_matrix(
        tmp_path,
        {"paged": {"kind": "builtin", "options": {"model": "tiny", "mode": "paged", "resident_experts": [2, 8, 64]}}},
    )
    with pytest.raises(MatrixError) as err:
        load_matrix(path)
    lines = str(err.value).splitlines()
    assert lines == [
        f"{path}: engines.paged.options.resident_experts[0]: K=2 is fewer than top_k=4: "
        "one token's experts must all be resident (the tiny preset)",
        f"{path}: engines.paged.options.resident_experts[2]: K=64 is more than the model's 32 experts per layer "
        "(the tiny preset)",
    ]
    assert cli_main(["run", str(path), "--dry-run"]) == 2  # a dry run no longer lets it through to the launch
    assert "K=64 is more than" in capsys.readouterr().err


def test_k_is_checked_against_a_local_config_json(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48})
    )
    path = write_matrix(
        tmp_path,
        {
            "p": {"kind": "builtin", "options": {"model": str(model), "mode": "paged", "resident_experts": 129}},
            "c": {"kind": "builtin", "options": {"model": str(model), "mode": "cpu-experts", "n_cpu_moe": 49}},
        },
    )
    with pytest.raises(MatrixError) as err:
        load_matrix(path)
    assert (
        "engines.p.options.resident_experts: K=129 is more than the model's 128 experts per layer "
        f"({model / 'config.json'})" in str(err.value)
    )
    assert "engines.c.options.n_cpu_moe: 49 is more than the model's 48 layers" in str(err.value)
    path.write_text(path.read_text().replace("129", "92").replace("49", "30"))
    assert len(build_plan(load_matrix(path)).servers) == 2  # the published K=92 fits E=128


def test_a_missing_model_stops_the_run_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_matrix(
        tmp_path,
        {
            "paged": {
                "kind": "builtin",
                "options": {"model": str(tmp_path / "nope"), "mode": "paged", "resident_experts": 8},
            },
            "llama": {"kind": "llamacpp", "options": {"model": str(tmp_path / "nope.gguf")}},
        },
    )
    assert cli_main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"engines.paged.options.model: no such model: {tmp_path / 'nope'} (a checkpoint directory)" in err
    assert (
        f"engines.llama.options.model: no such model: {tmp_path / 'nope.gguf'} (a checkpoint directory or GGUF file)"
        in err
    )
    assert not (tmp_path / "results").exists()
    assert cli_main(["run", str(path), "--dry-run"]) == 0  # a plan may name a model that lives on another machine
    assert f"  missing: {path}: engines.paged.options.model: no such model:" in capsys.readouterr().out


def test_every_matrix_problem_is_reported_in_one_pass(tmp_path: Path) -> None:
    path = write_matrix(
        tmp_path,
        {
            "paged": {
                "kind": "builtin",
                "options": {"model": "tiny", "mode": "paged", "resident_experts": 0, "bogus": 1},
            },
            "bad": {"kind": "vllm"},
        },
        repeatz=2,
    )
    with pytest.raises(MatrixError) as err:
        load_matrix(path)
    text = str(err.value)
    assert "repeatz: unknown key" in text and "engines.bad.kind: must be one of" in text  # top level
    assert "engines.paged.options.resident_experts: must be >= 1 (got 0)" in text  # engine options, same pass
    assert "engines.paged.options.bogus: unknown key (allowed: " in text


def test_preflight_vram_is_honoured_with_explicit_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["preflight", "--layers", "48", "--experts", "128", "--top-k", "8", "--expert-mb", "2.43", "--json"]
    assert cli_main([*shape, "--vram-gb", "16", "--kv-bytes-per-token", "98304", "--non-expert-gb", "1.2"]) == 0
    small = json.loads(capsys.readouterr().out)["formats"][0]
    assert cli_main([*shape, "--vram-gb", "24", "--kv-bytes-per-token", "98304", "--non-expert-gb", "1.2"]) == 0
    large = json.loads(capsys.readouterr().out)["formats"][0]
    assert small["k_fit"] is not None and large["k_fit"] > small["k_fit"]  # the budget moves K
    assert cli_main([*shape, "--vram-gb", "16"]) == 2  # never silently ignored
    assert "--kv-bytes-per-token and --non-expert-gb" in capsys.readouterr().err


def test_the_summary_table_keeps_every_swept_value_whole_on_a_narrow_terminal() -> None:
    plan = build_plan(load_matrix(QUICKSTART))
    results = [
        CellResult(
            c.cell_id,
            plan.run_id,
            c.engine,
            "builtin",
            "m",
            c.server_id,
            dict(c.params),
            c.workload,
            c.prompt_class,
            c.concurrency,
            c.repeat,
            "ok",
            ttft_p50_s=0.0123,
            decode_tok_s_p50=456.7,
            decode_agg_tok_s=987.6,
            output_tok_s=1234.5,
            miss_rate=0.25,
        )
        for c in plan.cells
    ]
    out = io.StringIO()
    Console(file=out, width=80).print(summary_table(plan, results))
    rows = [line for line in out.getvalue().splitlines() if line.startswith("│ paged")]
    assert len(rows) == 6 and sum(" K=8 " in r for r in rows) == 3 and sum(" K=16 " in r for r in rows) == 3
    assert all("1234.5" in r and "0.250" in r for r in rows)  # the numbers are whole too
    # decode: one stream's median at c=1, all streams' aggregate at c>=2, as the report and its caption say
    by_conc = {r.split("│")[3].strip(): r for r in rows if " K=8 " in r}
    assert "456.7" in by_conc["1"] and "987.6" in by_conc["2"] and "987.6" in by_conc["4"], by_conc
    assert "all streams' decode-phase aggregate at c>=2" in " ".join(out.getvalue().split())


def test_cli_help_is_complete(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert DESCRIPTION in text and "Exit status: 0 ok, 1 some cells failed, 2 a bad matrix or flag" in text
    for name in COMMANDS:
        assert f" {name} " in text
        with pytest.raises(SystemExit) as sub:
            cli_main([name, "--help"])
        assert sub.value.code == 0 and "usage: benchsuite " + name in capsys.readouterr().out
