"""The accounting allocator: every persistent tensor the engine puts on its compute device, counted by term.

    ledger = Ledger(torch.device("cuda"), cap=plan.budget)
    pool = ledger.alloc((slots, *shape), torch.bfloat16, "expert_slots")   # allocated and counted
    ledger.charge("kv_cache", kv.tensors)                                    # made by another class, counted as made
    ledger.terms -> {"dense": bytes, "kv_cache": bytes, ...}

A term is one of the device plan's (build/plan.py TERMS). Bytes are the byte ranges the
tensors cover in their storages, each byte counted once across all terms: a view of a counted tensor
adds nothing, and a tensor of hostmem.empty counts its own bytes, not the untouched slack of its
mapping. (A kept slice of a larger temporary would count only the slice: the GPU check compares
the total with torch.cuda.memory_reserved.)
Going past `cap` raises BudgetError naming the term that crossed it and what was counted before it.

Test mode: within `simulate(cap)` the engine treats its CPU as a device of `cap` bytes (the builder
plans against it and gives its Ledger the cap), so CI checks the plan against real allocations.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .. import hostmem
from ..errors import BudgetError
from ..units import fmt_bytes

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
        # storage data pointer -> the byte ranges of it counted so far (a tensor's bytes, not its whole
        # storage: hostmem.empty's tensors are views of a larger, mostly untouched mapping)
        self._spans: dict[int, list[tuple[int, int]]] = {}

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
        spans = {ptr: list(v) for ptr, v in self._spans.items()}
        before = sum(_union(v) for v in spans.values())
        for t in _tensors(tensors):
            if t.numel():
                spans.setdefault(t.untyped_storage().data_ptr(), []).append(_span(t))
        added = sum(_union(v) for v in spans.values()) - before
        self._check(what, added)
        self._spans = spans
        self.terms[what] = self.terms.get(what, 0) + added
        return added

    def _add(self, what: str, t: torch.Tensor) -> None:
        self._spans.setdefault(t.untyped_storage().data_ptr(), []).append(_span(t))
        self.terms[what] = self.terms.get(what, 0) + t.numel() * t.element_size()

    def _check(self, what: str, nbytes: int) -> None:
        if self.cap is not None and self.total + nbytes > self.cap:
            before = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.terms.items()) or "nothing"
            raise BudgetError(
                f"device memory cap {fmt_bytes(self.cap)} exceeded by {what} ({fmt_bytes(nbytes)}) "
                f"after {before}"
            )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of t within its storage."""
    n = t.element_size()
    reach = sum((d - 1) * st for d, st in zip(t.shape, t.stride())) + 1
    return t.storage_offset() * n, (t.storage_offset() + reach) * n


def _union(spans: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
