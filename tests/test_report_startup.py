"""The report names each server's start-up: launch to ready, and the built-in server's own breakdown."""

from __future__ import annotations

from benchsuite.report.manifest_facts import startup_text
from benchsuite.results.manifest import ServerRecord


def test_startup_text_reads_the_runner_time_and_the_engine_breakdown() -> None:
    record = ServerRecord(
        startup_s=53.08,
        startup_facts={"engine_startup_s": {"load_s": 37.83, "capture_s": 11.29, "graphs": 4.0, "ready_s": 49.1}},
    )
    assert startup_text(record) == "ready in 53.1 s (load 37.8 s, 4 graphs captured in 11.3 s)"
    assert startup_text(ServerRecord(startup_s=3.8)) == "ready in 3.8 s"  # llama.cpp: no breakdown
    assert startup_text(ServerRecord()) == "not recorded"
