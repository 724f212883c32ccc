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
    said = headline(found, None)
    assert said[0].startswith(
        "With one stream on synthetic routing (qwen3-30b-a3b), tiny K=8 (synthetic routing) decodes"
    )
    assert said[-1].startswith("With one stream on the model's own routing, tiny K=8 decodes")


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
    assert "missed 8.0% of expert activations on the model's routing against 17.0% on qwen3-30b-a3b" in text
    assert "judge paging by the synthetic-routing rows" in text
    assert "near-uniform" not in text
    plain = random_model_caveat(["/m"], cells[cells["routing"] == "model"], None)
    assert "looped" not in plain and plain.endswith("a trained model's routing can be more or less local.")


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
