"""write_report end to end on the hand-made fixture run: the three files, a self-contained page,
tables.md / tables.csv content, the default output directory, the CLI, and refusals."""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from benchsuite.cli import main as cli_main
from benchsuite.errors import UserError
from benchsuite.report import load_run, write_report

FIXTURE = Path(__file__).parent / "data" / "report_fixture"
REFERENCE_DIRS = [FIXTURE / "reference"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report([FIXTURE], tmp_path_factory.mktemp("rep"), reference_dirs=REFERENCE_DIRS)


def test_writes_three_files_and_the_page_is_self_contained(report: Path) -> None:
    assert report.name == "index.html"
    assert {p.name for p in report.parent.iterdir()} == {"index.html", "tables.md", "tables.csv"}
    page = report.read_text()
    assert (
        "<script src" not in page
        and "<link" not in page
        and "@import" not in page
        and "url(" not in page.split("<script")[0]
    )
    assert page.count('<script type="text/javascript">') >= 1 and "Plotly.newPlot" in page
    assert "cdn.plot.ly" not in re.sub(
        r"<script type=\"text/javascript\">.*?</script>", "", page, count=1, flags=re.DOTALL
    )
    for anchor in ("raw-cells", "ratios", "failures", "reference-decode", "engines-run", "definitions"):
        assert f'id="{anchor}"' in page
    assert 'id="cell-p8-s1-r0"' in page and 'href="#cell-p8-s1-r0"' in page


def test_markdown_and_csv_carry_the_tables(report: Path) -> None:
    md = (report.parent / "tables.md").read_text()
    assert "sglang: NOT RUN" in md and "SYNTHETIC ROUTING" in md
    assert (
        "| fixture-run · bundled · short | 1 | tiny · paged · resident_experts=8 | 8 | decode_tok_s_p50 | no "
        "| 42.00 [40.00–44.00] |" in md
    )
    assert "engine exited with code -11 (see logs/s-offload.log)" in md
    assert "e.g. p0 (short): llama: 18; tiny: 16." in md  # prompt-length mismatch between engines
    assert "| server KV pool is 4352 tokens, the matrix fixed 4096 | ll3-s1-r0 |" in md  # engine flag in its row
    csv = pd.read_csv(report.parent / "tables.csv")
    ratios = csv[csv["table"] == "Paged vs baselines (published layout)"]
    row = ratios[(ratios["paged_config"] == "tiny · paged · resident_experts=12") & (ratios["concurrency"] == 1)].iloc[
        0
    ]
    assert (row["paged_median"], row["offload_median"], row["llamacpp_best_median"]) == (51.0, 21.0, 46.0)
    assert row["paged_vs_llamacpp_best"] == pytest.approx(
        (50.0 * 52.0) ** 0.5 / (45.0 * 47.0) ** 0.5
    )  # geometric means
    raw = csv[csv["table"] == "Raw cells"]
    assert len(raw) == 26 and set(raw["status"]) == {"ok", "failed", "invalid"}


def test_reference_absent_is_said_not_invented(tmp_path: Path) -> None:
    index = write_report([FIXTURE], tmp_path, reference_dirs=[tmp_path / "nowhere"])
    page = index.read_text()
    assert "names reference &#x27;pr42557&#x27;, but no pr42557.yaml was found" in page
    assert "Published pr42557 vs yours" not in page


def test_default_out_dir_and_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli_main(["report", str(FIXTURE)]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == tmp_path / "reports" / "fixture-run" / "index.html" and printed.is_file()


def test_reads_cells_json_when_tables_are_missing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    for name in ("cells.parquet", "cells.csv", "requests.parquet"):
        (run / name).unlink()
    data = load_run(run)
    assert len(data.cells) == 26 and len(data.requests) == 26 * 5
    assert data.cells.set_index("cell_id").loc["ll2-s1-r0", "extras"] == {"chosen": True, "fits": True, "search_n": 2}


def test_refuses_other_schema_versions_and_missing_runs(tmp_path: Path) -> None:
    run = tmp_path / "old"
    shutil.copytree(FIXTURE, run)
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 0}))
    with pytest.raises(UserError, match="schema version 0.*rerun the matrix"):
        write_report([run], tmp_path / "out")
    assert cli_main(["report", str(tmp_path / "absent")]) == 2


