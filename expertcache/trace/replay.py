"""Replay a RoutingTrace through the engine's own step planner (experts.planner).

The planner is the one place cache decisions are made, so a replay is the engine with the same
options: per MoE layer a device SlotTable of `capacity` slots and its policy, a host tier
(`host_slots`: None = every expert in RAM, 0 = none, else a partial tier read from disk),
prefill admission (`prefill_admit_tokens`), CPU-computed misses (`cpu_compute`), exclusive tiers
(`exclusive`), prefetch ("device" / "host" / "off", or a bool: True = "device") behind the
engine's PrefetchGate (`prefetch_gate=None` turns it off; `prefetch_waste` as the engine's: 1.0
on CPU, 0.25 with CUDA). `replay_config` takes the engine's PlannerConfig itself.

Semantics:
- Rows are grouped by `step` (the trace guarantees steps are non-decreasing); policy time t =
  the step value. Per step and layer: first the prefetch of the layer's lookahead experts
  (predicted from layer l-1's hidden state, so planned before layer l runs; -1 skipped), then
  the layer's step: its distinct routed experts in order of first appearance, with token counts.
- A "use" is one (step, layer, distinct expert); hit_rate = hits / uses (device tier).
- bytes_moved = bytes into the fastest tier + bytes read from disk (as the engine's
  expert_stats); with the defaults (every expert in RAM, `staged_waves`: an off-slot miss is
  copied once, as on CUDA) that is (misses + prefetch_issued) * expert_bytes.
- min_hit_rate: the same schedule and options with policy "min" (Belady with demand caching
  and the same pinning), without prefetch. Its NextUse oracle is built from the schedule
  itself, which is what makes MIN replay-only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable, NamedTuple

import numpy as np

from ..experts.planner import PlannerConfig, StepPlanner
from ..experts.policy import NextUse
from ..experts.stats import LayerCounters
from .format import RoutingTrace


class Step(NamedTuple):
    """One step of one layer: what the engine's forward and prefetch calls receive."""

    t: int
    experts: list[int]  # distinct, in order of first appearance
    lookahead: list[int]  # the rows' predicted experts, flat (-1 = none)
    rows: int
    tokens: list[int]  # rows routed to experts[j]


Schedule = list[list[Step]]  # per layer


def _distinct(a: np.ndarray) -> list[int]:
    """Distinct values of a flat array in order of first appearance, dropping -1."""
    return [int(x) for x in dict.fromkeys(a.tolist()) if x >= 0]


