"""Descriptive statistics of a RoutingTrace (and plots, matplotlib imported lazily).

- use_counts: [L, E] int matrix, counts[l, e] = number of rows routed to e in layer l.
  This is the `stats` matrix the "static" policy takes.
- reuse_fraction: over consecutive rows (i-1, i) of the same sequence (by token
  position, consecutive tokens only), the mean over (row, layer) of
  |experts(i) & experts(i-1)| / top_k.
- reuse_distance_hist: per layer, for each use of expert e at step t, the number
  of DISTINCT other experts used in that layer strictly between e's previous use
  step and t (classic LRU stack distance; a cache of capacity c under LRU without
  pinning hits exactly the uses with distance < c). First uses are counted in
  the last bin "cold". Returns {distance: count} summed over layers.
- skew: per layer, the share of uses taken by the top `frac` of experts.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .format import RoutingTrace


def use_counts(trace: RoutingTrace) -> np.ndarray:
    n, nl, k = trace.experts.shape
    out = np.zeros((nl, trace.num_experts), np.int64)
    layer_idx = np.broadcast_to(np.arange(nl)[None, :, None], trace.experts.shape)
    np.add.at(out, (layer_idx.ravel(), trace.experts.ravel()), 1)
    return out


def reuse_fraction(trace: RoutingTrace) -> float:
    e = trace.experts
    ok = (trace.seq[1:] == trace.seq[:-1]) & (trace.token[1:] == trace.token[:-1] + 1)
    if not ok.any():
        return 0.0
    cur, prev = e[1:][ok], e[:-1][ok]
    shared = (cur[..., :, None] == prev[..., None, :]).any(-1).sum(-1)
    return float(shared.mean() / trace.top_k)


def top_share(trace: RoutingTrace, frac: float = 0.25) -> np.ndarray:
    """Per layer, fraction of uses that go to the ceil(frac*E) most used experts."""
    c = np.sort(use_counts(trace), axis=1)[:, ::-1]
    m = max(1, int(np.ceil(frac * trace.num_experts)))
    return c[:, :m].sum(1) / np.maximum(c.sum(1), 1)


def reuse_distance_hist(trace: RoutingTrace) -> dict:
    from .replay import schedule

    hist: Counter = Counter()
    for layer in schedule(trace):
        stack: list[int] = []  # most recent first
        for ex in (st.experts for st in layer):
            for e in ex:
                if e in stack:
                    d = stack.index(e)
                    hist[d] += 1
                    stack.pop(d)
                else:
                    hist["cold"] += 1
            stack[:0] = ex  # the step's experts were popped above, so no duplicates
    cold = hist.pop("cold", 0)
    return {**dict(sorted(hist.items())), "cold": cold}


def summary(trace: RoutingTrace) -> dict:
    return {
        "rows": len(trace),
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "top_k": trace.top_k,
        "reuse_fraction": reuse_fraction(trace),
        "chance_reuse": trace.top_k / trace.num_experts,
        "top25_share": top_share(trace).round(4).tolist(),
        "reuse_distance": reuse_distance_hist(trace),
    }


def plot_heatmap(trace: RoutingTrace, path: str, title: str | None = None) -> None:
    """Layer x expert use counts (routed token-expert pairs), colour bar labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = use_counts(trace)
    fig, ax = plt.subplots(figsize=(max(5, c.shape[1] * 0.3), max(2.8, c.shape[0] * 0.35 + 1.2)))
    im = ax.imshow(c, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel(f"expert (0..{trace.num_experts - 1})")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(c.shape[0]), [str(x) for x in trace.layer_ids])
    ax.set_title(title or f"expert use: {trace.model or 'trace'}, top-{trace.top_k}, {len(trace)} tokens")
    bar = fig.colorbar(im, ax=ax)
    bar.set_label("routed (token, expert) pairs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# distinct line styles, so a policy whose curve equals another's still shows
_STYLES = [("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ("-", "v"), ("--", "P"), ("-.", "X"), (":", "*")]


def _above_min_note(above: list[str]) -> str:
    return (
        f"{', '.join(above)} above MIN: MIN is the optimum of demand caching (every miss "
        f"loaded into a slot,\nno prefetch); admission (refused experts used once from the slower tier) "
        f"or prefetch can beat it"
    )


def plot_sweep(results, path: str, title: str | None = None) -> None:
    """Hit rate vs capacity per policy, with MIN (from each result's min_hit_rate) as the reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by: dict[str, list] = {}
    mins: dict[int, float] = {}
    for r in results:
        by.setdefault(r.policy, []).append((r.capacity, r.hit_rate))
        if r.min_hit_rate is not None:
            mins[r.capacity] = r.min_hit_rate
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    if mins:
        ax.plot(
            *zip(*sorted(mins.items())),
            color="black",
            linewidth=3,
            alpha=0.35,
            label="MIN (reference)",
            zorder=1,
        )
    above = []
    for k, (p, pts) in enumerate(by.items()):
        pts.sort()
        ls, mk = _STYLES[k % len(_STYLES)]
        ax.plot(
            *zip(*pts),
            linestyle=ls,
            marker=mk,
            markersize=5,
            markerfacecolor="none",
            linewidth=1.4,
            label=p,
            zorder=2 + k,
        )
        if any(h > mins.get(c, 1.0) + 1e-9 for c, h in pts):
            above.append(p)
    if above:
        ax.text(
            0.02,
            0.02,
            _above_min_note(above),
            transform=ax.transAxes,
            fontsize=7,
            va="bottom",
            color="dimgray",
        )
    ax.set_xlabel("slots per layer")
    ax.set_ylabel("hit rate (uses found in the fastest tier)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title or "hit rate vs slots per layer", fontsize=10)
    ax.legend(fontsize=8, loc="lower right" if not above else "center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
