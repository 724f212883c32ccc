"""`StepLogits`: what one model step hands back to its caller (the engine, a benchmark, a test).

The logits stay on the model's device: an engine that samples greedily reads back only each row's
argmax (`greedy`, computed on the device), and only rows that need the full distribution (seeded
sampling, logprobs) travel to the host. A graphed decode step's tensors are its graph's static
outputs: valid until the next step of that batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_experts.residency.counters import PrefillStepHost


@dataclass(frozen=True)
class StepLogits:
    logits: torch.Tensor  # [R, V] in the model dtype, on the model's device
    greedy: torch.Tensor  # [R] int64: argmax of each row (first maximal index, as torch.argmax)
    rows: tuple[int, ...]  # rows of each chunk, in chunk order: n if the chunk asked all_logits, else 1
    # a step with a prompt chunk: the host's side of it (issue time, paged layers' plan and waits), for the
    # requests whose chunks it ran (the server's per-request timings); None for other steps
    prefill: PrefillStepHost | None = None

    @classmethod
    def empty(cls, device: torch.device) -> StepLogits:
        return cls(torch.empty(0, 0, device=device), torch.empty(0, dtype=torch.long, device=device), ())

    def cpu_rows(self) -> list[torch.Tensor]:
        """fp32 CPU logits per chunk: [n, V] (all_logits) or [1, V]."""
        if not self.rows:
            return []
        return list(torch.split(self.logits.to("cpu", torch.float32), list(self.rows)))

    def last_row_index(self) -> list[int]:
        """The row of each chunk's last token (the one a sampling chunk samples from)."""
        out, end = [], 0
        for n in self.rows:
            end += n
            out.append(end - 1)
        return out