def test_several_runs_in_one_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    second = tmp_path / "second"
    shutil.copytree(FIXTURE, second)
    manifest = json.loads((second / "manifest.json").read_text())
    (second / "manifest.json").write_text(json.dumps({**manifest, "run_id": "second-run"}))
    cells = pd.read_parquet(second / "cells.parquet").assign(run_id="second-run")
    cells.to_parquet(second / "cells.parquet", index=False)
    monkeypatch.chdir(tmp_path)
    index = write_report([FIXTURE, second], reference_dirs=REFERENCE_DIRS)
    assert index == tmp_path / "reports" / "fixture-run+second-run" / "index.html"
    csv = pd.read_csv(index.parent / "tables.csv")
    summary = csv[csv["table"] == "Configurations (repeats with spread)"]
    assert set(summary["run_id"]) == {"fixture-run", "second-run"}
    assert "second-run · tiny · paged · resident_experts=8" in set(summary["configuration"])
    ratios = csv[csv["table"] == "Paged vs baselines (published layout)"]
    assert len(ratios) == 2 * 6  # each run's paged rows against that run's own baselines


def test_model_shape_of_a_hub_model_comes_from_the_named_reference(tmp_path: Path) -> None:
    from benchsuite.report.build import build_report_data

    run = tmp_path / "hub"
    shutil.copytree(FIXTURE, run)
    shutil.rmtree(run / "model")  # no local config.json: the servers name a hub id
    manifest = json.loads((run / "manifest.json").read_text())
    for server in manifest["servers"].values():
        server["argv"] = ["Qwen/Qwen3-30B-A3B-GPTQ-Int4" if a == "model" else a for a in server["argv"]]
    (run / "manifest.json").write_text(json.dumps(manifest))
    shipped = build_report_data([run])  # benchsuite/data/reference/pr42557.yaml: Qwen3-30B-A3B, top_k 8 of 128
    assert (shipped.top_k, shipped.num_experts) == (8, 128)
    unknown = build_report_data([run], reference_dirs=[tmp_path / "none"])
    assert (unknown.top_k, unknown.num_experts) == (None, None)  # never guessed


def test_a_run_where_everything_failed_still_reports_why(tmp_path: Path) -> None:
    run = tmp_path / "failed"
    shutil.copytree(FIXTURE, run)
    cells = pd.read_parquet(run / "cells.parquet")
    for column in (
        "decode_tok_s_p50",
        "output_tok_s",
        "ttft_p50_s",
        "miss_rate",
        "bytes_paged_per_token",
        "waves_per_step",
        "union_mean",
    ):
        cells[column] = None
    cells.assign(status="failed", reason="server exited during start-up").to_parquet(run / "cells.parquet", index=False)
    (run / "requests.parquet").unlink()
    (run / "cells").rename(run / "cells-unused")  # requests come from requests.parquet or cells/: none here
    index = write_report([run], tmp_path / "out", reference_dirs=REFERENCE_DIRS)
    md = (index.parent / "tables.md").read_text()
    assert "builtin: attempted (tiny) but NO cell succeeded (22 failed or invalid)" in md
    assert md.count("server exited during start-up") >= 26
    assert "Not drawn, for lack of data: decode tok/s vs concurrency" in index.read_text()


