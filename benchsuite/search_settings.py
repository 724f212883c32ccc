"""What a matrix may ask of the `--n-cpu-moe` search: `n_cpu_moe: search` or `{search: {...}}`.

Its own module (pydantic only) so the llama.cpp options model can validate a search request at
the matrix boundary without importing the search itself (benchsuite.search), which drives the runner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from benchsuite.errors import UserError


class SearchSettings(BaseModel):
    """`n_cpu_moe: {search: {...}}` (all optional; `n_cpu_moe: search` takes the defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_n: int = Field(0, ge=0)
    max_n: int | None = Field(None, ge=0)  # default: the model's layer count (all experts on the CPU)
    rel_tol: float = Field(0.02, ge=0.0)  # a step right must improve by more than this to continue
    metric: Literal["decode_tok_s_p50", "output_tok_s"] = "decode_tok_s_p50"
    margin_mib: int = Field(1024, ge=0)  # llama.cpp's default fit margin per device
    projection: Literal["auto", "benchsuite", "llama-fit-params"] = "auto"


def parse_request(value: Any) -> SearchSettings:
    """`search` or `{search: {...}}` -> settings; anything else is a user error."""
    if value == "search":
        return SearchSettings()
    if isinstance(value, Mapping) and set(value) == {"search"}:
        body = value["search"] or {}
        if not isinstance(body, Mapping):
            raise UserError("n_cpu_moe: {search: ...} must hold a mapping of search settings")
        try:
            return SearchSettings.model_validate(dict(body))
        except ValidationError as exc:
            raise UserError(f"n_cpu_moe.search: {exc}") from None
    raise UserError(f"n_cpu_moe: expected an integer, 'search' or {{search: {{...}}}}, got {value!r}")
