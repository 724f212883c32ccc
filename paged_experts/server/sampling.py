"""Token choice and logprobs for the engine: greedy, seeded temperature / top-p sampling, and the
raw model distribution's log-probabilities (before temperature), as vLLM reports by default.

Pure tensor functions over fp32 logits rows; the engine calls them inside its worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model and the `top` best alternatives (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def sample_token(row: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token from a logits row [V]: argmax when temperature is 0, else a seeded draw."""
    if temperature == 0.0:
        return int(torch.argmax(row).item())
    probs = torch.softmax(row.detach().to("cpu", torch.float32) / temperature, dim=-1)  # [V]
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)  # [V], [V]
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p  # [V]
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprobs(rows: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Logprobs of `token_ids[i]` under `rows[i]` ([N, V] logits) with the `top_n` best alternatives."""
    logp = torch.log_softmax(rows.to(torch.float32), dim=-1)  # [N, V]
    ids = torch.tensor(token_ids, dtype=torch.long, device=logp.device)  # [N]
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()  # [N]
    if top_n > 0:
        top_vals, top_ids = torch.topk(logp, top_n, dim=-1)  # [N, top_n] each
        top_pairs = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
    else:
        top_pairs = [() for _ in token_ids]
    return [TokenLogprob(t, float(lp), top) for t, lp, top in zip(token_ids, chosen, top_pairs)]
