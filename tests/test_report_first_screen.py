"""The report's first screen answers the question: a sentence per setup, a mode emphasized only when it
is significantly faster, TTFT said as N x faster/slower, the page-wide correction said in words, and
the speed-against-device-memory figure with its budget line and frontier."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from report_rows import frames, row

from benchsuite.report import stats, write_report
from benchsuite.report.first_screen import verdict_html, verdict_markdown
from benchsuite.report.groups import Spread
from benchsuite.report.headline import headline
from benchsuite.report.memory_figure import Point, frontier, speed_memory_figures
from benchsuite.report.verdict import Versus, verdicts

GB = 10**9


def _equal_modes() -> list[dict]:
    """Three repeats a side of two modes whose decode rates overlap: nothing wins."""
    return [
        *(row(f"p{i}", "s-p8", "paged", rep=i, decode=d, output=d, ttft=0.1) for i, d in enumerate((40, 44, 42))),
        *(row(f"o{i}", "s-off", "offload", rep=i, decode=d, output=d, ttft=0.1) for i, d in enumerate((41, 45, 39))),
    ]


def _clear_win() -> list[dict]:
    """Paged decodes twice as fast as llama.cpp, tight repeats; paged fits 16 GB with 12 GB, llama.cpp 15 GB."""
    return [
        *(row(f"p{i}", "s-p8", "paged", rep=i, decode=d, output=d, ttft=t, peak_bytes=12 * GB)
          for i, (d, t) in enumerate(((80.0, 0.05), (81.0, 0.051), (79.0, 0.049)))),
        *(row(f"l{i}", "s-ll2", "n-cpu-moe", "llamacpp", rep=i, decode=d, output=d, ttft=t, peak_bytes=15 * GB)
          for i, (d, t) in enumerate(((40.0, 0.1), (40.5, 0.101), (39.5, 0.099)))),
    ]  # fmt: skip


def test_nothing_wins_is_said_first_and_no_winner_is_bolded() -> None:
    cells, groups = frames(_equal_modes())
    found = verdicts(groups, cells)
    decode = next(v for v in found if v.metric == "decode_tok_s_p50")
    assert not decode.significant
    assert headline(found, None) == [
        "With one stream, no mode is significantly faster here (3 repeats): tiny K=8 has the highest median, "
        "within noise of tiny (offload)."
    ]
    page = verdict_html(found, {})
    assert '<p class="answer">With one stream, no mode is significantly faster here' in page
    assert page.index('class="answer"') < page.index('<table class="verdict"')  # the sentence comes first
    assert "<strong>" not in page and 'data-significant="false"' in page  # no "fastest" emphasized
    assert any("best median (not significantly) tiny K=8 (" in line for line in verdict_markdown(found, {}))


def test_a_significant_winner_is_named_with_its_ratio_interval_and_the_budget() -> None:
    cells, groups = frames(_clear_win())
    found = verdicts(groups, cells)
    decode = next(v for v in found if v.metric == "decode_tok_s_p50")
    assert decode.significant
    e = decode.versus[0].estimate
    assert headline(found, 16 * GB) == [
        f"With one stream, tiny K=8 decodes {stats.times_text(e.ratio)} x faster than llama N=2 "
        f"[{stats.times_text(e.low)}–{stats.times_text(e.high)}] at a 16 GB budget (3 repeats)."
    ]
    page = verdict_html(found, {}, {"r1": 16 * GB})
    assert "<strong>tiny K=8</strong>" in page and 'data-significant="true"' in page
    assert "at a 16 GB budget" in page


def test_an_answer_built_on_unverified_figures_says_so_in_the_sentence() -> None:
    cells, groups = frames(_clear_win())
    found = verdicts(groups, cells)
    clean = headline(found, None)
    note = "llama N=2 (1 of 3 cells): decode tok/s p50: ours 57.3, the engine's own timings 40.2 (+43%)"
    flagged = [replace(v, yardstick=(note,)) if v.metric == "decode_tok_s_p50" else v for v in found]
    (sentence,) = headline(flagged, None)
    assert sentence == clean[0] + (
        " Unverified: 1 figure behind it disagrees with the engine's own timings or went untimed (listed below)."
    )


def test_ttft_is_said_as_times_faster_or_slower() -> None:
    cells, groups = frames(_clear_win())
    ttft = next(v for v in verdicts(groups, cells) if v.ttft)
    e = ttft.versus[0].estimate
    assert e.ratio == pytest.approx(0.5, rel=0.01)
    text = ttft.versus[0].text(ttft.winner, ttft=True)
    assert text.startswith(
        f"tiny · paged · K=8 reaches the first token {1 / e.ratio:.2f} x faster than llama · n-cpu-moe · n_cpu_moe=2 "
        f"[{1 / e.high:.2f}–{1 / e.low:.2f}]"
    )
    slower = Versus("b", "f", 1.0, stats.RatioEstimate(2.0, 1.5, 2.5, 0.001, 3, 3, 0.05), 3, 3, True, (), ())
    assert slower.text("a", ttft=True) == "a reaches the first token 2.00 x slower than b [1.50–2.50], significant"


def test_an_interval_that_excludes_1_but_is_no_discovery_says_why() -> None:
    estimate = stats.RatioEstimate(0.56, 0.36, 0.86, 0.02, 3, 3, 0.05)
    assert estimate.significant  # the interval alone excludes 1
    vs = Versus("b", "f", 1.0, estimate, 3, 3, False, (), (), comparisons=30)
    text = vs.text("a", ttft=False)
    assert text == (
        "a is 0.56 x b [0.36–0.86], not significant after correcting for the page's 30 comparisons "
        "(the interval alone excludes 1)"
    )
    plain = Versus(
        "b", "f", 1.0, stats.RatioEstimate(0.9, 0.7, 1.2, 0.4, 3, 3, 0.05), 3, 3, False, (), (), comparisons=30
    )
    assert plain.text("a", ttft=False).endswith("[0.70–1.20], not significant")


def _point(name: str, memory_gb: float, speed: float) -> Point:
    return Point(name, "paged", "paged (builtin)", memory_gb, Spread(speed, speed, speed, 1, (speed,)), (name,))


def test_frontier_keeps_the_configurations_not_beaten_on_both_axes() -> None:
    points = [_point("a", 10, 20), _point("b", 12, 15), _point("c", 14, 30), _point("d", 20, 30), _point("e", 8, 5)]
    assert [p.name for p in frontier(points)] == ["e", "a", "c"]  # b: a is faster with less; d: c is as fast


def test_speed_memory_figure_one_point_per_configuration_with_budget_and_frontier() -> None:
    rows = [
        *_clear_win(),
        *(row(f"p2{i}", "s-p8", "paged", conc=4, rep=i, decode=d, output=4 * d, ttft=0.2, peak_bytes=13 * GB)
          for i, d in enumerate((30.0, 31.0))),
    ]  # fmt: skip
    cells, groups = frames(rows)
    cells = cells.assign(budget_bytes=16 * GB)
    figures = speed_memory_figures(groups, cells)
    assert len(figures) == 1
    fig = figures[0].figure
    points = [t for t in fig.data if t.mode == "markers+text"]
    left = [t for t in points if t.xaxis == "x"]
    assert sorted((t.text[0], t.x[0], t.y[0]) for t in left) == [("llama N=2", 15.0, 40.0), ("tiny K=8", 12.0, 80.0)]
    right = [t for t in points if t.xaxis == "x2"]
    assert [(t.text[0], t.x[0], t.y[0]) for t in right] == [("tiny K=8", 13.0, 122.0)]  # output at c=4
    line = next(t for t in fig.data if t.name.startswith("frontier") and t.xaxis == "x")
    assert list(line.x) == [12.0]  # llama.cpp is beaten on both axes
    budget = [s for s in fig.layout.shapes if s.x0 == s.x1 == 16.0]
    assert len(budget) == 2  # the budget on both panels
    assert all(t.marker.symbol == "circle" for t in points)  # both fit the 16 GB budget
    cells = cells.assign(budget_bytes=14 * GB)  # llama.cpp's 15 GB is now over it: drawn hollow
    left = [t for t in speed_memory_figures(groups, cells)[0].figure.data if t.mode == "markers+text"]
    assert {t.text[0]: t.marker.symbol for t in left if t.xaxis == "x"} == {
        "llama N=2": "circle-open",
        "tiny K=8": "circle",
    }
    assert "None" not in " ".join(f"{t.name} {' '.join(t.text or ())}" for t in fig.data)


def test_a_memory_that_is_no_peak_is_said_on_the_axis_and_in_the_caption() -> None:
    cells, groups = frames(_clear_win())
    llama = cells["engine_kind"] == "llamacpp"
    # older llama.cpp cells: no peak measured, only the memory in use after the cell
    cells.loc[llama, "gpu_memory_used_bytes"] = cells.loc[llama, "peak_device_memory_bytes"]
    cells.loc[llama, "peak_device_memory_bytes"] = None
    (figure,) = speed_memory_figures(groups, cells)
    assert figure.figure.layout.xaxis.title.text == "device memory (GB; not all peaks, see below)"
    assert "not comparable with a peak: llama N=2: gpu memory after the cell." in figure.caption
    (clean,) = speed_memory_figures(*reversed(frames(_clear_win())))
    assert clean.figure.layout.xaxis.title.text == "peak device memory (GB)" and "not comparable" not in clean.caption


def test_no_memory_figure_without_device_memory() -> None:
    cells, groups = frames(_equal_modes())
    assert speed_memory_figures(groups, cells) == []


def test_a_full_report_shows_the_answer_and_the_figure_before_the_machine(tmp_path: Path) -> None:
    fixture = Path(__file__).parent / "data" / "report_fixture"
    page = write_report([fixture], tmp_path, reference_dirs=[fixture / "reference"]).read_text()
    assert page.index('class="answer"') < page.index('id="engines-run"')
    # the fixture's cells carry no device memory: the page says so in one line, where the figure would be
    assert 'id="speed-memory-missing"' in page and page.index("speed-memory-missing") < page.index('id="engines-run"')
