"""Choose and build the expert provider from the user's budgets; returns the memory plan lines."""

from __future__ import annotations

import torch

from .budget import plan_memory
from .layout import ExpertSource
from .manager import TieredExperts, is_direct
from .policy import DEFAULT_POLICY
from .prefetch import resolve_prefetch
from .provider import ResidentExperts
from .stats import load_stats as load_stats_file

PREFETCH_SAYS = {"device": "next layer's predicted experts into the fastest tier",
                 "host": "next layer's predicted experts read ahead from disk into host RAM", "off": "off"}


def build_expert_cache(source: ExpertSource, device: torch.device, dtype: torch.dtype, *,
                       device_memory=None, host_memory=None, cache_policy: str | None = None,
                       prefetch: bool | str | None = None, cpu_compute: str | None = None, load_stats: str | None = None,
                       dense_bytes: int = 0, kv_bytes: int = 0, progress=None, on_plan=None, low_memory: bool = False,
                       **options):
    """-> (provider, plan lines). `on_plan(lines)` is called before any expert is loaded."""
    plan = plan_memory(source, device, dtype, device_memory, host_memory, dense_bytes, low_memory, kv_bytes)
    lines = list(plan.lines)
    if plan.resident:  # every expert fits in the fastest tier: load once, no per-step bookkeeping
        if on_plan:
            on_plan(lines)
        return ResidentExperts(source, device, dtype, progress, parts=plan.dev_parts), lines
    E = source.cfg.num_experts
    stats = load_stats_file(load_stats, source.layers, E) if load_stats else None
    host_slots = None if plan.host.slots >= E else plan.host.slots
    mode = resolve_prefetch(prefetch, device, is_direct(device, plan.dev_parts, source.parts),
                            host_slots is not None and host_slots > 0)
    policy = cache_policy or DEFAULT_POLICY
    lines.append(f"prefetch: {PREFETCH_SAYS[mode]}; policy: {policy}")
    if on_plan:
        on_plan(lines)
    cache = TieredExperts(source, device, dtype, plan.device.slots, host_slots, dev_parts=plan.dev_parts,
                          policy=policy, prefetch=mode, cpu_compute=cpu_compute or "auto", stats=stats,
                          progress=progress, **options)
    return cache, lines
