"""The report page in a real headless Chromium (Debian's `chromium`, driven by playwright): it
loads from file:// with the network cut (every non-file request is aborted and recorded; none may
happen), logs no console error, every plotly chart holds its data points, and the tables show the
stored numbers. Leaves a full-page screenshot in test-artifacts/report.png."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from benchsuite.report import write_report

CHROMIUM = Path("/usr/bin/chromium")
FIXTURE = Path(__file__).parent / "data" / "report_fixture"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,  # ~45 s on 2 cores: chromium start plus a 5 MB page with 11 charts
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian chromium at /usr/bin/chromium (apt-get install -y chromium)"
    ),
]

CHARTS_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => ({
    id: d.id,
    traces: (d.data || []).map(t => ({name: t.name, type: t.type || 'scatter', x: Array.from(t.x || []),
                                      y: Array.from(t.y || []), customdata: Array.from(t.customdata || [])}))
}))"""
VERDICT_JS = """() => ({
    versus: Array.from(document.querySelectorAll('#verdict .vs'))
        .map(d => ({text: d.textContent, ...d.dataset})),
    winners: Array.from(document.querySelectorAll('#verdict td.winner'))
        .map(d => ({text: d.textContent, ...d.dataset})),
    top: document.getElementById('verdict').getBoundingClientRect().top + window.scrollY,
})"""
# Anything whose content is wider than its box (a cell cut off, a table that scrolls sideways), and the page width.
CLIPPED_JS = """() => {
    const clipped = Array.from(document.querySelectorAll('table, td, th, .scroll, section, ul.caveats'))
        .filter(e => e.scrollWidth > e.clientWidth + 1)
        .map(e => e.tagName + (e.id ? '#' + e.id : '') + ': ' + e.textContent.slice(0, 60));
    return {clipped, page: document.documentElement.scrollWidth, viewport: window.innerWidth};
}"""
TABLE_JS = """(id) => { // a wide table is split in parts (id, id-2, ...): rows are merged back by position
    const parts = Array.from(document.querySelectorAll('table'))
        .filter(t => t.id === id || (t.id.startsWith(id + '-') && /^[0-9]+$/.test(t.id.slice(id.length + 1))));
    if (!parts.length) return null;
    let merged = null;
    for (const t of parts) {
        const head = Array.from(t.querySelectorAll('thead th')).map(th => th.textContent);
        const rows = Array.from(t.querySelectorAll('tbody tr'))
            .map(tr => Array.from(tr.children).map(td => td.textContent));
        if (merged === null) merged = rows.map(r => Object.fromEntries(head.map((h, i) => [h, r[i]])));
        else rows.forEach((r, i) => head.forEach((h, j) => { merged[i][h] = r[j]; }));
    }
    return merged; }"""


@pytest.fixture(scope="module")
def page_data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from playwright.sync_api import sync_playwright

    out = tmp_path_factory.mktemp("report")
    index = write_report([FIXTURE], out, reference_dirs=[FIXTURE / "reference"])
    blocked: list[str] = []
    errors: list[str] = []
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900}, offline=True)

            def guard(route, request) -> None:
                if request.url.startswith("file://"):
                    route.continue_()
                else:
                    blocked.append(request.url)
                    route.abort()

            context.route("**/*", guard)
            page = context.new_page()
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(index.as_uri(), wait_until="load")
            page.wait_for_function(
                "() => { const d = document.querySelectorAll('.js-plotly-plot');"
                " return d.length > 0 && Array.from(d).every(x => x.data && x._fullLayout); }",
                timeout=60_000,
            )
            charts = page.evaluate(CHARTS_JS)
            tables = {
                name: page.evaluate(TABLE_JS, f"table-{name}")
                for name in ("raw-cells", "ratios", "failures", "reference-decode")
            }
            text = page.inner_text("body")
            verdict = page.evaluate(VERDICT_JS)
            clipping = page.evaluate(CLIPPED_JS)
            page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        finally:
            browser.close()
    return {
        "charts": charts,
        "tables": tables,
        "blocked": blocked,
        "errors": errors,
        "text": text,
        "verdict": verdict,
        "clipping": clipping,
    }


def test_page_is_offline_and_error_free(page_data: dict) -> None:
    assert page_data["blocked"] == []
    assert page_data["errors"] == []


def test_every_chart_has_its_data_points(page_data: dict) -> None:
    charts = {c["id"]: c for c in page_data["charts"]}
    expected = {
        "fig-decode_tok_s_p50-vs-concurrency",
        "fig-output_tok_s-vs-concurrency",
        "fig-decode-vs-k",
        "fig-ttft-short-long",
        "fig-requests-ttft_s",
        "fig-requests-decode_tok_s",
        "fig-miss-rate",
        "fig-bytes-paged-per-token",
        "fig-waves-per-step",
        "fig-union-mean",
        "fig-search",
    }
    assert set(charts) == expected
    for chart in charts.values():
        assert chart["traces"], chart["id"]
        for trace in chart["traces"]:
            assert len(trace["y"]) > 0 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in trace["y"]), (
                chart["id"],
                trace["name"],
            )
    by_name = {t["name"]: t for t in charts["fig-decode_tok_s_p50-vs-concurrency"]["traces"]}
    paged8 = by_name["tiny · paged · resident_experts=8 · short"]
    assert paged8["x"] == [1, 2] and paged8["y"] == [42.0, 32.0]  # medians of repeats 40/44 and 30/34
    assert paged8["customdata"] == ["p8-s1-r0 p8-s1-r1", "p8-s2-r0 p8-s2-r1"]
    # 4 measured requests per ok cell, warmups excluded: 23 ok cells in the fixture.
    requests = charts["fig-requests-ttft_s"]["traces"]
    assert sum(len(t["y"]) for t in requests) == 4 * 23
    search = {t["name"]: t for t in charts["fig-search"]["traces"]}
    assert search["llama · c=1 · chosen N"]["x"] == [2] and search["llama · c=1 · chosen N"]["y"] == [46.0]
    assert search["llama · c=1 · median over repeats"]["x"] == [2, 3]