def schedule(trace: RoutingTrace) -> Schedule:
    """Per layer, the list of its Steps."""
    step = trace.step
    cuts = np.flatnonzero(np.diff(step)) + 1
    bounds = np.concatenate([[0], cuts, [len(step)]]).astype(int)
    out: Schedule = [[] for _ in range(trace.num_layers)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        t = int(step[a])
        for li in range(trace.num_layers):
            flat = trace.experts[a:b, li].ravel()
            ex = _distinct(flat)
            n = np.bincount(flat[flat >= 0], minlength=trace.num_experts)
            la = trace.lookahead[a:b, li].ravel().tolist() if trace.lookahead is not None else []
            out[li].append(Step(t, ex, la, int(b - a), [int(n[e]) for e in ex]))
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
    per_layer: list[dict] = field(default_factory=list)  # {"layer", "hit_rate", every LayerCounters field}
    totals: dict = field(default_factory=dict)  # every LayerCounters field summed over layers

    def to_dict(self) -> dict:
        return asdict(self)


def replay_config(
    trace: RoutingTrace,
    cfg: PlannerConfig,
    stats=None,
    cpu_faster: Callable[[int], bool] | None = None,
    sched: Schedule | None = None,
    policy_params: dict | None = None,
) -> ReplayResult:
    """Replay `trace` through a StepPlanner built from `cfg` (the engine's own, or replay()'s)."""
    sched = sched if sched is not None else schedule(trace)
    oracles = (
        [NextUse(cfg.num_experts, ((st.t, st.experts) for st in ls)) for ls in sched]
        if cfg.policy == "min"
        else None
    )
    planner = StepPlanner(
        cfg, trace.num_layers, stats, cpu_faster=cpu_faster, oracles=oracles, **(policy_params or {})
    )
    for i, ls in enumerate(sched):
        for st in ls:
            planner.plan_prefetch(i, st.lookahead, st.rows, st.t)
            planner.end_step(i, planner.plan_step(i, st.experts, st.tokens, st.rows, st.t))
    per_layer, tot = [], LayerCounters()
    for layer, state in zip(trace.layer_ids or range(trace.num_layers), planner.layers):
        c = asdict(state.counters)
        per_layer.append({"layer": layer, "hit_rate": c["hits"] / max(c["hits"] + c["misses"], 1), **c})
        for k, v in c.items():
            setattr(tot, k, getattr(tot, k) + v)
    return ReplayResult(
        policy=cfg.policy,
        capacity=cfg.device_slots,
        prefetch=cfg.prefetch != "off",
        hits=tot.hits,
        misses=tot.misses,
        hit_rate=tot.hits / max(tot.hits + tot.misses, 1),
        bytes_moved=tot.bytes_moved + tot.disk_bytes,
        expert_bytes=trace.expert_bytes,
        steps=len(sched[0]) if sched else 0,
        rows=len(trace),
        pairs=int(trace.experts.size),
        prefetch_issued=tot.prefetch_issued + tot.host_prefetch_issued,
        prefetch_useful=tot.prefetch_useful + tot.host_prefetch_useful,
        per_layer=per_layer,
        totals=asdict(tot),
    )


def replay(
    trace: RoutingTrace,
    policy: str,
    capacity: int,
    prefetch: bool | str = False,
    stats=None,
    with_min: bool = True,
    sched: Schedule | None = None,
    prefetch_gate: float | None = 0.0,
    prefetch_waste: float = 1.0,
    host_slots: int | None = None,
    cpu_compute: str = "never",
    cpu_faster: Callable[[int], bool] | None = None,
    prefill_admit_tokens: int = 64,
    exclusive: bool = False,
    direct: bool = False,
    staged_waves: bool = True,
    policy_params: dict | None = None,
) -> ReplayResult:
    """Replay `trace` with `policy` and `capacity` device slots per layer (see module doc)."""
    if capacity < 1:
        raise ValueError(f"capacity: must be >= 1, got {capacity}")
    mode = {True: "device", False: "off"}.get(prefetch, prefetch)
    if mode not in ("device", "host", "off"):
        raise ValueError(f"prefetch: must be device, host, off or a bool, got {prefetch!r}")
    if mode != "off" and trace.lookahead is None:
        raise ValueError("prefetch: the trace has no lookahead array")
    if mode == "host" and not host_slots:
        raise ValueError("prefetch='host': needs a partial host tier (host_slots > 0)")
    sched = sched if sched is not None else schedule(trace)
    cfg = PlannerConfig(
        num_experts=trace.num_experts,
        device_slots=capacity,
        host_slots=host_slots,
        expert_bytes=trace.expert_bytes,
        policy=policy,
        cpu_compute=cpu_compute,
        prefetch=mode,
        prefill_admit_tokens=prefill_admit_tokens,
        exclusive=exclusive,
        direct=direct,
        staged_waves=staged_waves,
        gate_threshold=prefetch_gate,
        gate_waste=prefetch_waste,
    )
    res = replay_config(trace, cfg, stats, cpu_faster, sched, policy_params)
    if with_min:
        if policy == "min" and mode == "off":
            res.min_hit_rate = res.hit_rate
        else:
            res.min_hit_rate = replay_config(
                trace, replace(cfg, policy="min", prefetch="off"), None, cpu_faster, sched
            ).hit_rate
    return res


def sweep(
    trace: RoutingTrace, policies, capacities, prefetch: bool | str = False, stats=None, **options
) -> list[ReplayResult]:
    """replay() for every (policy, capacity); MIN is computed once per capacity."""
    sched = schedule(trace)
    out = []
    for cap in capacities:
        mn = replay(
            trace,
            "min",
            cap,
            with_min=False,
            sched=sched,
            **{
                k: v
                for k, v in options.items()
                if k not in ("prefetch_gate", "prefetch_waste", "policy_params")
            },
        ).hit_rate
        for p in policies:
            r = replay(trace, p, cap, prefetch=prefetch, stats=stats, with_min=False, sched=sched, **options)
            r.min_hit_rate = mn
            out.append(r)
    return out
