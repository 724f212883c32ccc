"""The report's first screen: per setup (run, workload, prompt class) and concurrency, which mode is
fastest, by how much against every other mode, with the interval over repeats, and the caveats that
change the reading, beside it.

- headline metrics: decode tok/s per stream at concurrency 1; above it the decode aggregate
  (metrics' decode_agg_tok_s: tokens after each stream's first over the time any stream was
  decoding), then output tok/s of all streams (prefill time included, so at c>=2 with short outputs
  it is mostly a TTFT figure), and TTFT p50 for the setup's prompt class; each named with its unit;
- the yardstick: cells of the setup and concurrency whose requests failed the cross-check against the
  engine's own timings (`engine_timings_flag`) or went untimed (`untimed_flag`), named beside the
  verdict (`Verdict.yardstick`) so a figure the suite could not verify never reads as plain;
- a configuration that does not fit (a llama.cpp --n-cpu-moe whose memory projection exceeds the
  budget) is no contender;
- a mode is (engine kind, mode), synthetic routing apart; its best configuration (best K, best N)
  stands for it (among configurations with enough repeats for an interval, when any has: not a
  search's one-cell probe); the fastest mode's best configuration is compared with each other
  mode's best: "A is N x B [low–high]",
  N = the ratio of geometric means over ok repeats, the 95% interval from benchsuite.report.stats, and
  "significant" only for a discovery after Benjamini-Hochberg over all the page's comparisons (too
  few repeats: "not enough repeats", no verdict);
- caveats (benchsuite.report.caveats): CPU device, random-weight model, synthetic routing, bytes per
  expert that differ between engines, a busy machine, a client that could not keep up.

Configuration facts (mode, K, N, routing) are read through `config_facts`, the one place to switch
to typed fields carried by each cell.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd

from benchsuite.report import stats
from benchsuite.report.groups import is_calibrated, is_synthetic, synthetic_spec
from benchsuite.report.names import short_name
from benchsuite.report.tables import best_config, fits, headline_metric

DECODE_AGG_METRIC = "decode_agg_tok_s"
THROUGHPUT_NAMES = {
    "decode_tok_s_p50": "decode tok/s per stream",
    DECODE_AGG_METRIC: "decode tok/s, all streams (tokens after each first / time any stream decoded)",
    "output_tok_s": "output tok/s, all streams (prefill included)",
}
TTFT_METRIC = "ttft_p50_s"
YARDSTICK_FLAGS = ("engine_timings_flag", "untimed_flag")
"""metrics' flags that say a cell's own figures could not be verified (first screen, not only a table)."""


def verdict_metrics(concurrency: int) -> tuple[str, ...]:
    """The throughput metrics judged at a concurrency, then TTFT: at c>=2 the decode aggregate first
    (the decode verdict), then output tok/s (which counts prefill time)."""
    if int(concurrency) == 1:
        return (headline_metric(concurrency), TTFT_METRIC)
    return (DECODE_AGG_METRIC, headline_metric(concurrency), TTFT_METRIC)


@dataclass(frozen=True)
class ConfigFacts:
    """What a configuration is, as the verdict names it."""

    family: str  # "paged (builtin)", "n-cpu-moe (llamacpp)": one mode of one engine kind
    label: str  # the configuration's label (K, N, offload amount)
    routing: str
    name: str  # its short name for sentences ("paged-fp8 K=40", report.names)


def config_facts(group: pd.Series) -> ConfigFacts:
    """Mode, K/N and routing of one configuration row of groups (today: the annotated columns that
    report.groups reads from params, extras and the command line)."""
    routing = str(group["routing"])
    family = f"{group['mode']} ({group['engine_kind']})" + (f", {routing}" if is_synthetic(routing) else "")
    return ConfigFacts(family, str(group["label"]), routing, short_name(group))


@dataclass(frozen=True)
class Versus:
    """The winner against one other mode's best configuration."""

    other: str  # the other configuration's label
    other_family: str
    other_median: float
    estimate: stats.RatioEstimate | None  # winner / other over repeats
    n_winner: int
    n_other: int
    discovery: bool  # significant after Benjamini-Hochberg over every comparison of the report
    winner_cells: tuple[str, ...]  # the winner's ok cells
    other_cells: tuple[str, ...]  # the other's ok cells
    comparisons: int = 0  # how many comparisons the page's correction ran over (set by `verdicts`)
    other_name: str = ""  # the other's short name (report.names)

    @property
    def cell_ids(self) -> tuple[str, ...]:
        return (*self.winner_cells, *self.other_cells)

    @property
    def corrected_away(self) -> bool:
        """The interval alone excludes 1, but the comparison is no discovery after the page's correction."""
        return self.estimate is not None and self.estimate.significant and not self.discovery

    def text(self, winner: str, ttft: bool, other: str | None = None) -> str:
        """ "winner is N x other [low–high], verdict"; `other` names the other mode (default: its label)."""
        other = self.other if other is None else other
        if self.estimate is None:
            return f"vs {other}: {stats.not_enough_text(self.n_winner, self.n_other)}"
        e = self.estimate
        if ttft:  # a TTFT ratio below 1 is a win: said as "N x faster", its interval inverted with it
            faster = e.ratio <= 1.0
            factor, low, high = (1 / e.ratio, 1 / e.high, 1 / e.low) if faster else (e.ratio, e.low, e.high)
            what = (
                f"{winner} reaches the first token {stats.times_text(factor)} x "
                f"{'faster' if faster else 'slower'} than {other}"
            )
        else:
            what, low, high = f"{winner} is {stats.times_text(e.ratio)} x {other}", e.low, e.high
        return f"{what} [{stats.times_text(low)}–{stats.times_text(high)}], {self.verdict_text()}"

    def verdict(self) -> str:
        if self.estimate is None:
            return stats.not_enough_text(self.n_winner, self.n_other)
        return stats.SIGNIFICANT if self.discovery else stats.NOT_SIGNIFICANT

    def verdict_text(self) -> str:
        """The verdict, with the correction said in words where the interval alone excludes 1 (which would
        read as a contradiction of "not significant")."""
        if not self.corrected_away:
            return self.verdict()
        return (
            f"{stats.NOT_SIGNIFICANT} after correcting for the page's {self.comparisons} comparisons "
            "(the interval alone excludes 1)"
        )


