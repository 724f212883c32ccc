"""`StepLogits`: what one model step hands back to its caller (the engine, a benchmark, a test), with the host's
side of a step that ran prompt chunks (`PrefillStepHost`) and the rule that says which chunks those are
(`is_prompt_chunk`, shared by the prefill counters and the server's per-request figures).

The logits stay on the model's device: an engine that samples greedily reads back only each row's
argmax (`greedy`, computed on the device), and only rows that need the full distribution (seeded
sampling, logprobs) travel to the host. A graphed decode step's tensors are its graph's static
outputs: valid until the next step of that batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def is_prompt_chunk(tokens: int) -> bool:
    """Whether a sequence's `tokens` in one step are a prompt chunk, as the prefill counters count one: more than
    one token (a decode token is alone in its sequence; so is a prompt's one-token last chunk, counted as none)."""
    return tokens > 1


@dataclass(frozen=True)
class PrefillStepHost:
    """The host's side of ONE prefill step (perf_counter seconds), for a server to give the requests whose prompt
    chunks the step ran (their `timings`): the same figures as `PrefillCounts`' host fields, not summed over steps,
    with `issue_s`, the model's host time from the step's call to its return (every launch issued; with the
    model's own router, the reads of its ids too; `StepLogits.prefill`), and the thread's CPU time in it. Host
    figures only: they are known when the step returns, where the device's (copy, span, idle) are events read
    later."""

    chunks: int  # prompt chunks in the step (more than one: the step's figures are shared by their requests)
    tokens: int
    layer_steps: int  # host-planned paged layer-steps (0 in resident and offload steps)
    router_s: float = 0.0
    host_wait_s: float = 0.0
    host_plan_s: float = 0.0
    issue_s: float = 0.0
    # the calling thread's CPU time over the same interval (time.thread_time): below issue_s by the time the thread
    # was off the CPU (preempted, or waiting for the interpreter lock another thread held; a CUDA read that spins
    # keeps the thread on it); near issue_s, the thread ran throughout and a longer issue_s was more work or a
    # slower CPU
    issue_cpu_s: float = 0.0
    # how the rest of issue_s went (thread_clock): runnable but waiting for a CPU, and the context switches, voluntary
    # (it blocked: the interpreter lock, a sleeping read) and involuntary (the scheduler took the CPU back); then the
    # CPU it ran on at the step's start and end. None: the platform cannot say (only Linux gives all of them)
    issue_run_delay_s: float | None = None
    issue_voluntary_switches: int | None = None
    issue_involuntary_switches: int | None = None
    cpu_id_first: int | None = None
    cpu_id_last: int | None = None


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
