"""Shared fixtures. Keep this small: a fixture belongs here only when several test modules need it."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly generated `tiny` checkpoint (HF layout + tokenizer), once per test session."""
    from paged_experts.synth import write_checkpoint

    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt")
