"""A random-weight model's own routing is measured, not assumed, and never compared with itself:
- the caveat says whether the model's greedy output looped and how its paged miss rate compares with
  calibrated routing (report/locality.py), instead of asserting "near-uniform" routing;
- a paged mode measured under both routings is compared with the other modes under each routing
  (verdict.routing_worlds), never with itself, the synthetic world first for a random-weight model;
- a search's one-cell probe of a value never stands for a mode beside that value's full repeats."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from report_rows import frames, row

from benchsuite.report.headline import headline
from benchsuite.report.locality import looped, miss_rates, output_loops, random_model_caveat, repeated_share
from benchsuite.report.verdict import MODEL_ROUTING, routing_worlds, verdicts

CORPUS = Path(__file__).resolve().parents[1] / "paged_experts" / "data" / "corpus.txt"
SYNTH = "synthetic:qwen3-30b-a3b"
# texts the H200 headline run's random model produced (2026-12-02), greedy, on its own routing
LOOPS = (
    "qu oldimes" + "imes" * 60,
    " slowly" * 40,
    "1ather carefullyampust bsond ma for slowly cou afternoonampust bsond ma for slowly cou afternoon"
    + "ampust bsond ma for slowlyall slowlyall"
    + " slowlyall" * 12,
)


def test_looping_output_is_told_from_prose() -> None:
    prose = CORPUS.read_text()[:600]
    assert repeated_share(prose) < 0.1 and looped(prose) is False
    assert all(looped(t) for t in LOOPS), [round(repeated_share(t), 2) for t in LOOPS]
    assert looped("too short") is None and repeated_share("") == 0.0


def _mixed_routing() -> list[dict]:
    """Paged K=8 on the model's routing (fast: low misses) and on synthetic routing, llama.cpp N=2."""
    return [
        *(row(f"pm{i}", "s-p8", "paged", rep=i, decode=d, output=d, ttft=0.1, miss=0.08)
          for i, d in enumerate((150.0, 151.0, 149.0))),
        *(row(f"ps{i}", "s-p8", "paged", rep=i, decode=d, output=d, ttft=0.1, miss=0.17, routing=SYNTH)
          for i, d in enumerate((94.0, 94.5, 93.5))),
        *(row(f"l{i}", "s-ll2", "n-cpu-moe", "llamacpp", rep=i, decode=d, output=d, ttft=0.2)
          for i, d in enumerate((42.0, 42.5, 41.5))),
    ]  # fmt: skip


def test_a_paged_mode_is_compared_per_routing_never_with_itself() -> None:
    cells, groups = frames(_mixed_routing())
    worlds = routing_worlds(groups)
    assert [w for w, _ in worlds] == [MODEL_ROUTING, SYNTH]
    for world, rows in worlds:  # llama.cpp (no synthetic variant) takes part in both
        assert sorted(rows["engine_kind"]) == ["builtin", "llamacpp"], world
    assert [w for w, _ in routing_worlds(groups, synthetic_first=True)] == [SYNTH, MODEL_ROUTING]

    found = verdicts(groups, cells, synthetic_first={("r1", "w", "short")})
    decode = [v for v in found if v.metric == "decode_tok_s_p50"]
    assert [v.routing for v in decode] == [SYNTH, MODEL_ROUTING]
    for v in decode:
        assert [vs.other_family for vs in v.versus] == ["n-cpu-moe (llamacpp)"]  # never paged vs paged
    assert decode[0].metric_name.endswith("on synthetic routing (qwen3-30b-a3b)")
    from benchsuite.report.caveats import setup_caveats

    said_beside = [c for c in setup_caveats(cells, {}, has_gpu=True) if c.startswith("Synthetic routing")]
    assert said_beside == [
        "Synthetic routing (synthetic:qwen3-30b-a3b): experts were chosen by a generator, not the model's router. "
        "In every routing's comparison llama was measured on the model's own routing: its speed does not depend "
        "on which experts are chosen."
    ]
    said = headline(found, None)
    assert said[0].startswith(
        "With one stream on synthetic routing (qwen3-30b-a3b), tiny K=8 (synthetic routing) decodes"
    )
    assert said[-1] == "The table below also compares the modes on the model's own routing."
    assert len(said) == 2  # one stream only here: the lead world's sentence, then the pointer


def test_a_comparison_met_in_two_routing_worlds_counts_once_in_the_correction() -> None:
    # llama.cpp wins in both worlds, so its comparison with offload (neither has a synthetic variant)
    # is shown in both, over the same cells: one test in the page's correction, not two
    rows = [
        *(row(f"pm{i}", "s-p8", "paged", rep=i, decode=d, ttft=0.1) for i, d in enumerate((10.0, 10.5, 9.5))),
        *(row(f"ps{i}", "s-p8", "paged", rep=i, decode=d, ttft=0.1, routing=SYNTH)
          for i, d in enumerate((12.0, 12.5, 11.5))),
        *(row(f"l{i}", "s-ll2", "n-cpu-moe", "llamacpp", rep=i, decode=d, ttft=0.2)
          for i, d in enumerate((42.0, 42.5, 41.5))),
        *(row(f"o{i}", "s-off", "offload", rep=i, decode=d, ttft=0.3) for i, d in enumerate((30.0, 31.0, 29.0))),
    ]  # fmt: skip
    cells, groups = frames(rows)
    found = verdicts(groups, cells)
    shown = [(v.metric, frozenset({vs.winner_cells, vs.other_cells}), vs.estimate) for v in found for vs in v.versus]
    distinct = {(m, pair): e for m, pair, e in shown}
    assert len(distinct) < len(shown)  # llama.cpp vs offload in both worlds ...
    tested = {vs.comparisons for v in found for vs in v.versus}
    assert tested == {sum(1 for e in distinct.values() if e is not None)}  # ... counted once


