"""Charts and tables that survive real data: one-read streams out of the per-request decode figure, log
axes where values span decades, no filler labels, configurations named by what they are, colour by
meaning, sections with nothing to show collapsed to one line, seconds never written 0.00."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from report_rows import frames, row

from benchsuite.records import RequestRecord
from benchsuite.report import tables as tb
from benchsuite.report import write_report
from benchsuite.report.display import display_frame
from benchsuite.report.figures import decode_vs_k, request_distributions, throughput_vs_concurrency
from benchsuite.report.fmt import format_value
from benchsuite.report.html import render_table
from benchsuite.report.load import normalize_requests
from benchsuite.report.paging_figures import paging_figures
from benchsuite.report.plot import family_colour
from benchsuite.report.samples import request_samples

FIXTURE = Path(__file__).parent / "data" / "report_fixture"


def _timed(index: int, times: list[float], reads: list[int]) -> RequestRecord:
    """A warm request of cell p0 with 5 tokens counted at `times`, read in body reads `reads`."""
    return RequestRecord(
        "p0", index, False, False, f"p{index}", "short", 9, times[0] - 0.1, times[0], times[-1], times,
        ok=True, output_tokens=5, count_times_s=times, count_tokens=[1, 3, 5], count_reads=reads,
    )  # fmt: skip


def test_a_stream_read_whole_is_left_out_of_the_per_request_decode_figure_and_counted() -> None:
    records = [
        _timed(1, [10.0, 10.2, 10.4], [1, 2, 3]),  # 10 tok/s, timed
        _timed(2, [20.0, 20.2, 20.4], [1, 2, 3]),
        _timed(3, [30.0, 30.000003, 30.000006], [7, 7, 7]),  # one read: a parse time, ~670,000 "tok/s"
    ]
    samples = request_samples(normalize_requests(pd.DataFrame([r.to_row() for r in records])))
    assert list(samples["one_read"]) == [False, False, True]
    assert samples["decode_tok_s"].max() > 500_000
    cells, _ = frames([row("p0", "s-p8", "paged", decode=10.0, output=9.0, ttft=0.1)])
    figures = {f.anchor: f for f in request_distributions(cells, samples)}
    decode = figures["fig-requests-decode_tok_s"]
    assert max(y for t in decode.figure.data for y in t.y) < 11.0
    assert "Left out: 1 request that arrived (mostly) whole in one read" in decode.caption
    ttft = figures["fig-requests-ttft_s"]  # its TTFT is still a measurement
    assert sum(len(t.y) for t in ttft.figure.data) == 3


def test_log_axis_only_where_values_span_a_decade() -> None:
    wide = [
        row("pa", "s-p8", "paged", decode=2.0, output=2.0),
        row("pb", "s-p8", "paged", conc=4, decode=300.0, output=300.0),
    ]
    _, groups = frames(wide)
    decode = throughput_vs_concurrency(groups)[0].figure
    assert decode.layout.yaxis.type == "log"
    assert list(decode.layout.yaxis.ticktext) == ["2", "5", "10", "20", "50", "100", "200", "500"]  # written in full
    narrow = [row("pa", "s-p8", "paged", decode=20.0, output=20.0), row("pb", "s-p8", "paged", conc=4, decode=30.0)]
    _, groups = frames(narrow)
    assert throughput_vs_concurrency(groups)[0].figure.layout.yaxis.type in (None, "linear", "-")


def test_no_filler_labels_and_no_none_in_legends() -> None:
    rows = [
        row("p8", "s-p8", "paged", decode=40.0, miss=0.3),
        row("p16", "s-p16", "paged", decode=50.0, miss=0.2),
        row("off", "s-off", "offload", decode=20.0, miss=0.5),
    ]
    for r, union in zip(rows, (9.0, 12.0, 30.0)):
        r["union_mean"] = union  # a figure whose series is K: offload has none
    _, groups = frames(rows)
    (k_figure,) = decode_vs_k(groups, top_k=None)
    assert all(not t.text for t in k_figure.figure.data)  # no "top_k not recorded" on every point
    assert "top_k is not recorded" in k_figure.caption  # said once
    names = [t.name for f in paging_figures(groups, 32) for t in f.figure.data]
    assert names and not any("None" in n for n in names)
    assert "tiny (offload) · short" in names and "tiny K=8 · short" in names


def test_a_significant_paged_loss_is_red_and_a_win_green() -> None:
    rows = [
        *(row(f"p{i}", "s-p8", "paged", rep=i, decode=d) for i, d in enumerate((20.0, 20.5, 19.5))),
        *(row(f"o{i}", "s-off", "offload", rep=i, decode=d) for i, d in enumerate((10.0, 10.2, 9.8))),
        *(row(f"l{i}", "s-ll2", "n-cpu-moe", "llamacpp", rep=i, decode=d) for i, d in enumerate((40.0, 40.5, 39.5))),
    ]
    cells, groups = frames(rows)
    html = render_table(tb.ratio_table(groups, cells), "t")
    offload = html.split("is 2.00 x offload")[0].rsplit("<td", 1)[1]
    llama = html.split("is 0.50 x llamacpp_best")[0].rsplit("<td", 1)[1]
    assert 'class="wrap sig"' in offload and 'class="wrap loss"' in llama


def test_seconds_keep_significant_digits() -> None:
    assert format_value("ttft_p50_s", 0.0042) == "4.2 ms"
    assert format_value("itl_p50_s", 0.000123) == "0.123 ms"
    assert format_value("ttft_p50_s", 1.2345) == "1.23 s"
    assert format_value("floor_s", 0.0) == "0 s"
    assert format_value("decode_tok_s", 12.345) == "12.35"  # a rate, not seconds
    assert format_value("bytes_ratio", 0.004) == "0.004"  # small, never 0.00
    assert format_value("bytes_paged_per_token", 0.0) == "0"  # an exact zero


def test_sections_with_nothing_to_show_are_one_line_each(tmp_path: Path) -> None:
    index = write_report([FIXTURE], tmp_path, reference_dirs=[FIXTURE / "reference"])
    page, md = index.read_text(), (index.parent / "tables.md").read_text()
    assert "<em>no rows</em>" not in page and "_no rows_" not in md
    assert "## Prefill against its page-in floor" not in md
    assert "- Prefill against its page-in floor: no paged cell recorded its prefill page-in." in md
    not_shown = page.split('<h2 id="not-shown">')[1].split("</ul>")[0]
    assert "<li>Prefill against its page-in floor: no paged cell recorded its prefill page-in.</li>" in not_shown
    assert 'id="prefill"' not in page


def test_a_table_with_measurements_is_shown_though_every_row_shares_a_note() -> None:
    from benchsuite.report.build import _one_note

    note = "no ok resident cell with a decode rate for this setup"
    measured = pd.DataFrame({"K": [8, 16], "link_bound_tok_s": [11.75, 14.5], "note": [note, note]})
    assert _one_note(measured) is None  # the link bounds are measured: the table stays
    empty = pd.DataFrame({"K": [8, 16], "link_bound_tok_s": [None, None], "note": [note, note]}).astype(
        {"link_bound_tok_s": float}
    )
    assert _one_note(empty) == note  # nothing measured: one line under "Not shown"


def test_a_baseline_no_row_ran_is_said_once_not_in_every_row() -> None:
    rows = [
        *(row(f"p{i}", "s-p8", "paged", rep=i, decode=d) for i, d in enumerate((20.0, 20.5))),
        *(row(f"o{i}", "s-off", "offload", rep=i, decode=d) for i, d in enumerate((10.0, 10.2))),
    ]
    cells, groups = frames(rows)
    ratios = tb.ratio_table(groups, cells)
    assert set(ratios["llamacpp_best_config"]) == {"not run"}
    shown = display_frame(ratios)
    assert "vs offload" in shown and "vs llamacpp_best" not in shown and "vs cpu_experts_best" not in shown
    html = render_table(ratios, "t")
    assert "Not run in any row, so not shown: llamacpp_best, cpu_experts_best." in html


def test_servers_are_labelled_by_what_they_ran(tmp_path: Path) -> None:
    index = write_report([FIXTURE], tmp_path, reference_dirs=[FIXTURE / "reference"])
    page, md = index.read_text(), (index.parent / "tables.md").read_text()
    assert '<tr><td>tiny K=8 <span class="other">(s-paged8)</span></td>' in page
    assert "<td>llama N=2 <span" in page
    assert "- `tiny K=12` (builtin" in md


def test_lines_are_coloured_by_mode_not_by_position() -> None:
    rows = [
        row("c1", "s-ll2", "n-cpu-moe", "llamacpp", decode=30.0),
        row("o1", "s-off", "offload", decode=20.0),
        row("p16", "s-p16", "paged", decode=15.0),  # third trace: plotly's own colourway would make it green
        row("p8", "s-p8", "paged", decode=14.0),
    ]
    _, groups = frames(rows)
    decode = throughput_vs_concurrency(groups)[0].figure
    paged = [t for t in decode.data if " · paged · " in t.name]
    assert {t.line.color for t in paged} == {family_colour("paged")} and len({t.line.dash for t in paged}) == 2
    assert "#2ca02c" not in {t.line.color for t in decode.data}  # green is left to meaning
    (by_k,) = decode_vs_k(groups, top_k=4)  # traces by concurrency: a colourway without green or red
    assert not {"#2ca02c", "#d62728", "green", "red"} & set(by_k.figure.layout.colorway)
