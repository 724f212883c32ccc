"""Table builders of benchsuite.report on hand-made result frames, with exact expected numbers."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from report_rows import frames, row

from benchsuite.records import RequestRecord
from benchsuite.report import tables as tb
from benchsuite.report.display import display_frame
from benchsuite.report.flags import cell_flags, prompt_length_mismatches
from benchsuite.report.groups import Spread
from benchsuite.report.load import normalize_cells, normalize_requests
from benchsuite.report.published import reference_decode_table, reference_ttft_table
from benchsuite.report.samples import request_samples
from benchsuite.tools.reference import parse_reference

BASE = [
    row("p8a", "s-p8", "paged", decode=40.0, output=38.0, ttft=0.100, miss=0.30),
    row("p8b", "s-p8", "paged", rep=1, decode=44.0, output=42.0, ttft=0.120, miss=0.34),
    row("p8c", "s-p8", "paged", rep=2, status="failed", reason="engine crashed"),
    row("offa", "s-off", "offload", decode=20.0, output=19.0, ttft=0.200),
    row("offb", "s-off", "offload", rep=1, decode=22.0, output=21.0, ttft=0.220),
    # llama.cpp N=1 is the fastest but its projection does not fit: it must never be "llama.cpp best".
    row("ll1a", "s-ll1", "n-cpu-moe", "llamacpp", decode=90.0, output=88.0, extras={"search_n": 1, "fits": False}),
    row(
        "ll2a",
        "s-ll2",
        "n-cpu-moe",
        "llamacpp",
        decode=41.0,
        output=40.0,
        ttft=0.09,
        extras={"search_n": 2, "fits": True, "chosen": True},
    ),
    row(
        "ll2b",
        "s-ll2",
        "n-cpu-moe",
        "llamacpp",
        rep=1,
        decode=43.0,
        output=42.0,
        ttft=0.11,
        extras={"search_n": 2, "fits": True, "chosen": True},
    ),
    row("p8l", "s-p8", "paged", cls="2048", decode=39.0, output=35.0, ttft=0.300),
    row("p8c2a", "s-p8", "paged", conc=2, decode=30.0, output=60.0, ttft=0.150),
    row("p8c2b", "s-p8", "paged", conc=2, rep=1, decode=32.0, output=64.0, ttft=0.170),
    row("offc2", "s-off", "offload", conc=2, decode=18.0, output=35.0, ttft=0.250),
]


def test_spread_and_verdicts() -> None:
    assert Spread.of([44.0, None, 40.0, float("nan"), 41.0]) == Spread(40.0, 41.0, 44.0, 3)
    assert Spread.of([None]) is None
    a, b, c = Spread.of([40, 44]), Spread.of([20, 22]), Spread.of([43, 45])
    # the interval is over repeats: 2.0 x with one 10% spread a side -> Welch t on logs, df 2, t(0.975) 4.30
    assert tb.ratio_verdict(a, b) == "significant [1.50–2.67]"
    assert tb.ratio_verdict(a, c).startswith(tb.NOT_SIGNIFICANT + " [")
    assert tb.ratio_verdict(a, Spread.of([20])) == "not enough repeats (2 and 1; 2 a side needed)"
    # disjoint min..max spreads (the old rule) are not enough: two noisy repeats a side stay not significant
    assert tb.ratio_verdict(Spread.of([30, 44]), Spread.of([20, 29])).startswith(tb.NOT_SIGNIFICANT)


def test_repeats_fold_into_one_configuration_and_failures_are_never_zero() -> None:
    _cells, groups = frames(BASE)
    paged = groups[
        (groups["mode"] == "paged") & (groups["prompt_class"] == "short") & (groups["concurrency"] == 1)
    ].iloc[0]
    assert paged["label"] == "tiny · paged · K=8"  # K: the cell's typed field
    assert paged["decode_tok_s_p50"] == Spread(40.0, 42.0, 44.0, 2)
    assert (paged["repeats_ok"], paged["repeats_not_ok"]) == (2, 1)
    assert paged["cell_ids"] == ["p8a", "p8b", "p8c"] and paged["ok_cell_ids"] == ["p8a", "p8b"]
    assert set(groups[groups["engine_kind"] == "llamacpp"]["label"]) == {
        "llama · n-cpu-moe · n_cpu_moe=1",
        "llama · n-cpu-moe · n_cpu_moe=2",
    }


def test_summary_table_exact_numbers() -> None:
    _, groups = frames(BASE)
    summary = tb.summary_table(groups, top_k=4).set_index("cell_ids")
    p8 = summary.loc["p8a p8b p8c"]
    assert (p8["K"], p8["K_div_top_k"], p8["repeats_ok"], p8["repeats_not_ok"]) == (8, 2, 2, 1)
    assert (p8["decode_tok_s_min"], p8["decode_tok_s_median"], p8["decode_tok_s_max"]) == (40.0, 42.0, 44.0)
    assert p8["ttft_p50_ms_median"] == pytest.approx(110.0)
    assert pd.isna(summary.loc["offa offb"]["K_div_top_k"])  # no K, no batch cap: absent, not 0


def test_ratio_table_published_layout() -> None:
    cells, groups = frames(BASE)
    ratios = tb.ratio_table(groups, cells)
    one = ratios[(ratios["concurrency"] == 1) & ratios["setup"].str.endswith("short")].iloc[0]
    assert one["metric"] == "decode_tok_s_p50"
    assert (one["paged_median"], one["offload_median"], one["paged_vs_offload"]) == (42.0, 21.0, 2.0)
    assert one["paged_vs_offload_verdict"] == "significant [1.50–2.67]"
    assert one["llamacpp_best_config"] == "llama · n-cpu-moe · n_cpu_moe=2"  # N=1 does not fit: excluded
    assert one["paged_vs_llamacpp_best"] == pytest.approx(math.sqrt(40 * 44) / math.sqrt(41 * 43))  # geometric means
    assert one["paged_vs_llamacpp_best_verdict"].startswith(tb.NOT_SIGNIFICANT)
    assert one["cpu_experts_best_config"] == "not run" and one["paged_vs_cpu_experts_best_verdict"] == "not run"
    assert one["cell_ids"] == "p8a p8b p8c offa offb ll2a ll2b"
    two = ratios[ratios["concurrency"] == 2].iloc[0]
    assert two["metric"] == "output_tok_s"  # aggregate above concurrency 1, as published
    assert two["paged_vs_offload"] == pytest.approx(62.0 / 35.0)
    assert two["paged_vs_offload_verdict"].startswith(tb.SPREAD_UNKNOWN)
    assert two["llamacpp_best_config"] == "not run"


def test_synthetic_routing_is_labelled_and_not_mixed_with_model_routing() -> None:
    rows = [*BASE, row("syn", "s-p8", "paged", decode=70.0, output=69.0, routing="synthetic:zipf")]
    cells, groups = frames(rows)
    ratios = tb.ratio_table(groups, cells)
    synthetic = ratios[ratios["synthetic"]]
    assert list(synthetic["paged_config"]) == ["tiny · paged · K=8 · SYNTHETIC routing (zipf)"]
    assert synthetic.iloc[0]["offload_config"] == "not run"  # offload ran with model routing only
    summary = tb.summary_table(groups, top_k=None)
    assert list(summary[summary["routing"].str.startswith("SYNTHETIC")]["cell_ids"]) == ["syn"]


def test_ttft_paging_search_and_failure_tables() -> None:
    cells, groups = frames(BASE)
    ttft = tb.ttft_table(groups).set_index("configuration")
    p8 = ttft.loc["tiny · paged · K=8"]
    p8 = p8[p8["concurrency"] == 1].iloc[0]
    assert (p8["short_class"], p8["long_class"]) == ("short", "2048")
    assert (p8["ttft_short_ms_median"], p8["ttft_long_ms_median"]) == (pytest.approx(110.0), pytest.approx(300.0))
    paging = tb.paging_table(groups, num_experts=32)
    first = paging[paging["prompt_class"] == "short"].iloc[0]
    assert (first["K"], first["random_miss"], first["miss_rate"]) == (8, 0.75, pytest.approx(0.32))
    search = tb.search_table(cells)
    assert list(search["N"]) == [1, 2, 2] and list(search["fits"]) == [False, True, True]
    assert list(search["chosen"]) == [False, True, True]
    failures = tb.failures_table(cells)
    assert list(failures["cell_id"]) == ["p8c"] and list(failures["reason"]) == ["engine crashed"]


def test_k_from_the_typed_field_and_display_spread() -> None:
    _cells, groups = frames([row("p16", "s-p16", "paged", decode=50.0)])
    assert groups.iloc[0]["k"] == 16 and groups.iloc[0]["label"] == "tiny · paged · K=16"
    shown = display_frame(tb.summary_table(groups, top_k=8))
    assert shown.iloc[0]["decode_tok_s"] == "50.00" and shown.iloc[0]["ttft_p50_ms"] == "—"


def test_params_as_json_text_or_dict() -> None:
    text = pd.DataFrame([{**row("a", "s-p8", "paged"), "params": json.dumps({"resident_experts": 8}), "extras": ""}])
    as_dict = pd.DataFrame([row("a", "s-p8", "paged", params={"resident_experts": 8})])
    assert normalize_cells(text)["params"][0] == normalize_cells(as_dict)["params"][0] == {"resident_experts": 8}
    assert normalize_cells(text)["extras"][0] == {}


def test_request_samples_recompute_per_request_metrics() -> None:
    records = [
        RequestRecord("c", 0, True, True, "w", "short", 9, 0.0, 0.5, 1.0, [0.5, 1.0], ok=True, output_tokens=2),
        RequestRecord(
            "c",
            1,
            False,
            False,
            "p",
            "short",
            9,
            10.0,
            10.2,
            10.6,
            [10.2, 10.4, 10.6],
            ok=True,
            output_tokens=5,
            count_times_s=[10.2, 10.4, 10.6],
            count_tokens=[1, 3, 5],
            count_reads=[1, 2, 3],
        ),  # fmt: skip
        RequestRecord("c", 2, False, False, "q", "short", 9, 11.0, None, 11.1, ok=False, error="HTTP 500"),
        RequestRecord("c", 3, False, False, "r", "short", 9, 12.0, 12.1, 12.1, [12.1], ok=True, output_tokens=1),
    ]
    samples = request_samples(normalize_requests(pd.DataFrame([r.to_row() for r in records])))
    assert list(samples["request_index"]) == [1, 3]  # warmup and failed requests excluded
    first = samples.iloc[0]
    assert first["ttft_s"] == pytest.approx(0.2)
    assert first["decode_tok_s"] == pytest.approx((5 - 1) / 0.4)
    assert first["e2e_output_tok_s"] == pytest.approx(5 / 0.6)
    assert samples.iloc[1]["decode_tok_s"] is None or math.isnan(samples.iloc[1]["decode_tok_s"])  # 1 token: undefined
    records[1].count_tokens = []  # 5 tokens over 3 text chunks and no counts: untimed, no rate
    samples = request_samples(normalize_requests(pd.DataFrame([r.to_row() for r in records])))
    assert samples.iloc[0]["decode_tok_s"] is None or math.isnan(samples.iloc[0]["decode_tok_s"])


def test_reference_tables_line_up_published_and_measured() -> None:
    reference = parse_reference(
        "t",
        {
            "workload": {
                "prompts": "ShareGPT",
                "output_tokens": 256,
                "kv_capacity_tokens": "10240 (all engines)",
                "prefix_caching": "off (all engines)",
                "repeats": "each headline cell measured at least twice",
            },
            "machines": {"box": {"gpu": "G", "vram_gb": 8, "pcie": "4.0 x8", "ram_gb": 32, "os": "Linux"}},
            "single_stream_decode": [
                {"machine": "box", "quant": "q", "K": 8, "paged": 40.0, "llamacpp_best": 50.0, "cpu_offload_gb": 10.0}
            ],
            "four_requests_decode": [{"machine": "box", "quant": "q", "K": 8, "paged": 80.0, "llamacpp_best": 100.0}],
            "ttft_p50_ms": [{"machine": "box", "quant": "q", "paged": [100, 300], "llamacpp_best": [90, 400]}],
        },
    )
    cells, groups = frames(BASE)
    decode = reference_decode_table(reference, {}, groups, cells)
    single = decode.iloc[0]
    assert single["machine"] == "box (G, PCIe 4.0 x8)"
    assert (single["published_paged_vs_offload"], single["published_paged_vs_llamacpp"]) == (4.0, 0.8)
    assert (single["your_paged"], single["your_offload"], single["your_llamacpp_best"]) == (42.0, 21.0, 42.0)
    assert single["yours_vs_published_paged"] == pytest.approx(42.0 / 40.0)
    assert decode.iloc[1]["your_paged_config"] == "not measured"  # no concurrency-4 cell: never invented
    ttft = reference_ttft_table(reference, {}, groups, cells).set_index("engine")
    assert (ttft.loc["paged", "your_short_ms"], ttft.loc["paged", "your_long_ms"]) == (
        pytest.approx(110.0),
        pytest.approx(300.0),
    )
    assert ttft.loc["llamacpp_best", "your_short_ms"] == pytest.approx(100.0)


def test_flags_and_prompt_length_mismatches() -> None:
    rows = [
        row(
            "a",
            "s-p8",
            "paged",
            decode=1.0,
            extras={
                "flags": ["f1"],
                "batch_cap_flag": "c=4 exceeds cap 2",
                "engine_log": {"kv_capacity_flag": "kv 4352 != 4096", "other": 3},
            },
        ),
        row("b", "s-ll2", "n-cpu-moe", "llamacpp", decode=1.0),
    ]
    rows[1]["usage_mismatches"] = 2
    cells, groups = frames(rows)
    assert cell_flags(cells.iloc[0]) == ["f1", "c=4 exceeds cap 2", "kv 4352 != 4096"]
    assert cell_flags(cells.iloc[1]) == ["2 requests: usage token count disagrees with streamed chunks"]
    assert list(tb.summary_table(groups, None)["flags"]) == [
        "2 requests: usage token count disagrees with streamed chunks",
        "f1 | c=4 exceeds cap 2 | kv 4352 != 4096",
    ]

    def req(cell_id: str, prompt_id: str, tokens: int) -> dict:
        return RequestRecord(
            cell_id, 1, False, False, prompt_id, "short", 8, 0.0, 0.1, 0.2, prompt_tokens=tokens, ok=True
        ).to_row()

    requests = normalize_requests(
        pd.DataFrame([req("a", "p0", 16), req("b", "p0", 18), req("a", "p1", 20), req("b", "p1", 20)])
    )
    mismatches = prompt_length_mismatches(cells, requests)
    assert mismatches.to_dict("records") == [
        {"prompt_id": "p0", "prompt_class": "short", "prompt_tokens_by_engine": "llama: 18; tiny: 16"}
    ]


def test_verdicts_name_the_fastest_mode_and_every_ratio_with_its_interval() -> None:
    from benchsuite.report.verdict import verdict_table, verdicts

    cells, groups = frames(BASE)
    found = {(v.prompt_class, v.concurrency, v.metric): v for v in verdicts(groups, cells)}
    ttft = found[("short", 1, "ttft_p50_s")]
    assert ttft.metric_name == "TTFT p50 (ms), short prompts"
    assert ttft.winner == "llama · n-cpu-moe · n_cpu_moe=2" and ttft.winner_median == pytest.approx(100.0)
    versus = {vs.other: vs for vs in ttft.versus}
    assert set(versus) == {"tiny · paged · K=8", "tiny · offload · defaults"}  # N=1 does not fit: no contender
    paged = versus["tiny · paged · K=8"]
    assert paged.estimate.ratio == pytest.approx(math.sqrt(0.09 * 0.11) / math.sqrt(0.10 * 0.12))
    assert (
        paged.text(ttft.winner, ttft=True)
        == "llama · n-cpu-moe · n_cpu_moe=2 reaches the first token 1.10 x faster than tiny · paged · K=8 [0.61–1.98], "
        "not significant"
    )
    two = found[("short", 2, "output_tok_s")]
    assert (
        two.metric_name == "output tok/s, all streams (prefill included) (tok/s)" and two.winner == "tiny · paged · K=8"
    )
    assert (
        two.versus[0].text(two.winner, ttft=False)
        == "vs tiny · offload · defaults: not enough repeats (2 and 1; 2 a side needed)"
    )
    table = verdict_table(list(found.values()))
    assert set(table["verdict"]) <= {
        "significant",
        "not significant",
        "not enough repeats (2 and 1; 2 a side needed)",
        "not enough repeats (1 and 2; 2 a side needed)",
    }


def test_decode_verdict_at_c2_uses_the_decode_aggregate_and_unverified_cells_show_on_the_first_screen() -> None:
    from benchsuite.report.first_screen import verdict_html, verdict_markdown
    from benchsuite.report.verdict import verdicts

    flag = "decode tok/s disagrees with the engine's own timings: 2 of 5 requests differ by more than 5%"
    rows = [
        row("pa", "s-p8", "paged", conc=2, decode=30.0, output=60.0, ttft=0.15),
        row("pb", "s-p8", "paged", conc=2, rep=1, decode=32.0, output=64.0, ttft=0.17),
        row("la", "s-ll2", "n-cpu-moe", "llamacpp", conc=2, decode=40.0, output=50.0, ttft=0.3),
        row("lb", "s-ll2", "n-cpu-moe", "llamacpp", conc=2, rep=1, decode=41.0, output=52.0, ttft=0.3,
            extras={"engine_timings_flag": flag}),
    ]  # fmt: skip
    # decode aggregate: llama.cpp decodes faster (90 vs 70) though paged's output tok/s (prefill included) is higher
    for r, agg in zip(rows, (70.0, 72.0, 90.0, 92.0)):
        r["decode_agg_tok_s"] = agg
    cells, groups = frames(rows)
    found = verdicts(groups, cells)
    assert [v.metric for v in found] == ["decode_agg_tok_s", "output_tok_s", "ttft_p50_s"]
    decode, output = found[0], found[1]
    assert decode.metric_name.startswith("decode tok/s, all streams (tokens after each first")
    assert decode.winner == "llama · n-cpu-moe · n_cpu_moe=2" and output.winner == "tiny · paged · K=8"
    note = f"llama · n-cpu-moe · n_cpu_moe=2 (1 of 2 cells): {flag}"
    assert all(v.yardstick == (note,) for v in found)
    page = verdict_html(found, {})
    assert page.count('class="yardstick-flag"') == 1 and "Unverified figures" in page
    assert page.index("Unverified figures") < page.index("decode tok/s, all streams")  # above the verdicts it affects
    assert f"- UNVERIFIED, c=2: {note}" in verdict_markdown(found, {})
    clean = verdicts(*reversed(frames([{**r, "extras": {}} for r in rows])))  # no flag: no unverified row
    assert "yardstick-flag" not in verdict_html(clean, {})
