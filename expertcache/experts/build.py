"""Choose and build the expert provider from the user's budgets; returns the memory plan lines."""

from __future__ import annotations

import torch

from .config import CacheConfig
from .layout import ExpertSource
from .manager import TieredExperts, is_direct
from .prefetch import resolve_prefetch
from .provider import ResidentExperts
from .stats import load_stats as load_stats_file

PREFETCH_SAYS = {
    "device": "next layer's predicted experts into the fastest tier",
    "host": "next layer's predicted experts read ahead from disk into host RAM",
    "off": "off",
}


def build_expert_cache(
    source: ExpertSource,
    device: torch.device,
    dtype: torch.dtype,
    cfg: CacheConfig,
    plan,
    *,
    progress=None,
    on_plan=None,
    alloc=None,
    load: bool = True,
):
    """-> (provider, plan lines). `cfg` is validated already; `plan`: the tiers of the engine's device
    plan (build/plan.py MemoryPlan); `on_plan(lines)` is called before any
    expert is loaded; `alloc(shape, dtype)`: how resident pools are allocated; `load` False: a resident
    provider is returned allocated, not read (its `load()` reads it)."""
    lines = list(plan.lines)
    if plan.resident:  # every expert fits in the fastest tier: load once, no per-step bookkeeping
        moot = cfg.cache_only_options()
        if moot:
            lines.append(
                f"note: every expert is resident, so {', '.join(moot)} "
                f"{'has' if len(moot) == 1 else 'have'} nothing to act on"
            )
        if on_plan:
            on_plan(lines)
        return ResidentExperts(
            source, device, dtype, progress, parts=plan.dev_parts, alloc=alloc, load=load
        ), lines
    E = source.cfg.num_experts
    stats = load_stats_file(cfg.load_stats, source.layers, E) if cfg.load_stats else None
    host_slots = None if plan.host.slots >= E else plan.host.slots
    mode = resolve_prefetch(
        cfg.prefetch,
        device,
        is_direct(device, plan.dev_parts, source.parts),
        host_slots is not None and host_slots > 0,
    )
    lines.append(f"prefetch: {PREFETCH_SAYS[mode]}; policy: {cfg.policy_name}")
    cost = None
    if device.type == "cuda" and cfg.cpu_compute == "auto":  # the per-miss choice prices each miss
        from ..cost.measure import resolve_profile
        from ..cost.model import ExpertCost

        prof, how = resolve_profile(cfg.cost_profile, "cuda", source.index.model_dir)
        cost = ExpertCost(
            prof, source.expert_nbytes, 3 * source.cfg.hidden_size * source.cfg.moe_intermediate_size
        )
        lines.append(f"cost model: profile {prof.name} ({how})")
    if on_plan:
        on_plan(lines)
    cache = TieredExperts(
        source,
        device,
        dtype,
        plan.device.slots,
        host_slots,
        cfg,
        dev_parts=plan.dev_parts,
        stats=stats,
        progress=progress,
        cost=cost,
    )
    return cache, lines
