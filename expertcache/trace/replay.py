"""Replay a RoutingTrace through the engine's own SlotTable + policies.

Semantics (identical to the engine's cache calls):
- Each MoE layer has its own SlotTable with `capacity` slots and its own policy.
- Rows are grouped by `step` (the trace guarantees steps are non-decreasing).
  Policy time t = the step value.
- Per step, per layer l: if `prefetch`, first `table.insert(e, t)` for the
  distinct lookahead experts of layer l over the step's rows (predicted from
  layer l-1's hidden state, so issued before layer l runs; -1 entries skipped),
  most predicted first and at most `capacity` of them (experts.manager.most_predicted),
  on the steps the engine's PrefetchGate allows (`prefetch_gate=None` turns the gate off;
  `prefetch_waste` as the engine's: 1.0 on CPU, 0.25 with CUDA);
  then `table.access(e, t)` (pinning) for the distinct routed experts of the
  step's rows in order of first appearance; then `table.unpin_all()`.
- A "use" is one (step, layer, distinct expert) access; hit_rate = hits / uses.
- bytes_moved = (misses + prefetch_issued) * expert_bytes (without prefetch:
  misses * expert_bytes). A miss refused by `admit` still counts as moved bytes
  (the expert must reach the compute tier once).
- prefetch_issued: inserts that placed an expert (it was not resident and got a
  slot); prefetch_useful: issued prefetches used by the same step's access.
- min_hit_rate: the same schedule replayed with policy "min" (Belady with demand
  caching and the same pinning), without prefetch. Its NextUse oracle is built
  from the schedule itself, which is what makes MIN replay-only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..experts.policy import NextUse, make_policy
from ..experts.prefetch import PrefetchGate, most_predicted
from ..experts.slots import SlotTable
from .format import RoutingTrace

Schedule = list[list[tuple[int, list[int], list[int], int]]]  # per layer: (t, experts, lookahead, rows)


def _distinct(a: np.ndarray) -> list[int]:
    """Distinct values of a flat array in order of first appearance, dropping -1."""
    return [int(x) for x in dict.fromkeys(a.tolist()) if x >= 0]


def schedule(trace: RoutingTrace) -> Schedule:
    """Per layer, the list of (t, distinct experts, distinct lookahead experts, rows in step)."""
    step = trace.step
    cuts = np.flatnonzero(np.diff(step)) + 1
    bounds = np.concatenate([[0], cuts, [len(step)]]).astype(int)
    out: Schedule = [[] for _ in range(trace.num_layers)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        t = int(step[a])
        for li in range(trace.num_layers):
            ex = _distinct(trace.experts[a:b, li].ravel())
            la = most_predicted(trace.lookahead[a:b, li].ravel().tolist()) if trace.lookahead is not None else []
            out[li].append((t, ex, la, int(b - a)))
    return out


@dataclass
class ReplayResult:
    policy: str
    capacity: int
    prefetch: bool
    hits: int
    misses: int
    hit_rate: float
    bytes_moved: int
    expert_bytes: int
    steps: int
    rows: int
    pairs: int = 0  # (row, layer, expert) routings = rows * layers * top_k; pairs / uses = rows per use
    prefetch_issued: int = 0
    prefetch_useful: int = 0
    min_hit_rate: float | None = None
    per_layer: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _run_layer(sched, num_experts, capacity, policy, layer, prefetch, stats, params, gate_threshold, waste):
    oracle = NextUse(num_experts, ((t, ex) for t, ex, _, _ in sched)) if policy == "min" else None
    table = SlotTable(num_experts, capacity,
                      make_policy(policy, num_experts, capacity, layer=layer, stats=stats, oracle=oracle, **params))
    gate = PrefetchGate(1, gate_threshold, waste=waste)
    issued = useful = 0
    for t, ex, la, _ in sched:
        fetched, evicted = set(), set()
        if prefetch and la and gate.allow(0):
            for e in la[:capacity]:
                r = table.insert(e, t)
                if not r.hit and r.slot >= 0:
                    fetched.add(e)
                    evicted.add(r.evicted)
            issued += len(fetched)
        used = harm = 0
        for e in ex:
            harm += e in evicted and e not in table
            r = table.access(e, t)
            if r.hit and e in fetched:
                used += 1
        useful += used
        gate.update(0, len(fetched), used, harm)
        table.unpin_all()
    return table.hits, table.misses, issued, useful


def replay(trace: RoutingTrace, policy: str, capacity: int, prefetch: bool = False, stats=None,
           with_min: bool = True, sched: Schedule | None = None, prefetch_gate: float | None = 0.0,
           prefetch_waste: float = 1.0, **params) -> ReplayResult:
    """Replay `trace` with `policy` and `capacity` slots per layer (see module doc)."""
    if capacity < 1:
        raise ValueError(f"capacity: must be >= 1, got {capacity}")
    if prefetch and trace.lookahead is None:
        raise ValueError("prefetch: the trace has no lookahead array")
    sched = sched if sched is not None else schedule(trace)
    per_layer, tot = [], np.zeros(4, dtype=np.int64)
    for li, ls in enumerate(sched):
        h, m, iss, use = _run_layer(ls, trace.num_experts, capacity, policy, li, prefetch, stats, params,
                                    prefetch_gate, prefetch_waste)
        tot += (h, m, iss, use)
        per_layer.append({"layer": trace.layer_ids[li], "hits": h, "misses": m,
                          "hit_rate": h / max(h + m, 1), "prefetch_issued": iss, "prefetch_useful": use})
    hits, misses, issued, useful = (int(x) for x in tot)
    res = ReplayResult(policy=policy, capacity=capacity, prefetch=prefetch, hits=hits, misses=misses,
                       hit_rate=hits / max(hits + misses, 1),
                       bytes_moved=(misses + issued) * trace.expert_bytes, expert_bytes=trace.expert_bytes,
                       steps=len(sched[0]) if sched else 0, rows=len(trace),
                       pairs=int(trace.experts.size),
                       prefetch_issued=issued, prefetch_useful=useful, per_layer=per_layer)
    if with_min:
        if policy == "min" and not prefetch:
            res.min_hit_rate = res.hit_rate
        else:
            res.min_hit_rate = replay(trace, "min", capacity, with_min=False, sched=sched).hit_rate
    return res


def sweep(trace: RoutingTrace, policies, capacities, prefetch: bool = False, stats=None,
          **params) -> list[ReplayResult]:
    """replay() for every (policy, capacity); MIN is computed once per capacity."""
    sched = schedule(trace)
    out = []
    for cap in capacities:
        mn = replay(trace, "min", cap, with_min=False, sched=sched).hit_rate
        for p in policies:
            r = replay(trace, p, cap, prefetch=prefetch, stats=stats, with_min=False, sched=sched, **params)
            r.min_hit_rate = mn
            out.append(r)
    return out
