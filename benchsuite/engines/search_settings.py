"""What a matrix may ask of a search against a memory budget: `<option>: search` or `{search: {...}}`.

Two knobs are searched, each with its own settings model:
- llama.cpp `n_cpu_moe` (`NCpuMoeSettings`): the fastest N whose projection fits;
- the built-in engine's paged `resident_experts` (`ResidentExpertsSettings`): the largest K whose
  measured peak device memory fits (or the fastest such K, `objective: fastest`).

Which option each model serves is the contract's (benchsuite.engines.base.SEARCH_KNOBS). Its own
module (pydantic only) so an engine's options model can validate a search request at the matrix
boundary without importing the search itself (benchsuite.run.search), which drives the runner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from benchsuite.errors import UserError

Metric = Literal["decode_tok_s_p50", "output_tok_s"]


class NCpuMoeSettings(BaseModel):
    """`n_cpu_moe: {search: {...}}` (all optional; `n_cpu_moe: search` takes the defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_n: int = Field(0, ge=0)
    max_n: int | None = Field(None, ge=0)  # default: the model's layer count (all experts on the CPU)
    rel_tol: float = Field(0.02, ge=0.0)  # a step right must improve by more than this to continue
    metric: Metric = "decode_tok_s_p50"
    margin_mib: int = Field(1024, ge=0)  # llama.cpp's default fit margin per device
    projection: Literal["auto", "benchsuite", "llama-fit-params"] = "auto"


SearchSettings = NCpuMoeSettings  # the name the n_cpu_moe search had first


class ResidentExpertsSettings(BaseModel):
    """`resident_experts: {search: {...}}` for the built-in engine's mode paged (all optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Default: max concurrency x top_k, so every concurrency of the matrix decodes in one wave on the
    # captured graph path (B x top_k <= K); set it to the model's top_k to allow multi-wave batches.
    min_k: int | None = Field(None, ge=1)
    max_k: int | None = Field(None, ge=1)  # default: the model's expert count
    # largest: the largest K whose measured peak fits (memory is linear in K, so 2-3 launches);
    # fastest: then the fastest measured K at or below it (hill climbing towards smaller K)
    objective: Literal["largest", "fastest"] = "largest"
    metric: Metric = "decode_tok_s_p50"  # what `fastest` maximises; recorded for every launch
    rel_tol: float = Field(0.02, ge=0.0)  # fastest: a step must improve by more than this to continue
    # What the first launch adds to the projection (CUDA context, allocator caches, graphs, activations)
    # before the measurement replaces the guess; never a reason to rule a K out.
    overhead_mib: int = Field(1024, ge=0)


SearchSettingsAny = NCpuMoeSettings | ResidentExpertsSettings  # what parse_with returns


def parse_with(model: type[NCpuMoeSettings] | type[ResidentExpertsSettings], value: Any,
               option: str) -> SearchSettingsAny:  # fmt: skip
    """`search` or `{search: {...}}` -> `model`'s settings for `option` (benchsuite.engines.base
    .SearchKnob.parse names the model of each option); anything else is a user error."""
    if value == "search":
        return model()
    if isinstance(value, Mapping) and set(value) == {"search"}:
        body = value["search"] or {}
        if not isinstance(body, Mapping):
            raise UserError(f"{option}: {{search: ...}} must hold a mapping of search settings")
        try:
            return model.model_validate(dict(body))
        except ValidationError as exc:  # one line per problem, named by its path (pydantic's text spans lines)
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise UserError(f"{option}.search.{problems}") from None
    raise UserError(f"{option}: expected an integer, 'search' or {{search: {{...}}}}, got {value!r}")
