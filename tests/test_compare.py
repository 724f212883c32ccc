"""benchsuite compare: matching configurations across runs, the test over repeats (one run a side) or
over runs (several a side), never over requests, Benjamini-Hochberg over the rows, the A/A statement,
and the markdown / HTML outputs and CLI."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from benchsuite.cli import main as cli_main
from benchsuite.records import CellResult, RequestRecord
from benchsuite.report import compare_runs, write_comparison
from benchsuite.report.compare import LEVEL_REPEATS, LEVEL_RUNS, comparison_markdown
from benchsuite.results.manifest import Manifest
from benchsuite.results.store import RunStore

OUTPUT_TOKENS = 17


def make_run(
    root: Path,
    run_id: str,
    configs: dict[str, list[float]],
    *,
    commit: str = "c0ffee",
    request_spread: float = 0.04,
    busy: bool = False,
    texts: dict[str, list[str]] | None = None,
    routing: str = "model",
    code: dict[str, str] | None = None,
    mode: str = "paged",
) -> Path:
    """configs: name -> decode tok/s of each repeat (one cell per value); every request of a cell
    decodes at the cell's rate times a factor within +-request_spread; texts: name -> the text each of its
    eight prompts generated (none: no text, as an engine that streams none)."""
    run_dir = root / run_id
    manifest = Manifest(
        run_id=run_id,
        created_utc="2026-12-01T00:00:00+00:00",
        matrix_source="m.yaml",
        matrix_hash="m4tr1x",
        matrix={},
        git={"commit": commit, "dirty": False, "tree": f"tree-{commit}", "code": code},
    )
    store = RunStore.open(run_dir, manifest)
    for name, rates in configs.items():
        for repeat, rate in enumerate(rates):
            cell_id = f"{run_id}-{name}-r{repeat}"
            extras = {
                "machine": {
                    "busy": busy,
                    "other_cores": 1.5 if busy else 0.0,
                    "busy_reason": "others busy" if busy else None,
                }
            }
            result = CellResult(
                cell_id=cell_id,
                run_id=run_id,
                engine="tiny",
                engine_kind="builtin",
                mode=mode,
                server_id="s",
                params={"resident_experts": name},
                workload="w",
                prompt_class="short",
                concurrency=1,
                repeat=repeat,
                status="ok",
                routing=routing,
                decode_tok_s_p50=rate,
                output_tok_s=rate * 0.9,
                ttft_p50_s=10.0 / rate,
                extras=extras,
            )
            records = []
            for index in range(8):
                factor = 1.0 + request_spread * (index - 3.5) / 3.5
                t_sent = 100.0 * index
                t_first = t_sent + 10.0 / rate * factor
                chunks = [t_first + i / (rate * factor) for i in range(OUTPUT_TOKENS)]
                records.append(
                    RequestRecord(
                        cell_id,
                        index,
                        False,
                        False,
                        f"p{index}",
                        "short",
                        OUTPUT_TOKENS,
                        t_sent,
                        t_first,
                        chunks[-1],
                        chunks,
                        10,
                        OUTPUT_TOKENS,
                        OUTPUT_TOKENS,
                        ok=True,
                        output_text=(texts or {}).get(name, [""] * 8)[index],
                    )
                )
            store.write_cell(result, records)
    store.rebuild_tables()
    store.close()
    return run_dir


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    a = make_run(
        tmp_path,
        "run-a",
        {
            "slower": [100.0, 97.0, 103.0],
            "same": [100.0, 96.0, 104.0],
            "tiny-shift": [100.0, 99.5, 100.5],
            "few": [100.0],
            "gone": [50.0, 51.0],
        },
    )
    b = make_run(
        tmp_path,
        "run-b",
        {
            "slower": [80.0, 78.0, 82.0],
            "same": [101.0, 97.0, 99.0],
            "tiny-shift": [102.0, 101.5, 102.5],
            "few": [150.0, 149.0],
            "new": [60.0, 61.0],
        },
        commit="beef",
    )
    return a, b


def _row(comparison, config: str, metric: str) -> dict:
    rows = comparison.rows
    match = rows[(rows["configuration"] == f"tiny · paged · resident_experts={config}") & (rows["metric"] == metric)]
    assert len(match) == 1
    return match.iloc[0].to_dict()


def test_flags_only_changes_significant_over_repeats_and_over_the_threshold(runs: tuple[Path, Path]) -> None:
    comparison = compare_runs(*runs, threshold=0.05, alpha=0.05)
    assert comparison.level == LEVEL_REPEATS and comparison.same_source is None  # two commits
    slower = _row(comparison, "slower", "decode_tok_s")
    assert slower["change"] == pytest.approx(-0.2, abs=0.005)
    assert slower["n_a"] == slower["n_b"] == 3  # repeats, not the 24 requests behind them
    assert slower["p_value"] < 0.001 and slower["flagged"] and slower["verdict"] == "REGRESSED"
    assert _row(comparison, "slower", "ttft_p50_ms")["verdict"] == "REGRESSED"  # TTFT went up: lower is better
    same = _row(comparison, "same", "decode_tok_s")
    assert not same["flagged"] and same["verdict"] == "not significant"
    shift = _row(comparison, "tiny-shift", "decode_tok_s")  # 2%: real (tight repeats) but under the 5% threshold
    assert shift["p_value"] < 0.01 and not shift["flagged"] and shift["verdict"] == "significant, below threshold"
    few = _row(comparison, "few", "decode_tok_s")  # +50% but one repeat in A: no verdict at all
    assert (
        pd.isna(few["change"])
        and not few["flagged"]
        and few["verdict"] == "not enough repeats (1 and 2; 2 a side needed)"
    )
    assert comparison.only_a == ["tiny · paged · resident_experts=gone · short · c=1"]
    assert comparison.only_b == ["tiny · paged · resident_experts=new · short · c=1"]
    assert set(comparison.flagged["configuration"]) == {"tiny · paged · resident_experts=slower"}


def test_requests_are_not_the_unit(tmp_path: Path) -> None:
    # Repeats scatter by +-10%, requests inside a cell by +-1%: B's +10% is within the repeats' noise.
    # Mann-Whitney over the 24 requests a side called it IMPROVED (p = 0.005).
    a = make_run(tmp_path, "a", {"x": [100.0, 90.0, 110.0]}, request_spread=0.01)
    b = make_run(tmp_path, "b", {"x": [110.0, 99.0, 121.0]}, request_spread=0.01)
    row = _row(compare_runs(a, b), "x", "decode_tok_s")
    assert (row["n_a"], row["n_b"]) == (3, 3) and not row["flagged"] and row["verdict"] == "not significant"


def test_a_a_comparison_is_named_and_busy_cells_are_counted(tmp_path: Path) -> None:
    a = make_run(tmp_path, "a", {"x": [100.0, 98.0]})
    b = make_run(tmp_path, "b", {"x": [99.0, 101.0]}, busy=True)
    comparison = compare_runs(a, b)
    assert comparison.same_source is not None and "same commit (c0ffee)" in comparison.same_source
    assert "A/A comparison" in comparison_markdown(comparison)
    assert _row(comparison, "x", "decode_tok_s")["machine_busy"] == "2 cells"


def test_other_commits_with_the_same_measuring_code_are_an_a_a_comparison(tmp_path: Path) -> None:
    """A commit that changed no measuring code (a README, a results folder), or a run from an unpacked archive
    with no commit at all, measured with the same code: the comparison names it A/A by the code's trees."""
    code = {"benchsuite": "1" * 40, "paged_experts": "2" * 40}
    a = make_run(tmp_path, "a", {"x": [100.0, 98.0]}, code=code)
    b = make_run(tmp_path, "b", {"x": [99.0, 101.0]}, commit="beef", code=code)
    said = compare_runs(a, b).same_source
    assert said is not None and "same measuring code (benchsuite 1111111, paged_experts 2222222" in said
    assert "commits beef, c0ffee" in said and "A/A comparison" in said
    other = make_run(tmp_path, "c", {"x": [99.0, 101.0]}, commit="beef", code={**code, "paged_experts": "3" * 40})
    assert compare_runs(a, other).same_source is None  # the engine changed
    unrecorded = make_run(tmp_path, "d", {"x": [99.0, 101.0]}, commit="beef")
    assert compare_runs(a, unrecorded).same_source is None  # a side that did not say: not assumed the same


