"""Eviction policies for one layer's expert slots, chosen by name from a registry.

A policy only *ranks*; the caller (experts.slots.SlotTable) owns residency and
pinning. The same objects drive the engine and the trace replay simulator, so
their hit/miss counters agree on the same trace.

Contract (every policy):
- `touch(e, t)` is called once per use of expert `e` at logical time `t`
  (t increases by one per forward step of the layer; several uses may share t).
- `insert(e, t)` is called when `e` becomes resident, `remove(e)` when it leaves.
- `victim(candidates)` returns one element of `candidates` (a non-empty list of
  resident, unpinned experts). It must not mutate state; `remove` follows.
- `admit(e, t)` may refuse to cache a missed expert (it is then used once from
  the slower tier). The default admits everything.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

POLICIES: dict[str, Callable[..., "Policy"]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        POLICIES[name] = cls
        return cls

    return deco


def make_policy(name: str, num_experts: int, capacity: int, layer: int = 0, stats=None) -> "Policy":
    """Build policy `name` for one layer. `stats` is an optional [layers, experts]
    use-count matrix (saved expert statistics) for policies that start warm."""
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](num_experts=num_experts, capacity=capacity, layer=layer, stats=stats)


class Policy:
    name = "base"

    def __init__(self, num_experts: int, capacity: int, layer: int = 0, stats=None):
        self.num_experts, self.capacity, self.layer = num_experts, capacity, layer

    def touch(self, e: int, t: int) -> None: ...

    def insert(self, e: int, t: int) -> None: ...

    def remove(self, e: int) -> None: ...

    def admit(self, e: int, t: int) -> bool:
        return True

    def victim(self, candidates: list[int]) -> int:
        raise NotImplementedError


@register("lru")
class LRU(Policy):
    """Least recently used: the baseline every engine ships."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.order: OrderedDict[int, None] = OrderedDict()

    def touch(self, e, t):
        if e in self.order:
            self.order.move_to_end(e)

    def insert(self, e, t):
        self.order[e] = None
        self.order.move_to_end(e)

    def remove(self, e):
        self.order.pop(e, None)

    def victim(self, candidates):
        allowed = set(candidates)
        return next(e for e in self.order if e in allowed)
