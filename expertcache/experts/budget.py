"""The memory plan: byte budgets -> slots per layer in each tier, with the arithmetic printed.

Budgets accept bytes ("512MiB"), a share of all routed experts in that tier's format
("25%"), or "auto" (device: half of available RAM on CPU, or with --low-memory the RAM
left after the engine's other terms; on CUDA the device plan, engine/device_plan.py, passes what is
left of the GPU after every other term; host: half of available RAM). Available RAM is
MemAvailable, or the room under this process's memory cgroup limit when smaller (ramlimit.py).
Slots are split evenly across MoE layers. A tier that cannot hold top_k experts of a
layer is an error at startup, never a failure mid-generation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from .. import kernels, ramlimit
from ..errors import BudgetError
from ..units import fmt_bytes, parse_bytes


_SCALE = re.compile(r"_scale(_inv)?$|_scales$")  # quantization scales: consumed at load, not kept


def dense_compute_bytes(index, dtype: torch.dtype, device: torch.device | str | None = None) -> int:
    """The dense (non-expert) float weights as the engine holds them: in `dtype`, quantization scales
    folded in; with `device`, bf16/fp16 matrices the CPU kernels read stay in their stored dtype
    (kernels.dense_dtype). From the headers alone (`index` a TensorIndex)."""
    def held(t) -> int:
        return (dtype if device is None else kernels.dense_dtype(t.dtype, len(t.shape), device, dtype)).itemsize

    return sum(math.prod(t.shape) * held(t) for n, t in index.tensors.items()
               if ".experts." not in n and not _SCALE.search(n) and t.dtype.is_floating_point)


LOW_MEMORY_MARGIN = 256 << 20  # left free by a low-memory CPU plan's auto budget (at least; 5% of the room above it)


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


@dataclass
class MemoryPlan:
    """The tiers the engine allocates for given budgets; `host` is None when every expert is on the device."""

    device: TierPlan
    host: TierPlan | None
    staging: int  # one expert in the fastest tier's format on CUDA (experts streamed in waves)
    layers: int
    dev_parts: tuple = ()  # the fastest tier's parts (compute format, or stored in low-memory mode)
    lines: list[str] = field(default_factory=list)

    @property
    def resident(self) -> bool:
        return self.host is None


    @property
    def device_used(self) -> int:
        return self.device.slots * self.device.expert_bytes * self.layers + self.staging

    @property
    def host_used(self) -> int:
        return 0 if self.host is None else self.host.slots * self.host.expert_bytes * self.layers


def _is_auto(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() == "auto")


def plan_memory(source, device: torch.device, dtype: torch.dtype, device_memory=None, host_memory=None,
                low_memory: bool = False, other_ram: int = 0) -> MemoryPlan:
    """Budgets -> tiers, with the lines the engine prints. Reads headers only (`plan` uses it too).

    Low memory on a CPU device: the fastest tier keeps the stored format (converted per use) and
    host_memory may be 0 (no second copy in RAM: misses are read from disk into device slots). There
    an `auto` device budget is the RAM left after `other_ram` (every other term of the engine's plan:
    dense weights, KV cache, activations, logits), the host tier (0 when it is auto too: a second copy
    in the same RAM buys nothing) and a margin; available RAM honours a memory cgroup's limit.
    """
    cfg = source.cfg
    L, E, K = len(source.layers), cfg.num_experts, cfg.top_k
    low_cpu = low_memory and device.type == "cpu"
    dev_parts = source.parts if low_cpu else source.compute_parts(dtype, device)
    dev_bytes = sum(p.nbytes for p in dev_parts)
    lines = [f"experts: {L} layers x {E} experts x {fmt_bytes(source.stored_nbytes)} = "
             f"{fmt_bytes(source.total_nbytes)} on disk ({source.dtype}); fastest tier "
             f"{fmt_bytes(dev_bytes)}/expert ({dev_parts[0].dtype})"]
    ram, why = ramlimit.available()  # read once per plan: every `auto` budget below takes it
    ram_text = f"available RAM {fmt_bytes(ram)} ({why})"
    auto_dev = 0
    if _is_auto(device_memory) and device.type == "cuda":
        raise ValueError("device_memory 'auto' on cuda is resolved by the device plan (engine/device_plan.py); "
                         "give the fastest tier's budget in bytes or as a share here")
    if _is_auto(device_memory) and low_cpu:
        if _is_auto(host_memory):
            host_memory = 0
        host = resolve(host_memory, source.total_nbytes, 0, "host_memory")
        margin = max(LOW_MEMORY_MARGIN, ram // 20)
        auto_dev = max(0, ram - other_ram - host - margin)
        lines.append(f"auto device budget (CPU, low memory) = {ram_text} - the engine's other terms "
                     f"{fmt_bytes(other_ram)} - host tier {fmt_bytes(host)} - margin {fmt_bytes(margin)} = "
                     f"{fmt_bytes(auto_dev)}")
    elif _is_auto(device_memory):
        auto_dev = ram // 2
        lines.append(f"auto device budget (CPU) = half of {ram_text} = {fmt_bytes(auto_dev)}")
    staging = dev_bytes if device.type == "cuda" else 0
    dplan = plan_tier("auto" if device_memory is None else device_memory, "device_memory", dev_bytes, L, E, K,
                      auto_dev, reserve=staging)
    if dplan.slots >= E:
        lines.append(dplan.describe("device", L, E) + ": every expert resident, loaded once")
        return MemoryPlan(dplan, None, 0, L, dev_parts, lines)
    lines.append(dplan.describe("device", L, E) + (f" + staging {fmt_bytes(staging)}" if staging else ""))
    host_auto = ram // 2
    if low_cpu and not _is_auto(host_memory) and \
            resolve(host_memory, source.total_nbytes, 0, "host_memory") == 0:
        hplan = TierPlan(0, source.expert_nbytes, 0)
    else:
        if not _is_auto(host_memory) and resolve(host_memory, source.total_nbytes, 0, "host_memory") == 0:
            raise BudgetError("host_memory=0: no expert could be staged in RAM; on CPU add --low-memory (misses "
                              "are then read from disk straight into the expert slots), or give a host budget")
        hplan = plan_tier("auto" if host_memory is None else host_memory, "host_memory", source.expert_nbytes,
                          L, E, K, host_auto)
    if _is_auto(host_memory):
        lines.append(f"auto host budget = half of {ram_text} = {fmt_bytes(host_auto)}")
    lines.append(hplan.describe("host", L, E) + (": every expert in RAM" if hplan.slots >= E else
                                                  "; the rest streamed from disk"))
    lines.append(f"disk: {fmt_bytes(source.total_nbytes)} in {source.index.model_dir}")
    return MemoryPlan(dplan, hplan, staging, L, dev_parts, lines)
