"""Allocate: every persistent tensor on the device through the Ledger, in one order for every provider
kind: the KV cache and the linear-attention state, then (after fill.py's dense weights) the expert
slots and staging.

Expert providers by kind (`expert_provider`):
- resident: every expert in stacked pools [E, ...] per layer (ResidentExperts, allocated empty);
- tiered (a budget, or low memory): TieredExperts with the plan's slots (experts/build.py);
- expert parallel: this rank's share of the experts (LocalExperts, allocated empty), or its own tiers,
  behind ExpertParallelExperts; the peer tier's receive buffers (a tiered cache) allocated last.
fill.fill_experts reads the experts into what was allocated here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.kv_cache import KVCache
from ..engine.state_cache import StateCache
from ..experts.provider import ExpertProvider, ResidentExperts
from ..units import fmt_bytes
from .ledger import Ledger
from .plan import DevicePlan


@dataclass
class Memory:
    """The device plan, the ledger that counted its allocations, and the lines printed about them."""

    plan: DevicePlan
    ledger: Ledger
    lines: list[str] = field(default_factory=list)  # everything (printed with verbose)
    loaded_lines: list[str] = field(default_factory=list)  # the lines known only after the load
    # expert parallelism: (on, line) of parallel/peer.py decide_for, made before the plan (None without)
    peer: tuple[bool, str | None] | None = None


def kv_and_state(ck, config, plan: DevicePlan, ledger: Ledger) -> tuple[KVCache, StateCache | None]:
    cfg, dtype, device = ck.cfg, config.load.torch_dtype, config.load.torch_device

    def zeros(what):
        return lambda shape, dt: ledger.alloc(shape, dt, what, zero=True)

    kv = KVCache(
        len(cfg.attention_layer_ids),
        plan.kv.num_blocks,
        config.scheduler.block_size,
        cfg.kv_token_shapes,
        dtype,
        device,
        ck.prefix_caching,
        alloc=zeros("kv_cache"),
    )
    states = (
        StateCache(cfg, plan.kv.state_slots, dtype, device, alloc=zeros("linear_state"))
        if plan.kv.state_slots
        else None
    )
    return kv, states


def expert_provider(
    ck, config, plan: DevicePlan, ledger: Ledger, lines: list[str], show, progress, placement=None, group=None
) -> ExpertProvider:
    """This rank's expert provider, its slots and staging allocated (the tiered cache also reads its
    host tier as it is made; fill.fill_experts reads the rest)."""
    source, device, dtype, cache = ck.source, config.load.torch_device, config.load.torch_dtype, config.cache

    def alloc(shape, dt):
        return ledger.alloc(shape, dt, "expert_slots")

    if placement is not None and not cache.tiered:
        from ..parallel.local import LocalExperts

        show(lines)
        return LocalExperts(
            source, device, dtype, placement.owned(group.rank), progress, alloc=alloc, load=False
        )
    if plan.experts is None:
        lines += [
            (
                f"experts: {len(source.layers)} layers x {ck.cfg.num_experts} x {fmt_bytes(source.expert_nbytes)} "
                f"= {fmt_bytes(source.total_nbytes)}, all resident"
            ),
            *plan.lines,
        ]
        show(lines)
        return ResidentExperts(source, device, dtype, alloc=alloc, load=False)
    from ..experts.build import build_expert_cache

    experts, tier_lines = build_expert_cache(
        source,
        device,
        dtype,
        cache,
        plan.experts,
        progress=progress,
        on_plan=lambda t: show(lines + with_device(plan, t)),
        alloc=alloc,
        load=False,
    )
    lines += with_device(plan, tier_lines)
    if (
        not plan.experts.resident
    ):  # TieredExperts allocates its pools itself (experts/manager.py): counted as made
        ledger.charge("expert_slots", experts.dev.buf)
        ledger.charge("staging", experts.stage or {})
    return experts


def with_device(plan: DevicePlan, lines: list[str]) -> list[str]:
    """The expert cache's lines with the device plan's (CUDA: the auto budget and the total) in place."""
    return plan.lines + lines[len(plan.experts.lines) :]


def peer_decision(ck, config, group) -> tuple[bool, str | None]:
    """Whether the group moves experts between ranks (parallel/peer.py decide_for): made before the
    plan, which counts the peer tier's receive buffers (`peer_slots`)."""
    from ..parallel.peer import decide_for

    return decide_for(group, config.parallel.peer_tier, ck.source, config.cache.cost_profile)


def parallel_provider(ck, config, group, placement, local: ExpertProvider, memory: Memory) -> ExpertProvider:
    """`local` behind the expert-parallel provider, with the peer tier where it pays (its receive buffers
    through the Ledger, the plan's `peer_buffers`); its line added to memory.lines."""
    from ..parallel.experts import ExpertParallelExperts
    from ..parallel.peer import build as build_peer

    def alloc(shape, dt):
        return memory.ledger.alloc(shape, dt, "peer_buffers")

    source, ep = ck.source, config.parallel
    peer, moves, line = build_peer(group, memory.peer, local, source, alloc)
    memory.lines += [line] if line else []
    return ExpertParallelExperts(group, local, placement, ep, source.layers, ck.cfg.num_experts, peer, moves)


def placement_of(ck, config, group):
    """This group's initial placement of every layer's experts (replicas of none yet: no load measured)."""
    from ..parallel.placement import balanced_placement, static_placement

    layers, E, ep = ck.source.layers, ck.cfg.num_experts, config.parallel
    if ep.num_redundant_experts:
        return balanced_placement(
            torch.zeros(len(layers), E), layers, group.world_size, ep.num_redundant_experts
        )
    return static_placement(layers, E, group.world_size)
