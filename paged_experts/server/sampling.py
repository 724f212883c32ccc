"""Token choice and logprobs for the engine: greedy, seeded temperature / top-p sampling, and the
raw model distribution's log-probabilities (before temperature), as vLLM reports by default.

Pure tensor functions over fp32 logits rows; the engine calls them inside its worker thread.

Numerically safe for every temperature and top_p the API admits (temperature in [0, 2], top_p in
(0, 1]), however small: the logits are shifted so their maximum is 0 and scaled in float64, so a
temperature of 1e-40 or 5e-324 (which is 0 in float32) gives a one-hot distribution on the argmax
(greedy, ties split evenly) instead of inf/inf = NaN; the top-p nucleus always keeps the best token,
so a top_p of 5e-324 is top-1 instead of an all-zero distribution. A row that still holds no finite
logit (a model fault) raises ValueError, which fails that request alone (engine._result).
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
    probs = _tempered_probs(row, temperature)  # [V] float64, max entry > 0
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)  # [V], [V]
        # keep the smallest prefix whose mass reaches top_p; the first token always stays
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p  # [V]
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _tempered_probs(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(row / temperature) [V] in float64, finite for any temperature > 0."""
    logits = row.detach().to("cpu", torch.float64)  # [V]; float64 holds 5e-324, float32 rounds it to 0
    top = torch.max(logits)
    if not torch.isfinite(top):
        raise ValueError(f"the model produced no finite logit (max {float(top)}); cannot sample")
    # (logit - max) <= 0, so dividing by a tiny temperature gives 0 for the best and -inf (never NaN) for the rest
    scaled = (logits - top) / temperature  # [V]
    return torch.softmax(scaled, dim=-1)


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