def test_several_runs_a_side_test_over_runs(tmp_path: Path) -> None:
    # Tight repeats inside each run, but the runs themselves scatter by +-15%: run-level noise.
    a = [make_run(tmp_path, f"a{i}", {"x": [r, r * 1.01]}) for i, r in enumerate((100.0, 118.0, 86.0))]
    b = [make_run(tmp_path, f"b{i}", {"x": [r, r * 1.01]}) for i, r in enumerate((112.0, 90.0, 104.0))]
    over_runs = compare_runs(a, b)
    row = _row(over_runs, "x", "decode_tok_s")
    assert over_runs.level == LEVEL_RUNS and (row["n_a"], row["n_b"]) == (3, 3) and not row["flagged"]
    over_repeats = compare_runs(a[1], b[1])  # one run a side: the repeats cannot see the run-level noise
    assert over_repeats.level == LEVEL_REPEATS and _row(over_repeats, "x", "decode_tok_s")["verdict"] == "REGRESSED"
    assert "give reruns of each side" in comparison_markdown(over_repeats)


def test_threshold_and_alpha_are_honoured(runs: tuple[Path, Path]) -> None:
    strict = compare_runs(*runs, threshold=0.25, alpha=0.05)
    assert not _row(strict, "slower", "decode_tok_s")["flagged"]  # -20% is real but under a 25% threshold
    loose = compare_runs(*runs, threshold=0.01, alpha=0.05)
    assert _row(loose, "tiny-shift", "decode_tok_s")["flagged"]


