"""benchsuite compare: matching configurations across two runs, the Mann-Whitney U test on raw
per-request samples, the threshold, and the markdown / HTML outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchsuite.cli import main as cli_main
from benchsuite.manifest import Manifest
from benchsuite.records import CellResult, RequestRecord
from benchsuite.report import compare_runs, write_comparison
from benchsuite.report.compare import comparison_markdown
from benchsuite.store import RunStore

# Per-request multipliers around a cell's rate: median 1, spread +-4%.
FACTORS = (0.96, 0.98, 0.99, 1.0, 1.0, 1.01, 1.02, 1.04)
OUTPUT_TOKENS = 17


def make_run(root: Path, run_id: str, configs: dict[str, tuple[float, float, int]]) -> Path:
    """configs: name -> (decode tok/s, ttft s, requests per cell); two repeats each."""
    run_dir = root / run_id
    manifest = Manifest(run_id=run_id, created_utc="2026-12-01T00:00:00+00:00", matrix_source="m.yaml", matrix_hash=run_id,
                        matrix={})  # fmt: skip
    store = RunStore.open(run_dir, manifest)
    for name, (rate, ttft, n_requests) in configs.items():
        for repeat in range(2):
            cell_id = f"{name}-r{repeat}"
            result = CellResult(cell_id=cell_id, run_id=run_id, engine="tiny", engine_kind="builtin", mode="paged", server_id="s",
                                params={"resident_experts": name}, workload="w", prompt_class="short", concurrency=1,
                                repeat=repeat, status="ok", decode_tok_s_p50=rate, output_tok_s=rate * 0.9, ttft_p50_s=ttft)
            records = []
            for index in range(n_requests):
                factor = FACTORS[(index + repeat) % len(FACTORS)]
                t_sent = 100.0 * index
                t_first = t_sent + ttft * factor
                step = 1.0 / (rate * factor)
                chunks = [t_first + i * step for i in range(OUTPUT_TOKENS)]
                records.append(RequestRecord(cell_id, index, False, False, f"p{index}", "short", OUTPUT_TOKENS, t_sent, t_first,
                                             chunks[-1], chunks, 10, OUTPUT_TOKENS, OUTPUT_TOKENS, ok=True))
            store.write_cell(result, records)
    store.rebuild_tables()
    return run_dir


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    a = make_run(tmp_path, "run-a", {"slower": (100.0, 0.10, 8), "same": (100.0, 0.10, 8), "tiny-shift": (100.0, 0.10, 8),
                                     "few": (100.0, 0.10, 1), "gone": (50.0, 0.2, 8)})
    b = make_run(tmp_path, "run-b", {"slower": (80.0, 0.05, 8), "same": (100.0, 0.10, 8), "tiny-shift": (102.0, 0.10, 8),
                                     "few": (150.0, 0.10, 1), "new": (60.0, 0.2, 8)})
    return a, b


def _row(comparison, config: str, metric: str) -> dict:
    rows = comparison.rows
    match = rows[(rows["configuration"] == f"tiny · paged · resident_experts={config}") & (rows["metric"] == metric)]
    assert len(match) == 1
    return match.iloc[0].to_dict()


def test_flags_only_significant_changes_over_the_threshold(runs: tuple[Path, Path]) -> None:
    comparison = compare_runs(*runs, threshold=0.05, alpha=0.05)
    slower = _row(comparison, "slower", "decode_tok_s")
    assert slower["change"] == pytest.approx(-0.2)
    assert slower["p_value"] < 0.001 and slower["n_a"] == slower["n_b"] == 16
    assert slower["flagged"] and slower["verdict"] == "REGRESSED"
    faster_ttft = _row(comparison, "slower", "ttft_p50_ms")
    assert faster_ttft["change"] == pytest.approx(-0.5) and faster_ttft["verdict"] == "IMPROVED"
    same = _row(comparison, "same", "decode_tok_s")
    assert same["change"] == 0.0 and not same["flagged"] and same["verdict"] == "not significant"
    shift = _row(comparison, "tiny-shift", "decode_tok_s")
    assert shift["change"] == pytest.approx(0.02) and not shift["flagged"]  # 2% < 5% threshold, whatever p says
    few = _row(comparison, "few", "decode_tok_s")
    assert few["change"] == pytest.approx(0.5) and not few["flagged"] and few["verdict"].startswith("too few samples")
    assert comparison.only_a == ["tiny · paged · resident_experts=gone · short · c=1"]
    assert comparison.only_b == ["tiny · paged · resident_experts=new · short · c=1"]
    assert set(comparison.flagged["configuration"]) == {"tiny · paged · resident_experts=slower"}


def test_threshold_and_alpha_are_honoured(runs: tuple[Path, Path]) -> None:
    strict = compare_runs(*runs, threshold=0.25, alpha=0.05)
    assert not _row(strict, "slower", "decode_tok_s")["flagged"]  # -20% is real but under a 25% threshold
    loose = compare_runs(*runs, threshold=0.01, alpha=0.05)
    assert _row(loose, "tiny-shift", "decode_tok_s")["flagged"] == (_row(loose, "tiny-shift", "decode_tok_s")["p_value"] < 0.05)


def test_outputs_and_cli(runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    comparison = compare_runs(*runs)
    md, page = write_comparison(comparison, tmp_path / "cmp")
    assert md.read_text() == comparison_markdown(comparison)
    assert "REGRESSED" in md.read_text() and "## Only in run-a" in md.read_text()
    html = page.read_text()
    assert "<table" in html and "REGRESSED" in html and "http" not in html
    assert cli_main(["compare", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Compare run-a (A) -> run-b (B)") and (tmp_path / "cli" / "compare.html").is_file()
    assert cli_main(["compare", str(runs[0]), str(tmp_path / "missing")]) == 2
