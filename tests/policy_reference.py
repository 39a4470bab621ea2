"""The cache policies as they were before their decisions moved to heaps of plain Python values (numpy
scans of the slots per victim, ghost SlotTables for adaptive): the reference tests/experts/test_policy.py
compares the registry's decisions with, one for one. Not imported by the package.

Eviction policies for one layer's expert slots, chosen by name from a registry.

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
  the slower tier). The default admits everything. `prefetch=True` (optional
  keyword, defaults False) marks a prefetch insert; every policy here accepts it,
  SlotTable does not pass it yet. SlotTable calls `admit`
  before every placement (miss or prefetch insert), so `admit` is where a
  policy learns the current time before a `victim` call.

Construction: `make_policy(name, num_experts, capacity, layer, stats, oracle, **params)`;
every policy accepts and ignores keywords it does not use. `oracle` is a
`NextUse` (future knowledge), needed only by "min" and available only in trace
replay, which builds it from the trace's access sequence.

Registry: lru, lfru, lfu, static, min, "lfru-admit" (the best single policy on the
trained top-2 traces; see `LFRUAdmit`) and "adaptive" (the default: per layer, follows
whichever of lfru-admit, lfru and lfu its ghost tables show hitting more; bench/policy_bench.py).
Victims come from `choose`: O(pinned) for lru, vectorised over the slots (numpy) for the scored
policies, so no Python loop runs over 64-512 slots per miss.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np

POLICIES: dict[str, Callable[..., Policy]] = {}
DEFAULT_POLICY = "adaptive"  # the best of lfru-admit, lfru and lfu per layer, online (README, "Policies against the optimum")
ONLINE = (
    "lru",
    "lfru",
    "lfu",
    "static",
    "lfru-admit",
    "adaptive",
)  # usable by the engine (no future knowledge)


def register(name: str):
    def deco(cls):
        cls.name = name
        POLICIES[name] = cls
        return cls

    return deco


def make_policy(
    name: str,
    num_experts: int,
    capacity: int,
    layer: int = 0,
    stats=None,
    oracle: NextUse | None = None,
    **params,
) -> Policy:
    """Build policy `name` for one layer. `stats` is an optional [layers, experts]
    use-count matrix (saved expert statistics) for policies that start warm;
    `oracle` gives next-use times (replay only, for "min"); `params` tune a policy
    (e.g. decay=0.9 for lfru)."""
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](
        num_experts=num_experts, capacity=capacity, layer=layer, stats=stats, oracle=oracle, **params
    )


class Policy:
    name = "base"

    def __init__(self, num_experts: int, capacity: int, layer: int = 0, stats=None, **_ignored):
        self.num_experts, self.capacity, self.layer = num_experts, capacity, layer

    def touch(self, e: int, t: int) -> None: ...

    def insert(self, e: int, t: int) -> None: ...

    def remove(self, e: int) -> None: ...

    def admit(self, e: int, t: int, prefetch: bool = False) -> bool:
        return True

    def victim(self, candidates: list[int]) -> int:
        raise NotImplementedError

    def choose(self, owner: list[int], pinned: set[int]) -> int:
        """The victim among the residents `owner` (slot order, -1 = free) that are not pinned, or -1.
        The default builds the candidate list and asks `victim`; the registry's policies override it
        without a Python scan over the slots (O(pinned) for lru, vectorised for the scored ones)."""
        candidates = [x for x in owner if x >= 0 and x not in pinned]
        return self.victim(candidates) if candidates else -1


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

    def choose(self, owner, pinned):
        return next((e for e in self.order if e not in pinned), -1)  # oldest first: O(pinned + 1)


class _Scored(Policy):
    """Shared bookkeeping for score-ranked policies.

    Per expert (kept across evictions, so a returning expert keeps its history):
    `last_use[e]` (time of the last touch, -inf before), `resident` (set), and
    `fresh` (expert -> insert time, while not yet used since insert: one inserted
    at the current time is evicted only if every candidate is, so a prefetch does
    not evict the previous prefetch of the same step).
    Subclasses define `key(e)`: the candidate with the smallest key is evicted.
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.now = 0
        self.last_use = np.full(self.num_experts, -np.inf)
        self.resident: set[int] = set()
        self.fresh: dict[int, int] = {}
        self.fresh_t = np.full(self.num_experts, -1, dtype=np.int64)  # insert time while fresh, else -1

    def touch(self, e, t):
        self.now = max(self.now, t)
        self.fresh.pop(e, None)
        self.fresh_t[e] = -1
        self.last_use[e] = t

    def insert(self, e, t):
        self.now = max(self.now, t)
        self.resident.add(e)
        self.fresh[e] = t  # a demand miss touches right after, which clears it
        self.fresh_t[e] = t

    def remove(self, e):
        self.resident.discard(e)
        self.fresh.pop(e, None)
        self.fresh_t[e] = -1

    def admit(self, e, t, prefetch: bool = False):
        self.now = max(self.now, t)
        return True

    def key(self, e: int) -> tuple:
        raise NotImplementedError

    def victim(self, candidates):
        return min(candidates, key=lambda e: (self.fresh.get(e) == self.now, *self.key(e)))

    def keys(self, c: np.ndarray) -> tuple[np.ndarray, ...]:
        """`key` for an array of experts at once (None: not vectorised; `choose` falls back)."""
        return None

    def choose(self, owner, pinned):
        own = np.asarray(owner, dtype=np.int64)
        mask = own >= 0
        if pinned:
            mask &= ~np.isin(own, np.fromiter(pinned, np.int64, len(pinned)))
        c = own[mask]  # slot order, as `victim`'s candidates
        if not len(c):
            return -1
        keys = self.keys(c)
        if keys is None:
            return self.victim(c.tolist())
        fresh = self.fresh_t[c] == self.now
        order = np.lexsort(tuple(reversed((fresh, *keys))))  # stable: ties keep slot order, as min()
        return int(c[order[0]])


