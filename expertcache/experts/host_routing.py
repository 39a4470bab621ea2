"""A MoE layer's routing on the host: its one device -> host read, and what is derived from it.

Shape legend:
    T tokens, K top_k, S slots of a pool, P selected pairs (slot >= 0)
    slots [T, K] int64 (slot of each routed (token, k) pair, -1: skipped), flattened as pair = t * K + k

On CUDA every read of a device tensor by the host (`tolist`, `item`, `nonzero`, `bincount`,
`unique`, a boolean mask) waits for the queued kernels. A MoE layer needs its routing on the host
(the cache decides per expert), so it reads it exactly once: `to_host` (one non-blocking copy into
pinned memory, one wait on its event). Everything else is derived on the host from that copy
(distinct experts, token counts, the per-slot groups below) and goes back with `to_device`: one
non-blocking copy from pinned memory, which never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (the layer's one device -> host read). On CUDA one non-blocking copy into
    pinned memory and one wait on its event; on the CPU a plain copy (a few bytes per pair), so the
    host work never shares storage with the tensor the compute reads."""
    if not t.is_cuda:
        if type(t) is torch.Tensor:
            return t.clone()
        host = torch.empty(t.shape, dtype=t.dtype)  # a subclass (a tensor standing for device memory):
        host.copy_(t)  # its values into a plain host tensor
        return host
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    ev.synchronize()
    return host


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor where the compute runs: itself on the CPU; else one non-blocking copy from
    pinned memory (the caching host allocator keeps the pinned block until the copy is done)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class DeviceGroups:
    """SlotGroups where the compute runs: order, token, slot [P] int64, offs [S] int32 (or None)."""

    order: torch.Tensor
    token: torch.Tensor
    slot: torch.Tensor
    offs: torch.Tensor | None


@dataclass(frozen=True)
class SlotGroups:
    """The selected pairs of a host slot table grouped by slot.

    order [P] int64: pair indices sorted by slot, stably (by pair within a slot); skipped pairs left out
    slot  [P] int64: the slot of each sorted pair
    active: the distinct slots, ascending; counts: pairs per active slot; K: pairs per token
    """

    order: torch.Tensor
    slot: torch.Tensor
    active: list[int]
    counts: list[int]
    K: int

    def on(self, device: torch.device, num_slots: int | None = None) -> DeviceGroups:
        """The groups where the compute runs, in one copy; `num_slots`: with the grouped GEMM's
        offsets (end of each slot's group, [S] int32)."""
        P = self.order.shape[0]
        parts = [self.order, self.slot]
        if num_slots is not None:
            n = torch.zeros(num_slots, dtype=torch.int64)
            n[self.active] = torch.tensor(self.counts, dtype=torch.int64)
            parts.append(n.cumsum(0))
        packed = to_device(torch.cat(parts), device)
        order = packed[:P]
        offs = packed[2 * P :].to(torch.int32) if num_slots is not None else None
        return DeviceGroups(order, order // self.K, packed[P : 2 * P], offs)


def group_by_slot(slots: torch.Tensor) -> SlotGroups:
    """Host slots [T, K] (-1: skipped) -> their SlotGroups; host work only."""
    if slots.device.type != "cpu":
        raise ValueError(f"group_by_slot takes a host slot table (to_host of it), got one on {slots.device}")
    flat = slots.reshape(-1)
    order = torch.argsort(flat, stable=True)
    active, counts = torch.unique_consecutive(flat[order], return_counts=True)
    active, counts = active.tolist(), counts.tolist()
    if active and active[0] < 0:
        order = order[counts[0] :]
        active, counts = active[1:], counts[1:]
    return SlotGroups(order, flat[order], active, counts, slots.shape[1])
