"""Predicted decode tok/s for a memory plan: replay a routing trace at the plan's capacity, then
run the cost model (trace.simulate) on a hardware profile.

Band = [LRU without prefetch, best of `policy` with and without prefetch]. Without a
trace, two synthetic traces stand in (SYNTH_LOW for the low end, SYNTH_HIGH for the
high end; the assumption is printed). Only decode rows are costed: rows up to the
trace's last prefill row are replayed to warm the cache and then subtracted, so the
counters are exactly those of the decode steps that follow.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..cost.profiles import Profile
from ..trace.format import RoutingTrace
from ..trace.replay import ReplayResult, replay
from ..trace.simulate import ModelShape, Prediction, simulate, simulate_schedule
from ..trace.synthetic import synth_trace

SYNTH_TOKENS = 256
SYNTH_LOW = {"zipf": 1.0, "reuse": 0.4}
SYNTH_HIGH = {"zipf": 1.2, "reuse": 0.4}


@dataclass
class Estimate:
    """One replay + simulate: which policy, whether prefetch ran, the decode hit rate and tok/s."""

    policy: str
    prefetch: bool
    hit_rate: float
    tok_s: float
    prediction: Prediction


@dataclass
class SpeedBand:
    low: Estimate
    high: Estimate
    source: str  # "trace FILE (N decode rows)" or the synthetic assumption
    from_disk: bool

    @property
    def band(self) -> tuple[float, float]:
        return tuple(sorted((self.low.tok_s, self.high.tok_s)))


def check_trace(trace: RoutingTrace, layer_ids: list[int], num_experts: int, top_k: int) -> None:
    """ValueError unless `trace` was recorded on a model with this routing shape."""
    trace.validate(num_layers=len(layer_ids))
    if trace.num_experts != num_experts:
        raise ValueError(
            f"trace: recorded with {trace.num_experts} experts per layer, model has {num_experts}"
        )
    if len(trace) and int(trace.experts.max()) >= num_experts:
        raise ValueError(
            f"trace: expert id {int(trace.experts.max())} out of range for {num_experts} experts"
        )
    if trace.top_k != top_k:
        raise ValueError(f"trace: top_k={trace.top_k}, model has top_k={top_k}")
    if list(trace.layer_ids) != list(layer_ids):
        raise ValueError(
            f"trace: MoE layer ids {trace.layer_ids[:8]}... differ from the model's {layer_ids[:8]}..."
        )


def _rows(trace: RoutingTrace, stop: int) -> RoutingTrace:
    """The first `stop` rows of a trace."""
    arrays = {
        k: getattr(trace, k)[:stop]
        for k in ("experts", "seq", "token", "phase", "step", "weights", "lookahead")
        if getattr(trace, k) is not None
    }
    return RoutingTrace(
        num_experts=trace.num_experts,
        model=trace.model,
        layer_ids=trace.layer_ids,
        expert_bytes=trace.expert_bytes,
        **arrays,
    )


def decode_replay(trace: RoutingTrace, policy: str, capacity: int, prefetch: bool) -> ReplayResult:
    """Counters of the decode rows after the last prefill row, with the cache warmed by what precedes them."""
    prefill = np.flatnonzero(trace.phase == 0)
    cut = int(prefill[-1]) + 1 if len(prefill) else 0
    if cut >= len(trace):
        raise ValueError("trace: no decode rows after the last prefill row")
    full = replay(trace, policy, capacity, prefetch=prefetch, with_min=False)
    if cut == 0:
        return full
    warm = replay(_rows(trace, cut), policy, capacity, prefetch=prefetch, with_min=False)
    d = {
        k: getattr(full, k) - getattr(warm, k)
        for k in ("hits", "misses", "steps", "rows", "pairs", "prefetch_issued", "prefetch_useful")
    }
    d["hit_rate"] = d["hits"] / max(d["hits"] + d["misses"], 1)
    d["bytes_moved"] = full.bytes_moved - warm.bytes_moved
    return replace(full, per_layer=[], **d)


def estimate(
    trace: RoutingTrace,
    policy: str,
    capacity: int,
    prefetch: bool,
    shape: ModelShape,
    profile: Profile,
    expert_bytes: int,
    resident: bool,
    from_disk: bool,
) -> Estimate:
    """Replay then simulate; a resident plan has no misses (experts are loaded before the first token)."""
    num_experts = trace.num_experts
    r = decode_replay(trace, policy, min(capacity, num_experts), prefetch)
    if resident:
        r = replace(r, hits=r.hits + r.misses, misses=0, prefetch_issued=0, hit_rate=1.0)
    r = replace(r, expert_bytes=expert_bytes)
    p = simulate(r, shape, profile, cpu_compute=True, from_disk=from_disk)
    return Estimate(policy, prefetch, r.hit_rate, p.tok_s, p)


def speed_band(
    shape: ModelShape,
    profile: Profile,
    capacity: int,
    expert_bytes: int,
    resident: bool,
    from_disk: bool,
    layer_ids: list[int],
    num_experts: int,
    top_k: int,
    policy: str = "adaptive",
    trace: RoutingTrace | None = None,
    trace_name: str = "",
) -> SpeedBand:
    """Predicted decode tok/s band for `capacity` device slots per layer (see module doc)."""
    args = dict(
        shape=shape, profile=profile, expert_bytes=expert_bytes, resident=resident, from_disk=from_disk
    )
    if trace is not None:
        check_trace(trace, layer_ids, num_experts, top_k)
        lo_trace = hi_trace = trace
        rows = int((trace.phase == 1).sum())
        source = f"trace {trace_name or trace.model} ({rows} decode rows)"
    else:
        synth = dict(layers=len(layer_ids), experts=num_experts, top_k=top_k, tokens=SYNTH_TOKENS, seed=0)
        lo_trace, hi_trace = synth_trace(**synth, **SYNTH_LOW), synth_trace(**synth, **SYNTH_HIGH)
        for t in (lo_trace, hi_trace):
            t.layer_ids = list(layer_ids)
        source = (
            f"synthetic routing, {SYNTH_TOKENS} decode tokens: zipf {SYNTH_LOW['zipf']} (low end) to "
            f"{SYNTH_HIGH['zipf']} (high end) popularity skew, token-to-token reuse "
            f"{SYNTH_LOW['reuse']}, no prefetch (no lookahead)"
        )
    low = estimate(lo_trace, "lru", capacity, False, **args)
    options = [estimate(hi_trace, policy, capacity, False, **args)]
    if hi_trace.lookahead is not None:
        options.append(estimate(hi_trace, policy, capacity, True, **args))
    high = max(options, key=lambda e: e.tok_s)
    return SpeedBand(low, high, source, from_disk)


def schedule_estimates(
    shape: ModelShape,
    profile: Profile,
    capacity: int,
    layer_ids: list[int],
    num_experts: int,
    top_k: int,
    hidden: int,
    policy: str = "adaptive",
    trace: RoutingTrace | None = None,
) -> dict[tuple[bool, bool], float]:
    """Decode tok/s from the schedule model (trace.simulate.simulate_schedule: copies, device MoE,
    the CPU job and prefetch overlapping as the executor runs them) for (CPU compute of misses,
    prefetch) in each combination; the trace, or SYNTH_HIGH's synthetic routing without one."""
    if trace is None:
        trace = synth_trace(
            layers=len(layer_ids), experts=num_experts, top_k=top_k, tokens=SYNTH_TOKENS, seed=0, **SYNTH_HIGH
        )
        trace.layer_ids = list(layer_ids)
    else:
        check_trace(trace, layer_ids, num_experts, top_k)
    return {
        (cpu, pf): simulate_schedule(
            trace, shape, profile, policy, capacity, hidden, cpu_compute=cpu, prefetch=pf
        ).tok_s
        for cpu in (True, False)
        for pf in (True, False)
    }
