"""SlotTable: which expert of one layer sits in which slot of one tier.

Invariants (checked by `check()`, which the stress tests call every step):
- slot_of[e] == s  <=>  owner[s] == e   (each slot has exactly one owner)
- a pinned expert is resident and is never chosen as a victim
- free slots have owner -1 and are not in slot_of

The table holds no bytes: the tier that owns the buffers moves data when
`access` reports a miss (and which expert was evicted from the slot).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # a policy is duck-typed here: slots.py imports nothing of the package
    from .policy import Policy


class Access(NamedTuple):
    slot: int  # -1: not cached (admission refused, or every slot pinned)
    hit: bool
    evicted: int  # expert that lost `slot` on this miss, -1 if none


class SlotTable:
    def __init__(self, num_experts: int, capacity: int, policy: Policy):
        self.num_experts, self.capacity, self.policy = num_experts, capacity, policy
        self.slot_of = [-1] * num_experts
        bind = getattr(policy, "bind", None)  # ties between equal keys go to the lower slot
        if bind is not None:
            bind(self.slot_of)
        self.owner = [-1] * capacity
        self.free = list(range(capacity - 1, -1, -1))
        self.pinned: set[int] = set()
        self.hits = self.misses = 0

    def __contains__(self, e: int) -> bool:
        return self.slot_of[e] >= 0

    def resident(self) -> list[int]:
        return [e for e in self.owner if e >= 0]

    def access(self, e: int, t: int, pin: bool = True) -> Access:
        """One use of expert e at step t; on a miss, make room and assign a slot."""
        s = self.slot_of[e]
        if s >= 0:
            self.hits += 1
            self.policy.touch(e, t)
            if pin:
                self.pinned.add(e)
            return Access(s, True, -1)
        self.misses += 1
        s, evicted = self._place(e, t)
        if s >= 0:
            self.policy.touch(e, t)
            if pin:
                self.pinned.add(e)
        return Access(s, False, evicted)

    def bypass(self, e: int, t: int) -> None:
        """A use of e served without a slot (computed on the CPU, or off-slot): a miss, no placement."""
        self.misses += 1

    def insert(self, e: int, t: int) -> Access:
        """Place e without counting a use (prefetch, warm start). Never evicts a pinned expert."""
        s = self.slot_of[e]
        if s >= 0:
            return Access(s, True, -1)
        s, evicted = self._place(e, t, prefetch=True)
        return Access(s, False, evicted)

    def _place(self, e: int, t: int, prefetch: bool = False) -> tuple[int, int]:
        if not self.policy.admit(e, t, prefetch=prefetch):
            return -1, -1
        evicted = -1
        if self.free:
            s = self.free.pop()
        else:
            evicted = self.policy.choose(self.owner, self.pinned)
            if evicted < 0:  # every slot pinned
                return -1, -1
            assert self.slot_of[evicted] >= 0 and evicted not in self.pinned, (
                f"policy {self.policy.name} chose a pinned or absent victim"
            )
            s = self.slot_of[evicted]
            self.slot_of[evicted] = -1
            self.policy.remove(evicted)
        self.slot_of[e], self.owner[s] = s, e
        self.policy.insert(e, t)
        return s, evicted

    def drop(self, e: int) -> None:
        """Forget e (its slot becomes free), e.g. when the bytes for it cannot be staged."""
        s = self.slot_of[e]
        if s >= 0 and e not in self.pinned:
            self.slot_of[e], self.owner[s] = -1, -1
            self.free.append(s)
            self.policy.remove(e)

    def unpin_all(self) -> None:
        self.pinned.clear()

    def check(self) -> None:
        for s, e in enumerate(self.owner):
            if e >= 0:
                assert self.slot_of[e] == s, f"slot {s} owned by {e} but slot_of[{e}]={self.slot_of[e]}"
        for e, s in enumerate(self.slot_of):
            if s >= 0:
                assert self.owner[s] == e, f"expert {e} maps to slot {s} owned by {self.owner[s]}"
        assert all(self.owner[s] == -1 for s in self.free)
        assert len(self.free) + sum(1 for e in self.owner if e >= 0) == self.capacity
        assert all(self.slot_of[e] >= 0 for e in self.pinned), "pinned expert not resident"
