"""Cross-request leak canary (DESIGN.md section 6: stale KV pages served with HTTP 200 exist).

Two checks against any OpenAI-compatible endpoint, greedy decoding throughout:
1. Marker leak: one request carries a random marker (`CANARY-<hex>`); many unrelated requests
   are sent after it (sequential) and beside it (concurrent). Any unrelated response containing
   the marker, or its hex body, is a leak.
2. Interference: each unrelated prompt is first answered alone; under concurrency its greedy
   output must be the same. A difference means another request's state reached it (or the
   engine's batching is not batch-invariant: engines that document non-deterministic batching
   should be run in their deterministic mode for this check). Reported apart from leaks.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from benchsuite.load.openai_http import complete, model_name

UNRELATED_PROMPTS = (
    "The recipe for a simple tomato soup starts with",
    "In the early morning the harbour was quiet and",
    "A good way to learn a new programming language is",
    "The history of the printing press shows that",
    "When planning a long hike, the first thing to check is",
    "The planets of the outer solar system are",
    "To keep a small garden healthy through the summer,",
    "The rules of chess say that a pawn",
)


@dataclass(frozen=True)
class CanaryReport:
    marker: str
    requests_checked: int
    leaks: tuple[str, ...]  # descriptions of responses that contained the marker
    interference: tuple[str, ...]  # prompts whose concurrent output differed from their solo output

    @property
    def passed(self) -> bool:
        return not self.leaks

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def _contains_marker(text: str, marker: str) -> bool:
    body = marker.split("-", 1)[1]
    return marker in text or body in text


async def run_canary(
    base_url: str,
    *,
    rounds: int = 3,
    concurrency: int = 8,
    max_tokens: int = 24,
    extras: dict[str, Any] | None = None,
    seed_marker: str | None = None,
) -> CanaryReport:
    marker = seed_marker or f"CANARY-{secrets.token_hex(6)}"
    planted = f"Remember this code and repeat it exactly: {marker}. The code is {marker}. Repeat: "
    timeout = aiohttp.ClientTimeout(total=600)
    leaks: list[str] = []
    interference: list[str] = []
    checked = 0
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:
        model = await model_name(session, base_url)

        async def ask(prompt: str) -> str:
            return (await complete(session, base_url, model, prompt, max_tokens, extras=extras)).text

        solo = {p: await ask(p) for p in UNRELATED_PROMPTS}
        checked += len(solo)
        for round_index in range(rounds):
            # Sequential: plant, then every unrelated prompt right after it.
            await ask(planted)
            for p in UNRELATED_PROMPTS:
                out = await ask(p)
                checked += 1
                if _contains_marker(out, marker):
                    leaks.append(f"round {round_index} sequential: {p!r} -> {out!r}")
                if out != solo[p]:
                    interference.append(f"round {round_index} sequential: {p!r}")
            # Concurrent: the planted request in flight beside unrelated ones.
            batch = [planted] + [UNRELATED_PROMPTS[i % len(UNRELATED_PROMPTS)] for i in range(concurrency - 1)]
            outs = await asyncio.gather(*(ask(p) for p in batch))
            for p, out in zip(batch[1:], outs[1:]):
                checked += 1
                if _contains_marker(out, marker):
                    leaks.append(f"round {round_index} concurrent: {p!r} -> {out!r}")
                if out != solo[p]:
                    interference.append(f"round {round_index} concurrent: {p!r}")
    return CanaryReport(marker, checked, tuple(leaks), tuple(interference))


def format_report(report: CanaryReport) -> str:
    lines = [
        f"marker: {report.marker}",
        f"responses checked: {report.requests_checked}",
        f"leaks: {len(report.leaks)}",
        *(f"  {x}" for x in report.leaks),
        f"outputs that changed under concurrency: {len(report.interference)}",
        *(f"  {x}" for x in report.interference[:10]),
        f"result: {'PASS' if report.passed else 'FAIL (marker leaked)'}",
    ]
    return "\n".join(lines)