def test_outputs_and_cli(runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    comparison = compare_runs(*runs)
    md, page = write_comparison(comparison, tmp_path / "cmp")
    assert md.read_text() == comparison_markdown(comparison, "all")  # the file keeps every column
    assert "REGRESSED" in md.read_text() and "## Only in run-a" in md.read_text()
    html = page.read_text()
    assert "<table" in html and "REGRESSED" in html and "http" not in html
    assert cli_main(["compare", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("run-a (A) -> run-b (B): 4 configurations compared")
        and (tmp_path / "cli" / "compare.html").is_file()
    )
    assert (
        cli_main(
            ["compare", str(runs[0]), str(runs[0]), "--vs", str(runs[1]), str(runs[1]), "--out", str(tmp_path / "v")]
        )
        == 0
    )
    assert "(tested over runs)" in capsys.readouterr().out
    assert cli_main(["compare", str(runs[0]), str(tmp_path / "missing")]) == 2
    assert cli_main(["compare", str(runs[0])]) == 2


def test_printed_by_default_are_the_counts_and_the_flagged_rows_only(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["compare", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "d")]) == 0
    lines = capsys.readouterr().out.splitlines()
    # slower: 3 metrics flagged; same: 3 not significant; tiny-shift: decode and output within 5%, TTFT
    # too (2%); few: 3 with one repeat in A
    assert lines[0] == (
        "run-a (A) -> run-b (B): 4 configurations compared (12 comparisons: decode tok/s, TTFT p50 ms, "
        "output tok/s): 0 flagged faster, 3 flagged slower, 3 not significant, 3 significant but within 5%, "
        "3 not comparable (too few repeats or no ok value); 1 only in run-a, 1 only in run-b"
    )
    table = [line for line in lines if line.startswith("| ")]
    assert [h.strip() for h in table[0].strip("|").split("|")] == [
        "configuration",
        "metric",
        "A → B (change [interval])",
        "flagged",
    ]  # fmt: skip  (no text in these runs: no outputs column)
    rows = table[1:]
    assert len(rows) == 3 and all("resident_experts=slower · w · short · c=1" in row for row in rows)
    decode = next(row for row in rows if "| decode tok/s |" in row)
    assert "100 → 80 (-20.0% [" in decode and decode.rstrip().endswith("| slower |")
    assert not any("resident_experts=same" in line or "tiny-shift" in line for line in lines)  # unflagged: not shown
    assert lines[-1].startswith("wrote ") and "compare.md" in lines[-1]
    md = (tmp_path / "d" / "compare.md").read_text()
    assert "resident_experts=same" in md and "tiny-shift" in md  # the file keeps every row
    assert cli_main(["compare", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "a"), "--columns", "all"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| configuration"))
    assert len(header.strip("|").split("|")) == 21 and "p_value" in header and "a_peak_gb" in header


def test_nothing_flagged_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_run(tmp_path, "a", {"x": [100.0, 98.0, 102.0]})
    b = make_run(tmp_path, "b", {"x": [99.0, 101.0, 100.0]}, commit="beef")
    assert cli_main(["compare", str(a), str(b), "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("a (A) -> b (B): 1 configuration compared (3 comparisons") and "0 flagged" in lines[0]
    assert lines[1] == (
        "nothing flagged: no change is significant after Benjamini-Hochberg at 0.05 and over 5% (tested over repeats)"
    )
    assert len(lines) == 3 and lines[2].startswith("wrote ")


def test_the_comparison_says_where_the_two_sides_generated_other_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A paged decode figure measures the experts its tokens route to: where A and B generated other text under the
    model's routing the comparison names the configuration (benchsuite.report.outputs); the same text, no text at
    all, or synthetic routing (the same experts whatever the text) are not named."""
    texts = [f"text of prompt {i}" for i in range(8)]
    other = [*texts[:5], "flipped a", "flipped b", texts[7]]
    rates = {"flipped": [100.0, 99.0, 101.0], "kept": [100.0, 99.0, 101.0], "untold": [100.0, 99.0, 101.0]}
    a = make_run(tmp_path, "a", rates, texts={"flipped": texts, "kept": texts})
    b = make_run(tmp_path, "b", rates, commit="beef", texts={"flipped": other, "kept": texts})
    comparison = compare_runs(a, b)
    outputs = {_row(comparison, name, "decode_tok_s")["outputs"] for name in rates}
    assert _row(comparison, "flipped", "decode_tok_s")["outputs"] == "differ: 2 of 8 prompts"
    assert _row(comparison, "kept", "decode_tok_s")["outputs"] == "same"
    assert _row(comparison, "untold", "decode_tok_s")["outputs"] == "" and len(outputs) == 3  # unknown, not "same"
    assert cli_main(["compare", str(a), str(b), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    named = [line for line in out.splitlines() if line.startswith("- ")]
    assert named == ["- tiny · paged · resident_experts=flipped · w · short · c=1 (differ: 2 of 8 prompts)"], out
    assert "generated other text in A and B (1)" in out
    assert "| differ: 2 of 8 prompts |" in (tmp_path / "o" / "compare.md").read_text()
    # synthetic routing: other text, the same experts: said in the row, not named as other work
    a = make_run(tmp_path / "s", "a", {"flipped": [100.0, 99.0]}, texts={"flipped": texts}, routing="synthetic:q")
    b = make_run(tmp_path / "s", "b", {"flipped": [100.0, 99.0]}, commit="beef", texts={"flipped": other},
                 routing="synthetic:q")  # fmt: skip
    row = compare_runs(a, b).rows.iloc[0]
    assert row["outputs"] == "differ: 2 of 8 prompts (synthetic routing: the same experts)"
    assert cli_main(["compare", str(a), str(b), "--out", str(tmp_path / "so")]) == 0
    assert "generated other text" not in capsys.readouterr().out
    # every expert resident: other text is the same work a token, said in the row, not named
    a = make_run(tmp_path / "r", "a", {"flipped": [100.0, 99.0]}, texts={"flipped": texts}, mode="resident")
    b = make_run(tmp_path / "r", "b", {"flipped": [100.0, 99.0]}, commit="beef", texts={"flipped": other},
                 mode="resident")  # fmt: skip
    assert compare_runs(a, b).rows.iloc[0]["outputs"] == "differ: 2 of 8 prompts (not paged: the same work a token)"
    assert cli_main(["compare", str(a), str(b), "--out", str(tmp_path / "ro")]) == 0
    assert "generated other text" not in capsys.readouterr().out
