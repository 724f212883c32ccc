"""Prometheus text from an engine's /metrics: parsed by prometheus_client, scraped over HTTP, one series read.

A counter that cannot be read is absent (None), never 0; text that is not the exposition format is an
error, never a partial, guessed read.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {"name" or "name{labels}": value}, parsed by prometheus_client;
    histogram and summary series keep their own names (`_bucket{le=..}`, `_sum`, `_count`).
    Raises ValueError on text that is not the exposition format (never a partial, guessed read)."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sample.labels.items())
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = float(sample.value)
    return samples


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


async def scrape_prometheus(session: Any, base_url: str, prefix: str) -> dict[str, float] | None:
    """GET /metrics -> {series: value} for series whose name starts with `prefix`; None when the
    endpoint is missing, fails, or answers something unparseable (a counter that cannot be read is
    absent, never 0)."""
    async with session.get(f"{base_url}/metrics") as resp:
        if resp.status != 200:
            return None
        text = await resp.text()
    try:
        samples = parse_prometheus(text)
    except ValueError:
        return None
    return {series: value for series, value in samples.items() if series.startswith(prefix)}


def metric_value(samples: dict[str, float], name: str) -> float | None:
    """The unlabelled series `name`, else the sum of its labelled series; None when absent."""
    if name in samples:
        return samples[name]
    prefix = name + "{"
    labelled = [v for k, v in samples.items() if k.startswith(prefix)]
    return sum(labelled) if labelled else None