@dataclass(frozen=True)
class Verdict:
    run_id: str
    workload: str
    prompt_class: str
    concurrency: int
    metric: str  # CellResult column
    metric_name: str  # with its unit
    winner: str
    winner_family: str
    winner_median: float  # in the display unit (ms for TTFT)
    versus: tuple[Versus, ...]
    yardstick: tuple[str, ...] = ()  # cells of this setup and concurrency whose figures failed verification
    winner_name: str = ""  # the winner's short name (report.names)
    routing: str = ""  # its routing world (routing_worlds): "" where the setup had one, else "model" or synthetic

    @property
    def ttft(self) -> bool:
        return self.metric == TTFT_METRIC

    @property
    def significant(self) -> bool:
        """The winner is significantly better than every other mode (a discovery against each): only then
        is it emphasized as the fastest."""
        return bool(self.versus) and all(vs.discovery for vs in self.versus)

    def lines(self) -> list[str]:
        return [v.text(self.winner, self.ttft) for v in self.versus]


def _verdict(setup: pd.DataFrame, concurrency: int, metric: str) -> Verdict | None:
    ttft = metric == TTFT_METRIC
    rows = setup[setup["concurrency"] == concurrency]
    best: dict[str, pd.Series] = {}
    for family, members in rows.groupby([config_facts(r).family for _, r in rows.iterrows()], sort=True):
        chosen = best_config(members, metric, ttft)
        if chosen is not None:
            best[str(family)] = chosen
    if len(best) < 2:
        return None
    winner_family = (min if ttft else max)(best, key=lambda f: best[f][metric].median)
    winner = best[winner_family]
    scale = 1000.0 if ttft else 1.0
    versus = []
    for family, other in sorted(best.items(), key=lambda kv: kv[1][metric].median, reverse=not ttft):
        if family == winner_family:
            continue
        a, b = winner[metric], other[metric]
        estimate = stats.ratio_estimate(a.values, b.values)
        versus.append(
            Versus(
                config_facts(other).label,
                family,
                b.median * scale,
                estimate,
                len(a.values),
                len(b.values),
                estimate is not None and estimate.significant,
                tuple(winner["ok_cell_ids"]),
                tuple(other["ok_cell_ids"]),
                other_name=config_facts(other).name,
            )
        )
    name = f"TTFT p50 (ms), {winner['prompt_class']} prompts" if ttft else f"{THROUGHPUT_NAMES[metric]} (tok/s)"
    return Verdict(
        str(winner["run_id"]),
        str(winner["workload"]),
        str(winner["prompt_class"]),
        int(concurrency),
        metric,
        name,
        config_facts(winner).label,
        winner_family,
        winner[metric].median * scale,
        tuple(versus),
        winner_name=config_facts(winner).name,
    )


