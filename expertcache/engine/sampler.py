"""Next-token choice: greedy, or temperature + top-k + top-p with a per-request seed; the batched
entry point applies penalties and grammar masks first and reports the model's logprobs."""

from __future__ import annotations

import torch

from .logits_processors import apply_penalties
from .params import SamplingParams, TokenLogprob
from .structured import apply_grammar


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


def sample_batch(logits: torch.Tensor, seqs: list, eos: set[int]) -> tuple[list[int], list[TokenLogprob]]:
    """logits [B, V] (the model's, row b for seqs[b]) -> (next token per sequence, its logprob entry).

    Logprobs are the model's log-softmax of `logits` as given, before penalties, grammar masks and
    temperature. Penalties/biases (logits_processors) and grammar masks (structured) are applied to
    the whole batch at once, then each row is sampled with its own parameters and generator.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    work = logits
    if any(s.params.penalized for s in seqs):
        work = logits.clone()
        apply_penalties(work, seqs, eos)
    if any(s.matcher is not None for s in seqs):
        work = work.clone() if work is logits else work
        apply_grammar(work, [s.matcher for s in seqs])
    toks = [sample(work[b], s.params, s.generator) for b, s in enumerate(seqs)]
    chosen = logprobs.gather(1, torch.tensor(toks, device=logits.device)[:, None])[:, 0].tolist()
    k = max((s.params.logprobs or 0 for s in seqs), default=0)
    top = torch.topk(logprobs, k, dim=-1) if k else None
    out = []
    for b, s in enumerate(seqs):
        alts = []
        if top is not None and s.params.logprobs:
            n = s.params.logprobs
            alts = list(zip(top.indices[b, :n].tolist(), top.values[b, :n].tolist()))
        out.append((toks[b], chosen[b], alts))
    return toks, out


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """logits [n, V] at positions p..p+n-1, targets = the tokens at p+1..p+m (m <= n) ->
    one entry per target: its logprob under the model and the top-k alternatives."""
    if not targets:
        return []
    lp = torch.log_softmax(logits[: len(targets)], dim=-1)
    t = torch.tensor(targets, device=logits.device)
    chosen = lp.gather(1, t[:, None])[:, 0].tolist()
    if k:
        top = torch.topk(lp, k, dim=-1)
        idx, val = top.indices.tolist(), top.values.tolist()
        return [(targets[i], chosen[i], list(zip(idx[i], val[i]))) for i in range(len(targets))]
    return [(targets[i], chosen[i], []) for i in range(len(targets))]
