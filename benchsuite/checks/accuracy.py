"""Cross-engine accuracy check: the same prompts, greedy, with logprobs, on two endpoints.

Definitions (per prompt, then pooled over prompts):
- first divergence: the first generated position whose token differs between A and B (None if
  the shorter output is a prefix of the longer and both have the same length).
- token agreement = sum(positions before the first divergence) / sum(min(len A, len B)).
  After a divergence the two engines condition on different prefixes, so later positions are
  not comparable and count as disagreement.
- logprob difference: |logprob_A - logprob_B| of the same token at each position before the
  first divergence; reported as median and max over all such positions.
A check passes when agreement >= min_agreement and max difference <= max_logprob_diff_nats.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from benchsuite.load.openai_http import Completion, complete, model_name


@dataclass(frozen=True)
class PromptComparison:
    prompt_id: str
    tokens_a: int
    tokens_b: int
    first_divergence: int | None
    matched: int  # positions before the first divergence
    logprob_abs_diffs: tuple[float, ...]  # one per matched position


@dataclass(frozen=True)
class Thresholds:
    min_agreement: float = 0.99
    max_logprob_diff_nats: float = 0.05


@dataclass(frozen=True)
class AccuracyReport:
    engine_a: str
    engine_b: str
    comparisons: tuple[PromptComparison, ...]
    thresholds: Thresholds
    token_agreement: float
    median_logprob_diff_nats: float | None
    max_logprob_diff_nats: float | None
    first_divergences: tuple[int | None, ...] = field(default=())

    @property
    def passed(self) -> bool:
        if self.token_agreement < self.thresholds.min_agreement:
            return False
        if self.max_logprob_diff_nats is None:
            return False  # nothing comparable is never a pass
        return self.max_logprob_diff_nats <= self.thresholds.max_logprob_diff_nats

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def compare_completions(prompt_id: str, a: Completion, b: Completion) -> PromptComparison:
    n = min(len(a.tokens), len(b.tokens))
    first = next((i for i in range(n) if a.tokens[i] != b.tokens[i]), None)
    if first is None and len(a.tokens) != len(b.tokens):
        first = n
    matched = n if first is None else min(first, n)
    diffs = tuple(abs(a.token_logprobs[i] - b.token_logprobs[i]) for i in range(matched))
    return PromptComparison(prompt_id, len(a.tokens), len(b.tokens), first, matched, diffs)


def summarize(
    engine_a: str, engine_b: str, comparisons: Sequence[PromptComparison], thresholds: Thresholds
) -> AccuracyReport:
    compared = sum(min(c.tokens_a, c.tokens_b) for c in comparisons)
    matched = sum(c.matched for c in comparisons)
    diffs = [d for c in comparisons for d in c.logprob_abs_diffs]
    return AccuracyReport(
        engine_a=engine_a,
        engine_b=engine_b,
        comparisons=tuple(comparisons),
        thresholds=thresholds,
        token_agreement=(matched / compared) if compared else 0.0,
        median_logprob_diff_nats=statistics.median(diffs) if diffs else None,
        max_logprob_diff_nats=max(diffs) if diffs else None,
        first_divergences=tuple(c.first_divergence for c in comparisons),
    )


async def run_accuracy(
    url_a: str,
    url_b: str,
    prompts: Sequence[tuple[str, str | list[int]]],
    *,
    max_tokens: int = 32,
    thresholds: Thresholds = Thresholds(),
    extras_a: dict[str, Any] | None = None,
    extras_b: dict[str, Any] | None = None,
) -> AccuracyReport:
    """Send every (prompt_id, prompt) greedily to both endpoints, one at a time, and compare."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:
        model_a, model_b = await asyncio.gather(model_name(session, url_a), model_name(session, url_b))
        comparisons = []
        for prompt_id, prompt in prompts:
            a = await complete(session, url_a, model_a, prompt, max_tokens, logprobs=True, extras=extras_a)
            b = await complete(session, url_b, model_b, prompt, max_tokens, logprobs=True, extras=extras_b)
            comparisons.append(compare_completions(prompt_id, a, b))
    return summarize(url_a, url_b, comparisons, thresholds)


def format_report(report: AccuracyReport) -> str:
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4g}"

    lines = [
        f"A: {report.engine_a}",
        f"B: {report.engine_b}",
        f"prompts: {len(report.comparisons)}",
        f"token agreement: {report.token_agreement:.4f} (min {report.thresholds.min_agreement})",
        f"logprob |diff| nats: median {fmt(report.median_logprob_diff_nats)}, "
        f"max {fmt(report.max_logprob_diff_nats)} (limit {report.thresholds.max_logprob_diff_nats})",
        "first divergence per prompt: " + ", ".join("-" if d is None else str(d) for d in report.first_divergences),
        f"result: {'PASS' if report.passed else 'FAIL'}",
    ]
    return "\n".join(lines)