@register("lfru")
class LFRU(_Scored):
    """Frequency-aware LRU: a decayed use score per expert.

    On a use at time t: score = score * decay**(t - t_last) + 1. The victim is
    the candidate with the lowest score decayed to now, ties by least recent use.
    decay in (0, 1]; decay=1 is LFU with full history, decay->0 is LRU.
    """

    def __init__(self, decay: float = 0.9, **kw):
        super().__init__(**kw)
        if not 0 < decay <= 1:
            raise ValueError(f"decay: must lie in (0, 1], got {decay}")
        self.decay = decay
        self.score = np.zeros(self.num_experts)
        self.t_score = np.zeros(self.num_experts)

    def touch(self, e, t):
        super().touch(e, t)
        self.score[e] = self.score[e] * self.decay ** (t - self.t_score[e]) + 1.0
        self.t_score[e] = t

    def key(self, e):
        return (self.score[e] * self.decay ** (self.now - self.t_score[e]), self.last_use[e])

    def keys(self, c):
        return (self.score[c] * self.decay ** (self.now - self.t_score[c]), self.last_use[c])


@register("lfu")
class LFU(LFRU):
    """Least frequently used over the whole history (lfru with decay=1), ties by recency."""

    def __init__(self, **kw):
        kw["decay"] = 1.0
        super().__init__(**kw)


@register("static")
class Static(_Scored):
    """The hottest experts from saved statistics stay; others use only free slots.

    With `stats` ([layers, experts] use counts, row `layer` used): the top-`capacity`
    experts by count form the hot set. A missed expert outside the hot set is
    admitted only while a slot is free; a hot expert is always admitted and evicts
    the candidate with the lowest saved count (ties: least recent). So after
    warm-up the cache holds exactly the hot set.

    Without stats (documented choice: LFU after warm-up, no error): the counts are
    collected online during the first `warmup` steps (admitting everything and
    evicting the least used), then frozen and used as above.
    """

    def __init__(self, stats=None, warmup: int = 128, **kw):
        super().__init__(**kw)
        self.warmup = warmup
        self.frozen = stats is not None
        if stats is not None:
            stats = np.asarray(stats, dtype=np.float64)
            if stats.ndim != 2 or stats.shape[1] != self.num_experts or self.layer >= stats.shape[0]:
                raise ValueError(
                    f"stats: expected a [layers, {self.num_experts}] matrix covering layer "
                    f"{self.layer}, got shape {stats.shape}"
                )
            self.count = stats[self.layer].copy()
        else:
            self.count = np.zeros(self.num_experts)
        self.t0: int | None = None
        self._update_hot()

    def _update_hot(self):
        order = np.argsort(-self.count, kind="stable")
        self.hot = set(order[: self.capacity].tolist())

    def _clock(self, t):
        if self.t0 is None:
            self.t0 = t
        if not self.frozen and t - self.t0 >= self.warmup:
            self.frozen = True
            self._update_hot()

    def touch(self, e, t):
        super().touch(e, t)
        self._clock(t)
        if not self.frozen:
            self.count[e] += 1

    def admit(self, e, t, prefetch: bool = False):
        super().admit(e, t)
        self._clock(t)
        return (not self.frozen) or e in self.hot or len(self.resident) < self.capacity

    def key(self, e):
        return (self.count[e], self.last_use[e])

    def keys(self, c):
        return (self.count[c], self.last_use[c])


