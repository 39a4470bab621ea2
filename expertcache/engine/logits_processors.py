"""Penalties, biases and min_tokens over a batch of logits, as whole-batch tensor operations.

Definitions (SamplingParams documents them): c[b, t] = count of token t among sequence b's
generated tokens; repetition applies to every token of prompt + generated (transformers'
RepetitionPenaltyLogitsProcessor); frequency/presence follow OpenAI; logit_bias adds; min_tokens
sets EOS and stop_token_ids to -inf. Rows whose parameters are neutral are left untouched.

Shapes: logits [B, V] (modified in place); B = len(seqs).
"""

from __future__ import annotations

import torch

from .sequence import Sequence


def _padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> (ids [B, L] padded with 0, valid [B, L] bool)."""
    width = max((len(r) for r in rows), default=0) or 1
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            ids[b, : len(r)] = torch.tensor(r)
            valid[b, : len(r)] = True
    return ids.to(device), valid.to(device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], eos: set[int]) -> None:
    """Apply every sequence's penalties, biases and min_tokens to its row of `logits`, in place."""
    if not any(s.params.penalized for s in seqs):
        return
    B, V = logits.shape
    dev, dt = logits.device, logits.dtype
    p = [s.params for s in seqs]

    rep = torch.tensor([x.repetition_penalty for x in p], dtype=dt, device=dev)
    if bool((rep != 1).any()):
        ids, valid = _padded([s.tokens if x.repetition_penalty != 1 else [] for s, x in zip(seqs, p)], dev)
        seen = (
            torch.zeros(B, V, dtype=torch.int32, device=dev).scatter_add_(1, ids, valid.to(torch.int32)) > 0
        )
        r = rep[:, None]
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))

    freq = torch.tensor([x.frequency_penalty for x in p], dtype=dt, device=dev)
    pres = torch.tensor([x.presence_penalty for x in p], dtype=dt, device=dev)
    if bool((freq != 0).any() or (pres != 0).any()):
        ids, valid = _padded(
            [s.generated if (x.frequency_penalty or x.presence_penalty) else [] for s, x in zip(seqs, p)], dev
        )
        counts = torch.zeros(B, V, dtype=dt, device=dev).scatter_add_(1, ids, valid.to(dt))
        logits -= freq[:, None] * counts + pres[:, None] * (counts > 0).to(dt)

    rows, cols, vals = [], [], []
    for b, x in enumerate(p):
        for t, v in x.logit_bias.items():
            if 0 <= t < V:
                rows.append(b)
                cols.append(t)
                vals.append(v)
        if x.min_tokens and len(seqs[b].generated) < x.min_tokens:
            banned = set(x.stop_token_ids) | (set() if x.ignore_eos else eos)
            for t in banned:
                if 0 <= t < V:
                    rows.append(b)
                    cols.append(t)
                    vals.append(float("-inf"))
    if rows:
        idx = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
        logits.index_put_(idx, torch.tensor(vals, dtype=dt, device=dev), accumulate=True)
