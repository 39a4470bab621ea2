"""Choose and build the expert provider from the user's budgets; returns the memory plan lines."""

from __future__ import annotations

import torch

from ..units import fmt_bytes
from .budget import available_ram, auto_device_bytes, plan_tier
from .layout import ExpertSource
from .manager import TieredExperts
from .provider import ResidentExperts
from .policy import DEFAULT_POLICY
from .stats import load_stats as load_stats_file


def build_expert_cache(source: ExpertSource, device: torch.device, dtype: torch.dtype, *,
                       device_memory=None, host_memory=None, cache_policy: str | None = None,
                       prefetch: bool | None = None, cpu_compute: str | None = None, load_stats: str | None = None,
                       dense_bytes: int = 0, progress=None, on_plan=None, **options):
    """-> (provider, plan lines). `on_plan(lines)` is called before any expert is loaded."""
    cfg = source.cfg
    L, E, K = len(source.layers), cfg.num_experts, cfg.top_k
    dev_bytes = sum(p.nbytes for p in source.compute_parts(dtype))  # the fastest tier's format
    host_bytes = source.expert_nbytes  # stored format
    lines = [f"experts: {L} layers x {E} experts x {fmt_bytes(host_bytes)} = {fmt_bytes(source.total_nbytes)} "
             f"on disk ({source.dtype}); compute format {fmt_bytes(dev_bytes)}/expert ({dtype})"]
    auto_dev, why = auto_device_bytes(device, dense_bytes)
    staging = dev_bytes if device.type == "cuda" else 0  # one slot for experts streamed in waves
    dplan = plan_tier(device_memory if device_memory is not None else "auto", "device_memory", dev_bytes, L, E, K,
                      auto_dev, reserve=staging)
    if device_memory in (None, "auto"):
        lines.append(why)
    if dplan.slots >= E and not load_stats:
        lines.append(dplan.describe("device", L, E) + ": every expert resident, loaded once")
        if on_plan:
            on_plan(lines)
        return ResidentExperts(source, device, dtype, progress), lines
    lines.append(dplan.describe("device", L, E) + (f" + staging {fmt_bytes(staging)}" if staging else ""))
    ram = available_ram() // 2
    hplan = plan_tier(host_memory if host_memory is not None else "auto", "host_memory", host_bytes, L, E, K, ram)
    host_slots = None if hplan.slots >= E else hplan.slots
    if host_memory in (None, "auto"):
        lines.append(f"auto host budget = half of available RAM = {fmt_bytes(ram)}")
    lines.append(hplan.describe("host", L, E) + (": every expert in RAM" if host_slots is None else
                                                  "; the rest streamed from disk"))
    lines.append(f"disk: {fmt_bytes(source.total_nbytes)} in {source.index.model_dir}")
    stats = load_stats_file(load_stats, source.layers, E) if load_stats else None
    if prefetch is None:
        # Prefetch hides a transfer behind compute. On a CPU-only machine the "transfer" into the
        # fastest tier is a conversion that needs the same cores and memory bandwidth as compute,
        # and measured slower than demand loads (README, cache benchmark): auto = CUDA only.
        prefetch = device.type == "cuda"
    lines.append(f"prefetch: {'on' if prefetch else 'off'}; policy: {cache_policy or DEFAULT_POLICY}")
    if on_plan:
        on_plan(lines)
    cache = TieredExperts(source, device, dtype, dplan.slots, host_slots, policy=cache_policy or DEFAULT_POLICY,
                          prefetch=prefetch, cpu_compute=cpu_compute or "auto", stats=stats,
                          progress=progress, **options)
    return cache, lines