@register("lfru-admit")
class LFRUAdmit(LFRU):
    """Best online policy found on real traces: lfru (decay 0.95) plus a
    TinyLFU-like admission filter.

    Eviction: as lfru (lowest decayed use score, ties least recent).
    Admission: while a slot is free, admit. When every slot is taken, a missed
    (or prefetched) expert e is admitted only if f(e) + 1 >= min over residents r
    of f(r), all scores decayed to now (f(e) + 1 is e's score after this use).
    A refused expert is served once from the slower tier and evicts nothing, so a
    one-off expert cannot push out a steadily used one (vectorised over the residents).
    `admit(e, t, prefetch=True)` always admits (a prefetch is predictor-informed).
    A refused use still raises e's score, so an expert asked for again and again gets in.

    Tuned on tinymoe-py16 traces (bench/trace_tinymoe.py): decay 0.95 was the best
    of 0.7..0.99 on the tuning trace and held on a second held-out trace. Because
    it may bypass, its hit rate can exceed demand-caching MIN.
    """

    def __init__(self, decay: float = 0.95, **kw):
        super().__init__(decay=decay, **kw)

    def admit(self, e, t, prefetch: bool = False):
        super().admit(e, t)
        if prefetch or len(self.resident) < self.capacity:
            return True
        mine = self.score[e] * self.decay ** (t - self.t_score[e]) + 1.0
        res = np.fromiter(self.resident, np.int64, len(self.resident))
        if mine >= self.keys(res)[0].min():
            return True
        self.score[e], self.t_score[e] = mine, t  # a refused use still counts (as TinyLFU's sketch)
        return False


@register("adaptive")
class Adaptive(Policy):
    """Follows whichever candidate policy would have hit most on this layer's recent uses.

    Each candidate ranks the real slots (it sees every touch, insert and remove) and also drives
    a ghost SlotTable of the same capacity fed with the same uses (a use: a touch, or a refused
    miss); ghost hits decay by `decay` per step. admit and victim go to the leader. Why: the
    admission filter of lfru-admit is the best on the trained top-2 traces and the worst on a
    top-8 trace with topic shifts, where plain lfru leads; on stationary Zipf skews full-history
    lfu leads (README, "Policies against the optimum": bench/policy_bench.py, untuned traces).
    """

    def __init__(self, candidates=("lfru-admit", "lfru", "lfu"), decay: float = 0.98, **kw):
        super().__init__(**kw)
        from expertcache.experts.slots import SlotTable

        args = {
            "num_experts": self.num_experts,
            "capacity": self.capacity,
            "layer": self.layer,
            "stats": kw.get("stats"),
        }
        self.rankers = [make_policy(n, **args) for n in candidates]
        self.ghosts = [SlotTable(self.num_experts, self.capacity, make_policy(n, **args)) for n in candidates]
        self.score = [0.0] * len(candidates)
        self.decay, self.t, self.leader, self.pending = decay, None, 0, None

    def _use(self, e, t):
        if t != self.t:
            if self.t is not None:
                self.score = [x * self.decay ** (t - self.t) for x in self.score]
                self.leader = max(range(len(self.score)), key=lambda k: (self.score[k], -k))
            self.t = t
            for g in self.ghosts:
                g.unpin_all()
        for k, g in enumerate(self.ghosts):
            self.score[k] += g.access(e, t).hit

    def touch(self, e, t):
        if self.pending != (e, t):  # a miss was counted by admit already
            self._use(e, t)
        self.pending = None
        for r in self.rankers:
            r.touch(e, t)

    def insert(self, e, t):
        for r in self.rankers:
            r.insert(e, t)

    def remove(self, e):
        for r in self.rankers:
            r.remove(e)

    def admit(self, e, t, prefetch: bool = False):
        if not prefetch:
            self._use(e, t)
            self.pending = (e, t)
        for k, r in enumerate(self.rankers):
            if k != self.leader and isinstance(r, _Scored):
                _Scored.admit(r, e, t)  # keeps its clock; only the leader decides
        return self.rankers[self.leader].admit(e, t, prefetch=prefetch)

    def victim(self, candidates):
        return self.rankers[self.leader].victim(candidates)

    def choose(self, owner, pinned):
        return self.rankers[self.leader].choose(owner, pinned)


class NextUse:
    """Next-use oracle for MIN: `uses[e]` is the sorted list of times expert e is used.

    `next_use(e, t)` is the first use time >= t (math.inf if none); O(log uses).
    Replay builds it per layer from the trace's access schedule."""

    def __init__(self, num_experts: int, schedule: Iterable[tuple[int, Iterable[int]]]):
        self.uses: list[list[int]] = [[] for _ in range(num_experts)]
        for t, experts in schedule:
            for e in experts:
                self.uses[e].append(t)

    def next_use(self, e: int, t: int) -> float:
        u = self.uses[e]
        i = bisect.bisect_left(u, t)
        return u[i] if i < len(u) else math.inf


@register("min")
class MIN(_Scored):
    """Belady's MIN with demand caching: evict the candidate whose next use is
    farthest in the future (never used again = farthest; ties: lower expert id).

    Needs `oracle` (a NextUse); only trace replay can supply one. At a miss at step
    t the experts already used at t are pinned, so an unpinned candidate's next use
    is its first use at time >= t.
    """

    def __init__(self, oracle: NextUse | None = None, **kw):
        super().__init__(**kw)
        if oracle is None:
            raise ValueError(
                "min: needs a next-use oracle (future knowledge); it exists only in trace replay"
            )
        self.oracle = oracle

    def key(self, e):
        return (-self.oracle.next_use(e, self.now), e)

    def victim(self, candidates):
        return min(candidates, key=self.key)
