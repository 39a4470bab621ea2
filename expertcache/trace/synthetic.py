"""Seeded synthetic routing traces with tunable skew, locality and topic shifts.

Generative model, per sequence and layer:
- Popularity: expert at rank r (1-based) has weight r**(-zipf[l]); a random
  permutation per layer maps ranks to expert ids (zipf=0 is uniform).
- Topic shifts: every `shift_every` tokens (0 = never) the permutations are
  re-drawn, so the hot set moves.
- Locality: for token i > 0 of a sequence, each of the previous token's k
  experts is kept independently with probability `reuse`; the remaining slots
  are filled by sampling without replacement from the popularity weights,
  excluding experts already chosen. So the expected fraction of the previous
  token's experts reused is >= `reuse` (chance reuse adds a little).
- Rows: sequences back to back, one row per step (decode), step = row index.
  Weights: a normalised Dirichlet-like draw sorted descending (kept experts first).
- Lookahead (optional, `lookahead_recall` r): a predictor of layer l's experts from layer l-1
  (row l=0 is -1): each true expert is kept with probability r, the rest are drawn by
  popularity among the other experts. Trained routers measure r ~ 0.83 (tinymoe-py16,
  bench/trace_tinymoe.py). Drawn from its own random stream: the routing is unchanged by it.
"""

from __future__ import annotations

import numpy as np

from .format import RoutingTrace


def _draw(rng, p: np.ndarray, k: int, keep: list[int]) -> list[int]:
    """`keep` plus k-len(keep) experts drawn by weight p without replacement, excluding keep."""
    need = k - len(keep)
    if need <= 0:
        return keep[:k]
    q = p.copy()
    q[keep] = 0.0
    q /= q.sum()
    return keep + rng.choice(len(p), size=need, replace=False, p=q).tolist()


def _checked(layers, experts, top_k, zipf, reuse, lookahead_recall) -> np.ndarray:
    """The arguments checked (errors name them) -> the zipf skew of each layer."""
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k: must lie in [1, experts={experts}], got {top_k}")
    if not 0.0 <= reuse <= 1.0:
        raise ValueError(f"reuse: must lie in [0, 1], got {reuse}")
    if lookahead_recall is not None and not 0.0 <= lookahead_recall <= 1.0:
        raise ValueError(f"lookahead_recall: must lie in [0, 1], got {lookahead_recall}")
    if len(np.atleast_1d(zipf)) not in (1, layers):
        raise ValueError(f"zipf: one value or one per layer ({layers}), got {len(np.atleast_1d(zipf))}")
    return np.broadcast_to(np.asarray(zipf, dtype=float), (layers,))


def _lookahead(rng, true: list[int], pop: np.ndarray, recall: float) -> list[int]:
    """A lookahead guess of a layer's experts: each true one kept with probability `recall`, the rest
    drawn by popularity from the others."""
    kept = [e for e in true if rng.random() < recall]
    q = pop.copy()
    q[true] = 0.0
    others = rng.choice(len(pop), size=len(true) - len(kept), replace=False, p=q / q.sum())
    return kept + others.tolist()


def synth_trace(
    layers: int = 4,
    experts: int = 16,
    top_k: int = 2,
    tokens: int = 256,
    seqs: int = 1,
    zipf: float | list[float] = 1.0,
    reuse: float = 0.0,
    shift_every: int = 0,
    seed: int = 0,
    expert_bytes: int = 1 << 20,
    lookahead_recall: float | None = None,
) -> RoutingTrace:
    """Build a trace of `seqs` sequences x `tokens` tokens (see module doc)."""
    zipfs = _checked(layers, experts, top_k, zipf, reuse, lookahead_recall)
    rng = np.random.default_rng(seed)
    base = [np.arange(1, experts + 1, dtype=float) ** (-z) for z in zipfs]

    def popularity():
        out = []
        for b in base:
            p = np.empty(experts)
            p[rng.permutation(experts)] = b
            out.append(p / p.sum())
        return out

    n = seqs * tokens
    ex = np.empty((n, layers, top_k), np.int32)
    w = np.empty((n, layers, top_k), np.float32)
    la = None if lookahead_recall is None else np.full((n, layers, top_k), -1, np.int32)
    rng_la = np.random.default_rng([seed, 1])
    row = 0
    pop = popularity()
    for _ in range(seqs):
        for i in range(tokens):
            if shift_every and row and row % shift_every == 0:
                pop = popularity()
            for li in range(layers):
                keep = [] if i == 0 else [int(e) for e in ex[row - 1, li] if rng.random() < reuse]
                ex[row, li] = _draw(rng, pop[li], top_k, keep)
                g = np.sort(rng.gamma(1.0, size=top_k))[::-1]
                w[row, li] = g / g.sum()
                if la is not None and li:
                    la[row, li] = _lookahead(rng_la, ex[row, li].tolist(), pop[li], lookahead_recall)
            row += 1
    return RoutingTrace(
        experts=ex,
        num_experts=experts,
        weights=w,
        seq=np.repeat(np.arange(seqs), tokens),
        token=np.tile(np.arange(tokens), seqs),
        phase=np.ones(n, np.int8),
        step=np.arange(n),
        model="synthetic",
        expert_bytes=expert_bytes,
        lookahead=la,
    )
