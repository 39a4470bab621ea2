"""Next-token choice: greedy, or temperature + top-k + top-p with a per-request seed; the batched
entry point applies penalties and grammar masks first and reports the model's logprobs.

Shape legend: B rows sampled (one per sequence), R logits rows, V vocabulary.
The chosen token's logprob is its logit minus the row's logsumexp (`row_stats`: one C++ pass on the
CPU that also gives the argmax for greedy rows and the engine's finite check); the full
log-softmax is computed only for the rows that asked for top logprobs.
"""

from __future__ import annotations

import torch

from ..kernels import small_ops
from .logits_processors import apply_penalties
from .params import SamplingParams, TokenLogprob
from .structured import apply_grammar

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by 1e-40 overflows to inf.
GREEDY_BELOW = 1e-5


def greedy(params: SamplingParams) -> bool:
    """The row's token is its argmax."""
    return params.temperature < GREEDY_BELOW or params.top_k == 1


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, argmax: int | None = None
) -> int:
    """logits [V] float32, all finite -> token id (argmax: the row's argmax when already known). Safe
    for any finite logits: they are shifted so the largest is 0 before the division, so nothing
    overflows to +inf and softmax has a 1."""
    if greedy(params):
        return int(torch.argmax(logits)) if argmax is None else argmax
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


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (finite [R] bool: no NaN, +inf or -inf in the row; logsumexp [R]; argmax [R],
    the first maximum; max [R], the row's largest logit). One C++ pass on the CPU; else torch, where a
    row is checked element by element only when its sum is not finite (a NaN or an infinity always
    makes the sum non-finite; a finite row can too, by overflow)."""
    fused = small_ops.row_stats(logits)
    if fused is not None:
        row_max, argmax, lse, finite = fused
        return finite, lse, argmax, row_max
    finite = torch.isfinite(logits.sum(-1))
    if not bool(finite.all()):
        finite[~finite] = torch.isfinite(logits[~finite]).all(-1)
    argmax = torch.argmax(logits, -1)
    return finite, torch.logsumexp(logits, -1), argmax, logits.gather(1, argmax[:, None])[:, 0]


def sample_batch(
    logits: torch.Tensor,
    seqs: list,
    eos: set[int],
    stats: tuple | None = None,
) -> tuple[list[int], list[TokenLogprob]]:
    """logits [B, V] (the model's, row b for seqs[b]) -> (next token per sequence, its logprob entry).
    stats: row_stats(logits) when the caller has it.

    Logprobs are the model's log-softmax of `logits` as given, before penalties, grammar masks and
    temperature. Penalties/biases (logits_processors) and grammar masks (structured) are applied to
    the whole batch at once, then each row is sampled with its own parameters and generator.
    """
    _, lse, argmax, row_max = row_stats(logits) if stats is None else stats
    work = logits
    if any(s.params.penalized for s in seqs):
        work = logits.clone()
        apply_penalties(work, seqs, eos)
    if any(s.matcher is not None for s in seqs):
        work = work.clone() if work is logits else work
        apply_grammar(work, [s.matcher for s in seqs])
    known = argmax.tolist() if work is logits else [None] * len(seqs)  # the argmax of the rows sampled
    toks = [sample(work[b], s.params, s.generator, known[b]) for b, s in enumerate(seqs)]
    index = None
    if work is logits and all(greedy(s.params) for s in seqs):
        # every token its row's argmax: its logit is the row's max (the same doubles as the gather below,
        # without its torch calls, each slow on the caches the weights streamed through)
        chosen = [m - s for m, s in zip(row_max.tolist(), lse.tolist())]
    else:
        index = torch.tensor(toks, device=logits.device)[:, None]
        chosen = (logits.gather(1, index)[:, 0].double() - lse.double()).tolist()
    asked = [b for b, s in enumerate(seqs) if s.params.logprobs]
    alts: dict[int, list] = {}
    if asked:  # top logprobs: the full log-softmax of the rows that ask (their chosen entry from it too)
        if index is None:
            index = torch.tensor(toks, device=logits.device)[:, None]
        rows = torch.tensor(asked, device=logits.device)
        lp = torch.log_softmax(logits if len(asked) == len(seqs) else logits[rows], dim=-1)
        top = torch.topk(lp, max(seqs[b].params.logprobs for b in asked), dim=-1)
        mine = lp.gather(1, index[rows])[:, 0].tolist()
        for j, b in enumerate(asked):
            n = seqs[b].params.logprobs
            chosen[b] = mine[j]
            alts[b] = list(zip(top.indices[j, :n].tolist(), top.values[j, :n].tolist()))
    return toks, [(toks[b], chosen[b], alts.get(b, [])) for b in range(len(seqs))]


PROMPT_LOGPROB_ROWS = 64  # prompt positions whose log-softmax is computed at once


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """logits [n, V] at positions p..p+n-1, targets = the tokens at p+1..p+m (m <= n) ->
    one entry per target: its logprob under the model and the top-k alternatives."""
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), PROMPT_LOGPROB_ROWS):  # row blocks: temporaries [rows, V], not [n, V]
        block = targets[start : start + PROMPT_LOGPROB_ROWS]
        lp = torch.log_softmax(logits[start : start + len(block)].float(), dim=-1)
        t = torch.tensor(block, device=logits.device)
        chosen = lp.gather(1, t[:, None])[:, 0].tolist()
        if k:
            top = torch.topk(lp, k, dim=-1)
            idx, val = top.indices.tolist(), top.values.tolist()
            out += [(block[i], chosen[i], list(zip(idx[i], val[i]))) for i in range(len(block))]
        else:
            out += [(block[i], chosen[i], []) for i in range(len(block))]
    return out