MODEL_ROUTING = "model"


def _mode_of(row: pd.Series) -> str:
    return f"{row['mode']} ({row['engine_kind']})"


def routing_worlds(setup: pd.DataFrame, synthetic_first: bool = False) -> list[tuple[str, pd.DataFrame]]:
    """The setup's configurations split by the routing they can be compared under. One routing: one
    world, named "". With synthetic routing: a mode measured under it (paged) is compared with the
    other modes under that routing, never with itself under the model's routing (two routings of one
    mode are two assumptions about the model, not two ways to serve it); modes measured only under
    the model's routing (llama.cpp, resident, offload: their speed does not depend on which experts
    are chosen) take part in every world. `synthetic_first`: the synthetic worlds lead (a
    random-weight model, whose own routing stands for no trained model's): the worlds of synthetic
    routing calibrated to a trained model lead, hand-set ones (uniform, Zipf) follow the model's."""
    synthetic = setup["routing"].map(lambda r: is_synthetic(str(r)))
    routings = sorted({str(r) for r in setup.loc[synthetic, "routing"]})
    if not routings:
        return [("", setup)]
    varied = {_mode_of(row) for _, row in setup[synthetic].iterrows()}
    unvaried = setup[[not s and _mode_of(row) not in varied for s, (_, row) in zip(synthetic, setup.iterrows())]]
    worlds = [(r, pd.concat([setup[setup["routing"].astype(str) == r], unvaried])) for r in routings]
    model = [(MODEL_ROUTING, setup[~synthetic])]
    if not synthetic_first:
        return model + worlds
    calibrated = [w for w in worlds if is_calibrated(w[0])]
    return calibrated + model + [w for w in worlds if not is_calibrated(w[0])]


def routing_phrase(routing: str) -> str:
    """How a verdict names its routing world ("" for a setup with one)."""
    if not routing:
        return ""
    if routing == MODEL_ROUTING:
        return "on the model's own routing"
    return f"on synthetic routing ({synthetic_spec(routing)})"


