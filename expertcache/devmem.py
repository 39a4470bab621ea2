"""The accounting allocator: every persistent tensor the engine puts on its compute device, counted by term.

    ledger = Ledger(torch.device("cuda"), cap=plan.budget)
    pool = ledger.alloc((slots, *shape), torch.bfloat16, "expert_slots")   # allocated and counted
    ledger.charge("dense", model_tensors)                                    # made elsewhere, counted here
    ledger.terms -> {"dense": bytes, "kv_cache": bytes, ...}

A term is one of the device plan's (engine/device_plan.py TERMS). Bytes are those of the tensors'
storages, each storage counted once across all terms (a view of a counted tensor adds nothing).
Going past `cap` raises BudgetError naming the term that crossed it and what was counted before it.

Test mode: within `simulate(cap)` the engine treats its CPU as a device of `cap` bytes (the builder
plans against it and gives its Ledger the cap), so CI checks the plan against real allocations.
"""

from __future__ import annotations

import contextlib
import math

import torch

from . import hostmem
from .errors import BudgetError
from .units import fmt_bytes

_SIMULATED: list[int] = []  # the cap of the innermost simulate() block


@contextlib.contextmanager
def simulate(cap: int):
    """Within this block a CPU engine is the device under a cap of `cap` bytes (tests)."""
    _SIMULATED.append(int(cap))
    try:
        yield
    finally:
        _SIMULATED.pop()


def simulated_cap() -> int | None:
    """The cap of the innermost simulate() block, or None outside one."""
    return _SIMULATED[-1] if _SIMULATED else None


class Ledger:
    """Bytes per term on one device, against an optional cap (a hard limit)."""

    def __init__(self, device: torch.device, cap: int | None = None):
        self.device, self.cap = device, cap
        self.terms: dict[str, int] = {}
        self._seen: set[int] = set()  # storage data pointers already counted

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def alloc(self, shape, dtype: torch.dtype, what: str, zero: bool = False) -> torch.Tensor:
        """A new tensor on the device, counted under `what`; the cap is checked before it is allocated."""
        nbytes = math.prod(shape) * dtype.itemsize
        self._check(what, nbytes)
        t = hostmem.empty(shape, dtype, self.device)  # CPU: on huge pages (hostmem.py)
        if zero:
            t.zero_()
        self._add(what, t)
        return t

    def charge(self, what: str, tensors) -> int:
        """Count tensors allocated elsewhere (nested lists/tuples/dicts of tensors) under `what`; returns
        the bytes added. Raises BudgetError when the cap is crossed."""
        new = {}
        for t in _tensors(tensors):
            s = t.untyped_storage()
            if s.data_ptr() not in self._seen and s.data_ptr() not in new and s.nbytes():
                new[s.data_ptr()] = s.nbytes()
        added = sum(new.values())
        self._check(what, added)
        self._seen.update(new)
        self.terms[what] = self.terms.get(what, 0) + added
        return added

    def _add(self, what: str, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        self._seen.add(s.data_ptr())
        self.terms[what] = self.terms.get(what, 0) + s.nbytes()

    def _check(self, what: str, nbytes: int) -> None:
        if self.cap is not None and self.total + nbytes > self.cap:
            before = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.terms.items()) or "nothing"
            raise BudgetError(f"device memory cap {fmt_bytes(self.cap)} exceeded by {what} ({fmt_bytes(nbytes)}) "
                              f"after {before}")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
