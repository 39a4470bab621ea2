"""The memory plan: byte budgets -> slots per layer in each tier, with the arithmetic printed.

Budgets accept bytes ("512MiB"), a share of all routed experts in that tier's format
("25%"), or "auto" (device: free VRAM after dense weights, KV cache and a 1 GiB
activation margin on CUDA, half of available RAM on CPU; host: half of available RAM).
Slots are split evenly across MoE layers. A tier that cannot hold top_k experts of a
layer is an error at startup, never a failure mid-generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import BudgetError
from ..units import fmt_bytes, parse_bytes


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def resolve(value, total: int, auto: int, name: str) -> int:
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise ValueError(f"{name}: cannot parse {value!r}") from None
        if not 0 < pct <= 100:
            raise ValueError(f"{name}: percentage must be in (0, 100], got {value!r}")
        return int(total * pct / 100)
    b = parse_bytes(value, name)
    return auto if b is None else b


@dataclass(frozen=True)
class TierPlan:
    slots: int  # per MoE layer
    expert_bytes: int  # one expert in this tier's format
    budget: int

    def describe(self, name: str, num_layers: int, num_experts: int) -> str:
        used = self.slots * num_layers * self.expert_bytes
        return (f"{name}: {self.slots} slots/layer x {num_layers} layers x {fmt_bytes(self.expert_bytes)} = "
                f"{fmt_bytes(used)} ({self.slots / num_experts:.0%} of experts; budget {fmt_bytes(self.budget)})")


def plan_tier(value, name: str, expert_bytes: int, num_layers: int, num_experts: int, top_k: int,
              auto: int, reserve: int = 0) -> TierPlan:
    total = expert_bytes * num_layers * num_experts
    budget = resolve(value, total, auto, name)
    slots = min(num_experts, max(0, budget - reserve) // (expert_bytes * num_layers))
    if slots < top_k:
        need = top_k * expert_bytes * num_layers + reserve
        raise BudgetError(
            f"{name}={fmt_bytes(budget)} holds {slots} experts per layer, but a token needs top_k={top_k}: "
            f"give at least {fmt_bytes(need)} ({top_k} x {num_layers} layers x {fmt_bytes(expert_bytes)}"
            + (f" + {fmt_bytes(reserve)} staging" if reserve else "") + ")"
        )
    return TierPlan(slots, expert_bytes, budget)


def auto_device_bytes(device: torch.device, dense_bytes: int) -> tuple[int, str]:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        margin = 1 << 30
        b = max(0, free - dense_bytes - margin)
        return b, (f"auto device budget = free VRAM {fmt_bytes(free)} - dense weights {fmt_bytes(dense_bytes)} "
                   f"- activations/KV margin {fmt_bytes(margin)} = {fmt_bytes(b)}")
    b = available_ram() // 2
    return b, f"auto device budget (CPU) = half of available RAM = {fmt_bytes(b)}"