def test_unverified_figures_are_listed_in_each_routing_world() -> None:
    from dataclasses import replace

    from benchsuite.report.first_screen import verdict_html, verdict_markdown

    cells, groups = frames(_mixed_routing())
    found = [replace(v, yardstick=(f"note {v.routing}",)) for v in verdicts(groups, cells)]
    lines = verdict_markdown(found, {})
    assert any(f"UNVERIFIED, c=1, on synthetic routing (qwen3-30b-a3b): note {SYNTH}" in x for x in lines)
    assert any("UNVERIFIED, c=1, on the model's own routing: note model" in x for x in lines)
    page = verdict_html(found, {})
    assert f"note {SYNTH}" in page and "note model" in page


def test_one_routing_keeps_the_plain_verdict() -> None:
    cells, groups = frames([r for r in _mixed_routing() if r["routing"] == "model"])
    assert [w for w, _ in routing_worlds(groups)] == [""]
    found = verdicts(groups, cells)
    assert {v.routing for v in found} == {""}
    assert headline(found, None)[0].startswith("With one stream, tiny K=8 decodes")


def test_the_random_model_caveat_says_what_its_routing_did() -> None:
    cells, _ = frames(_mixed_routing())
    pairs = miss_rates(cells)
    assert [(p.resident_experts, p.concurrency, p.model_miss_rate, p.synthetic_miss_rate) for p in pairs] == [
        (8, 1, 0.08, 0.17)
    ]
    requests = pd.DataFrame(
        {
            "cell_id": ["pm0", "pm1", "pm2", "ps0", "pm0"],
            "warmup": [False, False, False, False, True],
            "ok": [True, True, True, True, True],
            "output_text": [LOOPS[0], LOOPS[1], CORPUS.read_text()[:300], CORPUS.read_text()[300:600], LOOPS[2]],
        }
    )
    loops = output_loops(cells, requests)
    assert (loops.looped, loops.judged) == (2, 3)  # the warm-up and the synthetic-routing cell not judged
    text = random_model_caveat(["/m"], cells, requests)
    assert "looped in 2 of 3 requests" in text
    assert "missed 8.0% and 17.0% at c=1 of expert activations (the model's routing, then qwen3-30b-a3b" in text
    assert text.endswith(
        "judge paging by the rows on qwen3-30b-a3b routing, calibrated to a trained model's measured routing."
    )
    assert "near-uniform" not in text and "cheaper" not in text  # the direction is the data's, not assumed
    plain = random_model_caveat(["/m"], cells[cells["routing"] == "model"], None)
    assert "looped" not in plain and plain.endswith("a trained model's routing can be more or less local.")


def test_the_caveat_gives_both_ends_of_the_concurrency_and_only_calls_presets_calibrated() -> None:
    rows = [
        *_mixed_routing(),
        *(row(f"pm4{i}", "s-p8", "paged", conc=4, rep=i, decode=20.0, output=80.0, miss=0.29) for i in range(2)),
        *(row(f"ps4{i}", "s-p8", "paged", conc=4, rep=i, decode=30.0, output=120.0, miss=0.24, routing=SYNTH)
          for i in range(2)),
        row("probe", "s-p8", "paged", conc=4, decode=20.0, miss=0.9, params={"search_n": 8}),  # not a configuration
    ]  # fmt: skip
    cells, _ = frames(rows)
    text = random_model_caveat(["/m"], cells, None)
    assert "missed 8.0% and 17.0% at c=1, 29.0% and 24.0% at c=4 of expert activations" in text
    hand_set = [dict(r, routing="synthetic:zipf:1.2") if r["routing"] == SYNTH else r for r in _mixed_routing()]
    cells, groups = frames(hand_set)
    assert random_model_caveat(["/m"], cells, None).endswith("a trained model's routing can be more or less local.")
    # a hand-set synthetic routing does not lead even for a random-weight model
    assert [w for w, _ in routing_worlds(groups, synthetic_first=True)] == [MODEL_ROUTING, "synthetic:zipf:1.2"]


def test_an_interval_that_excludes_1_but_is_no_discovery_is_said_in_the_answer() -> None:
    from dataclasses import replace

    from benchsuite.report import stats

    cells, groups = frames(_mixed_routing())
    found = [v for v in verdicts(groups, cells) if v.routing == MODEL_ROUTING]
    first = found[0]
    est = stats.RatioEstimate(2.13, 1.14, 3.97, 0.03, 3, 3, stats.DEFAULT_ALPHA)
    vs = replace(first.versus[0], estimate=est, discovery=False)
    assert vs.corrected_away
    (sentence, *_) = headline([replace(first, versus=(vs,))], None)
    assert (
        "2.13 x llama N=2 [1.14–3.97], an interval that excludes 1 but no discovery after the page's correction"
        in sentence
    )


def test_a_search_probe_does_not_stand_for_the_mode_beside_full_repeats() -> None:
    rows = [
        *(row(f"p{i}", "s-p8", "paged", rep=i, decode=d, output=d, ttft=0.1) for i, d in enumerate((80.0, 81.0))),
        row("probe", "s-p8", "paged", decode=84.0, output=84.0, ttft=0.1, params={"search_n": 8}),
        *(row(f"l{i}", "s-ll2", "n-cpu-moe", "llamacpp", rep=i, decode=d, output=d, ttft=0.2)
          for i, d in enumerate((40.0, 40.5))),
    ]  # fmt: skip
    cells, groups = frames(rows)
    decode = next(v for v in verdicts(groups, cells) if v.metric == "decode_tok_s_p50")
    assert decode.versus[0].n_winner == 2 and decode.versus[0].estimate is not None
    assert "probe" not in decode.versus[0].winner_cells