def test_tables_match_stored_numbers(page_data: dict) -> None:
    stored = pd.read_parquet(FIXTURE / "cells.parquet").set_index("cell_id")
    raw = {row["cell_id"]: row for row in page_data["tables"]["raw-cells"]}
    assert set(raw) == set(stored.index)
    for cell_id, row in raw.items():
        value = stored.loc[cell_id, "decode_tok_s_p50"]
        assert row["decode_tok_s_p50"] == ("—" if pd.isna(value) else f"{value:.2f}"), cell_id
        assert row["status"] == stored.loc[cell_id, "status"]
    ratios = [
        r
        for r in page_data["tables"]["ratios"]
        if r["paged_config"] == "tiny · paged · resident_experts=8"
        and r["concurrency"] == "1"
        and r["setup"].endswith("short")
    ]
    assert len(ratios) == 1
    assert ratios[0]["paged"] == "42.00 [40.00–44.00]"
    assert (
        ratios[0]["vs offload"]
        == "is 2.00 x offload [1.50–2.67], significant · tiny · offload · offload_layers=4: 21.00 [20.00–22.00]"
    )
    assert ratios[0]["vs cpu_experts_best"].startswith("is 0.98 x cpu_experts_best [")
    assert ratios[0]["vs cpu_experts_best"].split(" · ")[0].endswith("], not significant")
    failures = {r["cell_id"]: r["reason"] for r in page_data["tables"]["failures"]}
    assert failures["off-s2-r1"] == "engine exited with code -11 (see logs/s-offload.log)"
    reference = page_data["tables"]["reference-decode"]
    assert [r["yours_vs_published_paged"] for r in reference] == ["1.05×", "0.85×", "—"]


def test_page_states_what_was_not_run_and_synthetic_routing(page_data: dict) -> None:
    text = page_data["text"]
    assert "sglang: NOT RUN" in text
    assert "sg (sglang): named by the matrix but has no results (not run)." in text
    assert "SYNTHETIC ROUTING" in text
    assert "1 prompt reached the engines as different prompt lengths" in text


def test_the_verdict_comes_first_and_its_numbers_are_the_stored_cells(page_data: dict) -> None:
    from benchsuite.report import stats

    verdict = page_data["verdict"]
    assert verdict["top"] < 400  # the first screen, above the machine and package tables
    stored = pd.read_parquet(FIXTURE / "cells.parquet").set_index("cell_id")
    checked = 0
    estimates = []
    for vs in verdict["versus"]:
        winner, other = vs["winnerCells"].split(), vs["otherCells"].split()
        assert set(stored.loc[winner + other, "status"]) == {"ok"}
        metric = vs["metric"]
        estimate = stats.ratio_estimate(list(stored.loc[winner, metric]), list(stored.loc[other, metric]))
        estimates.append(estimate)
        if estimate is None:
            assert "ratio" not in vs and "not enough repeats" in vs["text"]
    # "significant" on the page is a discovery after Benjamini-Hochberg over all its comparisons
    discoveries = stats.benjamini_hochberg([None if e is None else e.p_value for e in estimates])
    for vs, estimate, discovery in zip(verdict["versus"], estimates, discoveries):
        if estimate is None:
            continue
        metric = vs["metric"]
        assert (float(vs["ratio"]), float(vs["low"]), float(vs["high"])) == pytest.approx(
            (estimate.ratio, estimate.low, estimate.high)
        )
        if metric != "ttft_p50_s":
            said = f"{vs['winner']} is {estimate.ratio:.2f} x {vs['other']} [{estimate.low:.2f}–{estimate.high:.2f}]"
        elif estimate.ratio <= 1.0:  # TTFT said as N x faster, its interval inverted with it
            said = (
                f"{vs['winner']} reaches the first token {1 / estimate.ratio:.2f} x faster than {vs['other']} "
                f"[{1 / estimate.high:.2f}–{1 / estimate.low:.2f}]"
            )
        else:
            said = (
                f"{vs['winner']} reaches the first token {estimate.ratio:.2f} x slower than {vs['other']} "
                f"[{estimate.low:.2f}–{estimate.high:.2f}]"
            )
        if discovery:
            wording = "significant ("
        elif estimate.significant:  # the interval alone excludes 1: the correction is said in words
            wording = "not significant after correcting for the page's"
        else:
            wording = "not significant ("
        assert vs["text"].startswith(f"{said}, {wording}"), vs["text"]
        checked += 1
    assert checked >= 6
    for cell in verdict["winners"]:
        values = stored.loc[cell["cells"].split(), cell["metric"]]
        scale = 1000.0 if cell["metric"] == "ttft_p50_s" else 1.0
        assert float(cell["value"]) == pytest.approx(float(values.median()) * scale)
    text = page_data["text"]
    assert "Device CPU: paging and offload here copy experts within host RAM" in text
    assert text.index("Device CPU") < text.index("Machine")  # the caveat sits with the verdict, not at the bottom
    assert "decode tok/s per stream (tok/s)" in text and "output tok/s, all streams (prefill included) (tok/s)" in text


def test_nothing_is_clipped_at_1400_px(page_data: dict) -> None:
    clipping = page_data["clipping"]
    assert clipping["viewport"] == 1400 and clipping["page"] <= 1400
    assert clipping["clipped"] == []