def verdicts(
    groups: pd.DataFrame,
    cells: pd.DataFrame,
    alpha: float = stats.DEFAULT_ALPHA,
    synthetic_first: Collection[tuple[str, str, str]] = (),
) -> list[Verdict]:
    """Per setup, routing world (`routing_worlds`) and concurrency: the throughput verdict, then the
    TTFT verdict. "Significant" is a discovery after Benjamini-Hochberg over every comparison of the
    page, so a page of many comparisons between equal modes still says "not significant" everywhere
    (at rate alpha). `synthetic_first`: setups (run, workload, prompt class) whose synthetic-routing
    worlds lead."""
    out: list[Verdict] = []
    keys = ["run_id", "workload", "prompt_class"]
    contenders = groups[[fits(row, cells) for _, row in groups.iterrows()]] if len(groups) else groups
    for key, whole in contenders.groupby(keys, sort=True):
        for routing, setup in routing_worlds(whole, tuple(str(k) for k in key) in synthetic_first):
            for concurrency in sorted({int(c) for c in setup["concurrency"]}):
                notes = yardstick_notes(setup, cells, concurrency)
                for metric in verdict_metrics(concurrency):
                    found = _verdict(setup, concurrency, metric)
                    if found is not None:
                        named = f"{found.metric_name}, {routing_phrase(routing)}" if routing else found.metric_name
                        out.append(replace(found, yardstick=notes, routing=routing, metric_name=named))
    # one test per distinct comparison: modes without a synthetic variant meet in every routing world,
    # the same cells each time, and a repeated test would count twice in the correction
    unique: dict[tuple[str, frozenset[tuple[str, ...]]], stats.RatioEstimate | None] = {}
    for v in out:
        for vs in v.versus:
            unique.setdefault(_comparison_key(v, vs), vs.estimate)
    flags = stats.benjamini_hochberg([None if e is None else e.p_value for e in unique.values()], alpha)
    discovery = dict(zip(unique, flags))
    tested = sum(1 for e in unique.values() if e is not None)
    return [
        replace(
            v,
            versus=tuple(
                replace(vs, discovery=discovery[_comparison_key(v, vs)], comparisons=tested) for vs in v.versus
            ),
        )
        for v in out
    ]


def _comparison_key(v: Verdict, vs: Versus) -> tuple[str, frozenset[tuple[str, ...]]]:
    return v.metric, frozenset({tuple(sorted(vs.winner_cells)), tuple(sorted(vs.other_cells))})


def yardstick_notes(setup: pd.DataFrame, cells: pd.DataFrame, concurrency: int) -> tuple[str, ...]:
    """One line per configuration of the setup at this concurrency with a cell whose figures failed
    verification (YARDSTICK_FLAGS): its label, how many of its cells, the first cell's flag."""
    notes: list[str] = []
    for _, row in setup[setup["concurrency"] == concurrency].iterrows():
        mine = cells[cells["cell_id"].isin(row["cell_ids"])]
        for flag in YARDSTICK_FLAGS:
            texts = [str(e[flag]) for e in mine["extras"] if isinstance(e, dict) and e.get(flag)]
            if texts:
                notes.append(f"{row['label']} ({len(texts)} of {len(mine)} cells): {texts[0]}")
    return tuple(notes)


def verdict_table(found: list[Verdict]) -> pd.DataFrame:
    """The first screen as a frame (tables.md / tables.csv): one row per verdict and other mode."""
    rows: list[dict[str, Any]] = []
    for v in found:
        for vs in v.versus:
            e = vs.estimate
            rows.append(
                {
                    "setup": f"{v.run_id} · {v.workload} · {v.prompt_class}",
                    "concurrency": v.concurrency,
                    "routing": v.routing,
                    "metric": v.metric_name,
                    "fastest": v.winner,
                    "fastest_median": v.winner_median,
                    "versus": vs.other,
                    "versus_median": vs.other_median,
                    "ratio": None if e is None else e.ratio,
                    "ratio_low": None if e is None else e.low,
                    "ratio_high": None if e is None else e.high,
                    "verdict": vs.verdict(),
                    "p_value": None if e is None else e.p_value,
                    "statement": vs.text(v.winner, v.ttft),
                    "yardstick": " | ".join(v.yardstick),
                    "cell_ids": " ".join(vs.cell_ids),
                }
            )
    return pd.DataFrame(rows)
