"""Next-token choice per sequence: greedy, or temperature + top-k + top-p with a per-request seed."""

from __future__ import annotations

import torch

from .params import SamplingParams


# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by 1e-40 overflows to inf.
GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] float32, all finite -> token id. Safe for any finite logits: they are shifted so
    the largest is 0 before the division, so nothing overflows to +inf and softmax has a 1."""
    if params.temperature < GREEDY_BELOW or params.top_k == 1:
        return int(torch.argmax(logits))
    logits = (logits - logits.max()) / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p  # smallest set reaching top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