def test_each_servers_canary_is_shown_and_a_leak_is_a_red_banner(tmp_path: Path) -> None:
    run = tmp_path / "canary"
    shutil.copytree(FIXTURE, run)
    manifest = json.loads((run / "manifest.json").read_text())
    leaky, passing, errored, *rest = manifest["servers"]
    manifest["servers"][leaky]["canary"] = {
        "marker": "CANARY-ab12",
        "requests_checked": 17,
        "passed": False,
        "leaks": ["round 0 concurrent: 'x' -> 'CANARY-ab12'"],
        "interference": [],
    }
    manifest["servers"][passing]["canary"] = {
        "marker": "CANARY-cd34",
        "requests_checked": 17,
        "passed": True,
        "leaks": [],
        "interference": [],
    }
    manifest["servers"][errored]["canary"] = {"error": "RunError: http://127.0.0.1:1/v1/models answered HTTP 500"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    index = write_report([run], tmp_path / "out", reference_dirs=REFERENCE_DIRS)
    page = index.read_text()
    banner = re.search(r'<div class="banner bad">(LEAK CANARY FAILED on server (\S+) [^<]*)</div>', page)
    assert banner is not None and banner.group(2) == leaky and "FAILED (leaks 1)" in banner.group(1)
    assert page.count("LEAK CANARY FAILED") == 1
    assert '<td class="bad">canary: FAILED (leaks 1)</td>' in page
    assert "<td>canary: passed (17 responses checked)</td>" in page
    assert "<td>canary: not run (RunError: http://127.0.0.1:1/v1/models answered HTTP 500)</td>" in page
    assert page.count("<td>canary: not run</td>") == len(rest)  # servers of a run without the canary
    md = (index.parent / "tables.md").read_text()
    assert "> **LEAK CANARY FAILED on server " + leaky in md and "canary: passed" in md
    # a canary failure marks no cell failed
    assert (
        pd.read_csv(index.parent / "tables.csv").shape
        == pd.read_csv(
            write_report([FIXTURE], tmp_path / "plain", reference_dirs=REFERENCE_DIRS).parent / "tables.csv"
        ).shape
    )


def test_bytes_per_expert_of_each_engine_side_by_side(tmp_path: Path) -> None:
    """Servers whose version records how they store an expert (builtin FP8 with its block scales,
    llama.cpp Q8_0) get a 'Bytes per expert' table; servers without the fact are left out of it."""
    run = tmp_path / "bytes"
    shutil.copytree(FIXTURE, run)
    manifest = json.loads((run / "manifest.json").read_text())
    first, second, *_ = manifest["servers"]
    manifest["servers"][first]["version"] = {
        "engine": "paged_experts",
        "expert_format": "float8_e4m3fn",
        "expert_bytes": 4719744,
    }
    manifest["servers"][second]["version"] = {"engine": "llama.cpp", "expert_format": "q8_0", "expert_bytes": 5013504}
    (run / "manifest.json").write_text(json.dumps(manifest))
    page = write_report([run], tmp_path / "out", reference_dirs=REFERENCE_DIRS).read_text()
    table = re.search(r'<table id="expert-bytes-[^"]*">(.*?)</table>', page)
    assert table is not None
    rows = re.findall(
        r'<tr><td>[^<]* <span class="other">\(([^)]*)\)</span></td><td>[^<]*</td><td>([^<]*)</td><td>([^<]*)</td></tr>',
        table.group(1),
    )  # each server named by what it ran, its id beside the name
    assert rows == [(first, "float8_e4m3fn", "4.72 MB"), (second, "q8_0", "5.01 MB")]


def test_a_run_timed_by_text_chunks_is_reported_with_that_caveat_and_never_resumed(tmp_path: Path) -> None:
    # The fixture is a schema-2 run: its TTFT and decode rates were timed by text chunks, which inflated
    # llama.cpp's decode by a median 40% where its tokens carried no text. It stays readable, says so on
    # the first screen, and is never resumed under today's definitions.
    from benchsuite.records import SCHEMA_VERSION, TEXT_CHUNK_VERSIONS
    from benchsuite.results.stored_files import read_manifest_file

    assert json.loads((FIXTURE / "manifest.json").read_text())["schema_version"] in TEXT_CHUNK_VERSIONS
    index = write_report([FIXTURE], tmp_path / "out")
    assert "Timed by text chunks" in index.read_text()
    with pytest.raises(UserError, match=f"writes only version {SCHEMA_VERSION}"):
        read_manifest_file(FIXTURE / "manifest.json", writable=True)
    fresh = tmp_path / "fresh"
    shutil.copytree(FIXTURE, fresh)
    manifest = json.loads((fresh / "manifest.json").read_text())
    (fresh / "manifest.json").write_text(json.dumps({**manifest, "schema_version": SCHEMA_VERSION}))
    assert "Timed by text chunks" not in write_report([fresh], tmp_path / "out-fresh").read_text()


def _run_with_plan(tmp_path: Path, name: str, missing: list[tuple[str, str, int, int]], extra_ids: list[str],
                   searches: list[dict[str, Any]] | None = None, invocations: int = 1) -> Path:  # fmt: skip
    """The fixture run with a `planned` record (older manifests have none): its own cells, the cells in `missing`
    ((server, prompt class, concurrency, repeat) of the fixture's paged servers, ids derived as the plan derives
    them) and `extra_ids`, none of those measured: a run stopped before them; the `searches` planned (the
    fixture's chosen llama server s-llama2 is the choice of a search with server_id s-llama-search); the
    fixture's one invocation repeated to `invocations`."""
    from benchsuite.config.plan import cell_id_of

    run = tmp_path / name
    shutil.copytree(FIXTURE, run)
    manifest = json.loads((run / "manifest.json").read_text())
    workload = manifest["matrix"]["workloads"]["bundled"]
    stored = list(pd.read_parquet(run / "cells.parquet")["cell_id"])
    chosen = {"engine": "llama", "kind": "llamacpp", "params": {"n_cpu_moe": 2}, "search_of": "s-llama-search"}
    manifest["planned"] = {
        "servers": {
            **{
                f"s-paged{k}": {"engine": "tiny", "kind": "builtin", "params": {"resident_experts": k}} for k in (8, 12)
            },
            **({"s-llama2": chosen} if searches else {}),
        },
        "cells": [*stored, *(cell_id_of(s, workload, *point) for s, *point in missing), *extra_ids],
        "searches": searches or [],
    }
    manifest["invocations"] = manifest["invocations"] * invocations
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_a_resumed_run_lists_each_invocation_with_its_machine(tmp_path: Path) -> None:
    """A run resumed on another box (results.manifest.Invocation.machine) says where each part ran, an invocation
    recorded before the field among them; a run resumed on its own machine lists none, though a GPU's current
    PCIe generation or a package differs (and a run without machine facts per invocation prints what it printed
    before: test_a_run_that_measured_all_it_planned_prints_what_it_printed_before)."""
    run = _run_with_plan(tmp_path, "resumed", [], [], invocations=3)
    manifest = json.loads((run / "manifest.json").read_text())
    h200 = {"hostname": "box-b", "cpu_model": "Xeon", "cpu_cores_logical": 16,
            "gpus": [{"name": "NVIDIA H200", "vram_bytes": 141 * 2**30}]}  # fmt: skip
    second = {**manifest["invocations"][1], "host": "box-b", "machine": h200,
              "git": {"commit": "8e12bba0178ae1513e5ec2064ba6eb248ddbc7b7", "dirty": True}}  # fmt: skip
    manifest["invocations"] = [{**manifest["invocations"][0], "git": None}, second, {"started_utc": "later"}]
    (run / "manifest.json").write_text(json.dumps(manifest))
    index = write_report([run], tmp_path / "out", reference_dirs=REFERENCE_DIRS)
    md = (index.parent / "tables.md").read_text()
    assert "- invocation 2: " in md and "on box-b: Xeon x16, NVIDIA H200 141 GiB; commit 8e12bba0178a (dirty)" in md
    assert "- invocation 1: " in md and "machine not recorded; no commit" in md and "- invocation 3: later on ?" in md
    page = index.read_text()
    listed = page.split('<ol id="invocations-fixture-run">')[1].split("</ol>")[0]
    assert listed.count("<li>") == 3 and "NVIDIA H200 141 GiB" in listed
    # resumed on the manifest's own machine: its GPU idled to a lower PCIe generation, a package moved; no list
    box = {**h200, "gpu_probe": "nvidia-smi answered", "packages": {"torch": "2.11.0"}}
    idle = {**box, "gpus": [{**h200["gpus"][0], "pcie_gen": 1}], "packages": {"torch": "2.11.1"}}
    manifest["machine"] = box
    manifest["invocations"] = [{**second, "machine": box}, {**second, "machine": idle}]
    (run / "manifest.json").write_text(json.dumps(manifest))
    same = write_report([run], tmp_path / "out-same", reference_dirs=REFERENCE_DIRS)
    assert "invocation 1:" not in (same.parent / "tables.md").read_text() and "invocations-" not in same.read_text()
    manifest["invocations"][1]["machine"] = {**box, "hostname": "box-c"}  # another box of the kind: listed
    (run / "manifest.json").write_text(json.dumps(manifest))
    other = write_report([run], tmp_path / "out-other", reference_dirs=REFERENCE_DIRS)
    listed = [line for line in (other.parent / "tables.md").read_text().splitlines() if "- invocation" in line]
    assert len(listed) == 2 and " on box-b: " in listed[0] and " on box-c: Xeon x16, NVIDIA H200 141 GiB" in listed[1]
    # the device machines of one kind share a host name and a driver: the card tells them apart
    cards = [{**box, "gpus": [{**h200["gpus"][0], "uuid": f"GPU-{n}"}]} for n in (1, 2)]
    manifest["machine"] = cards[0]
    manifest["invocations"] = [{**second, "machine": cards[0]}, {**second, "machine": cards[1]}]
    (run / "manifest.json").write_text(json.dumps(manifest))
    swapped = write_report([run], tmp_path / "out-cards", reference_dirs=REFERENCE_DIRS)
    listed = [line for line in (swapped.parent / "tables.md").read_text().splitlines() if "- invocation" in line]
    assert [line.split("GiB, ")[1].split(";")[0] for line in listed] == ["card GPU-1", "card GPU-2"]


def _engines_run(page: str) -> list[str]:
    """The page's "Engines run" list, as text."""
    items = re.findall(r"<li>([^<]*)</li>", page.split('<h2 id="engines-run">')[1].split("</ul>")[0])
    return [html.unescape(item) for item in items]


def test_planned_cells_a_stopped_run_never_measured_are_counted_and_listed(tmp_path: Path) -> None:
    missing = [("s-paged8", "2048", 2, 1), *(("s-paged12", "2048", c, r) for c in (1, 2) for r in (0, 1))]
    run = _run_with_plan(tmp_path, "stopped", missing, [])
    index = write_report([run], tmp_path / "out", reference_dirs=REFERENCE_DIRS)
    md = (index.parent / "tables.md").read_text().splitlines()
    builtin = (
        "builtin: run (tiny): 20 ok cells, 2 failed or invalid, "  # failed cells: planned, stored, not counted again
        "5 of 27 planned cells not measured (the run stopped before them)."
    )
    tiny = "tiny (builtin): 5 of its 27 planned cells not measured (the run stopped before them)."
    header = [
        builtin,
        "llamacpp: run (llama): 3 ok cells, 1 failed or invalid.",  # all its planned cells measured
        "sglang: NOT RUN. These results contain no sglang cell; nothing in this report describes sglang.",
        tiny,
        "sg (sglang): named by the matrix but has no results (not run).",
    ]
    start = md.index(f"- {builtin}")
    assert md[start : start + 5] == [f"- {line}" for line in header]
    listed = [
        "Planned cells not measured: 5 of the 31 cells run fixture-run planned (the run stopped before them)",
        "tiny K=8 · workload bundled · prompt class 2048 · concurrency 2 · repeat 1 (1 of 2)",
        "tiny K=12 · workload bundled · prompt class 2048 · concurrency 1, 2 · repeats 0, 1 (all 2)",
    ]
    assert md[md.index("## Not shown") :][-3:] == [f"- {listed[0]}:", f"  - {listed[1]}", f"  - {listed[2]}"]
    page = index.read_text()
    assert _engines_run(page) == header
    not_shown = page.split('<h2 id="not-shown">')[1].split("</body>")[0]
    assert f"<ul><li>{listed[0]}:<ul><li>{listed[1]}</li><li>{listed[2]}</li></ul></li></ul>" in not_shown


@pytest.mark.parametrize("searches", [False, True], ids=["cells", "a-resolved-search-resumed"])
def test_a_run_that_measured_all_it_planned_prints_what_it_printed_before(tmp_path: Path, searches: bool) -> None:
    planned: list[dict[str, Any]] = [
        {"engine": "llama", "option": "n_cpu_moe", "server_id": "s-llama-search", "params": {}},  # chose s-llama2
        {"engine": "tiny", "option": "resident_experts"},  # recorded before server_id: not judged
    ]
    run = _run_with_plan(tmp_path, "complete", [], [], planned if searches else None, invocations=1 + searches)
    complete = write_report([run], tmp_path / "a", reference_dirs=REFERENCE_DIRS)
    older = write_report([FIXTURE], tmp_path / "b", reference_dirs=REFERENCE_DIRS)  # no `planned` in its manifest
    md = (complete.parent / "tables.md").read_text()
    assert md == (older.parent / "tables.md").read_text()
    assert (complete.parent / "tables.csv").read_bytes() == (older.parent / "tables.csv").read_bytes()
    assert "planned cells not measured" not in md and "planned cells not measured" not in complete.read_text()
    assert "planned search" not in md and "Planned searches" not in complete.read_text()
    assert _engines_run(complete.read_text()) == _engines_run(older.read_text())


def test_planned_searches_that_chose_no_value_are_said_with_why(tmp_path: Path) -> None:
    from benchsuite.results.manifest import ServerRecord

    searches = [
        {"engine": "llama", "option": "n_cpu_moe", "server_id": "s-llama-search", "params": {}},  # chose s-llama2
        {"engine": "tiny", "option": "resident_experts", "server_id": "s-k-paged", "params": {"mode": "paged"}},
        {"engine": "tiny", "option": "resident_experts", "server_id": "s-k-cpu", "params": {"mode": "cpu-experts"}},
    ]
    run = _run_with_plan(tmp_path, "searches", [], [], searches, invocations=2)
    manifest = json.loads((run / "manifest.json").read_text())
    error = "engine tiny: no resident_experts value fits the 0.50 GB budget"
    manifest["servers"]["s-k-paged"] = ServerRecord(engine="tiny", kind="builtin", search_error=error).model_dump(
        mode="json"
    )
    (run / "manifest.json").write_text(json.dumps(manifest))  # s-k-cpu: no record, the search never ended
    index = write_report([run], tmp_path / "out", reference_dirs=REFERENCE_DIRS)
    md = (index.parent / "tables.md").read_text().splitlines()
    stopped = "every invocation that planned it stopped before it chose a value"  # two invocations
    header = [
        "run fixture-run: 1 planned search not finished (tiny mode=cpu-experts: resident_experts search): its cells "
        f"were never planned ({stopped}).",
        "run fixture-run: 1 planned search chose no value (tiny mode=paged: resident_experts search): its cells "
        "were never planned (why under 'Not shown').",
    ]
    start = md.index(f"- {header[0]}")
    assert md[start : start + 2] == [f"- {line}" for line in header]
    listed = [
        "Planned searches that chose no value: 2 of the 3 searches run fixture-run planned, so the cells of the "
        "value each would choose were never planned",
        f"tiny mode=paged: resident_experts search: {error}",
        f"tiny mode=cpu-experts: resident_experts search: not finished ({stopped})",
    ]
    assert md[-3:] == [f"- {listed[0]}:", f"  - {listed[1]}", f"  - {listed[2]}"]
    page = index.read_text()
    assert all(line in _engines_run(page) for line in header)
    assert f"<li>{html.escape(listed[0])}:<ul><li>{html.escape(listed[1])}</li>" in page


def test_planned_ids_the_recorded_matrix_does_not_name_are_still_counted(tmp_path: Path) -> None:
    run = _run_with_plan(tmp_path, "unnamed", [], ["0123456789ab"])
    index = write_report([run], tmp_path / "out", reference_dirs=REFERENCE_DIRS)
    md = (index.parent / "tables.md").read_text().splitlines()
    line = (
        "run fixture-run: 1 more planned cell not measured (the run stopped before them), which its recorded "
        "matrix does not name (ids under 'Not shown')."
    )
    assert f"- {line}" in md and line in _engines_run(index.read_text())
    assert md[-2:] == [
        "- Planned cells not measured: 1 of the 27 cells run fixture-run planned (the run stopped before them):",
        "  - by id only (the recorded matrix does not derive them): 0123456789ab",
    ]


def test_the_report_names_every_planned_cell_as_the_plan_made_it(tmp_path: Path) -> None:
    from benchsuite.config.matrix import load_matrix
    from benchsuite.config.plan import build_plan
    from benchsuite.report.planned import read_planned
    from benchsuite.results.manifest import Manifest, build_manifest

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    matrix = tmp_path / "m.yaml"
    matrix.write_text(
        f"name: named\nrepeats: 2\nengines:\n  e:\n    kind: builtin\n"
        f"    options: {{model: {model}, mode: paged, resident_experts: [8, 12]}}\n"
        "workloads:\n  a: {concurrency: [1, 4], num_requests: 2, prompt_classes: [short, '2048']}\n"
        "  b: {concurrency: [2], num_requests: 3}\n"
    )
    plan = build_plan(load_matrix(matrix))
    stored = Manifest.model_validate(json.loads(json.dumps(build_manifest(plan).to_json())))  # as read from disk
    planned = read_planned(stored)
    assert len(plan.cells) == 2 * (2 * 2 + 1) * 2 and planned.unnamed == () and planned.repeats == 2
    assert [
        (c.cell_id, c.server_id, c.engine, c.workload, c.prompt_class, c.concurrency, c.repeat) for c in plan.cells
    ] == [
        (c.cell_id, c.server_id, c.engine, c.workload, c.prompt_class, c.concurrency, c.repeat) for c in planned.named
    ]
    assert [dict(c.params) for c in plan.cells] == [dict(c.params) for c in planned.named]


def test_a_planned_search_is_judged_by_what_its_server_stored() -> None:
    from benchsuite.report.planned import UnresolvedSearch, read_planned
    from benchsuite.results.manifest import Manifest, Planned, PlannedSearch, ServerRecord
    from benchsuite.results.server_facts import SearchRecord

    def search(server_id: str | None) -> PlannedSearch:
        return PlannedSearch(engine="e", option="n_cpu_moe", server_id=server_id, params={})

    ids = ["chose", "none", "pointer", "nothing", None]
    servers = {
        "chose": ServerRecord(search=SearchRecord(option="n_cpu_moe", launches=3, best_n=4)),  # whole record
        "none": ServerRecord(search=SearchRecord(option="n_cpu_moe", launches=2)),  # ended, no best value
        "pointer": ServerRecord(search=SearchRecord(option="n_cpu_moe", request="search")),  # not a whole record
    }
    manifest = Manifest(run_id="r", created_utc="t", matrix_source="m.yaml", matrix_hash="h", matrix={},
                        planned=Planned(searches=[search(i) for i in ids]), servers=servers)  # fmt: skip
    planned = read_planned(manifest)
    assert planned.recorded and planned.searches == 5
    assert planned.unresolved == (
        UnresolvedSearch("e", "n_cpu_moe", {}, "no n_cpu_moe value chosen"),
        UnresolvedSearch("e", "n_cpu_moe", {}, None),
        UnresolvedSearch("e", "n_cpu_moe", {}, None),
    )


def test_cells_measured_after_the_tables_were_written_are_read(tmp_path: Path) -> None:
    """cells.parquet is rebuilt when an invocation ends; one killed later (its machine taken back) leaves it
    without the cells it measured since. The report then reads cells/, so none is left out."""
    import shutil

    from benchsuite.report.load import load_run

    run = Path(shutil.copytree(FIXTURE, tmp_path / "run"))
    stored = sorted((run / "cells").glob("*.json"))
    assert len(load_run(run).cells) == len(stored)  # the tables are current: read from them
    newest = stored[-1]
    doc = json.loads(newest.read_text())
    doc["cell"]["cell_id"] = "f" * 12  # a cell the tables do not hold
    for request in doc["requests"]:
        request["cell_id"] = "f" * 12
    (run / "cells" / f"{'f' * 12}.json").write_text(json.dumps(doc))
    cells = load_run(run).cells
    assert len(cells) == len(stored) + 1 and "f" * 12 in set(cells["cell_id"])
