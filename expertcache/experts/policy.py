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
- `admit(e, t, prefetch=False)` may refuse to cache a missed expert (it is then used
  once from the slower tier). The default admits everything. SlotTable calls `admit`
  before every placement (a miss, or with prefetch=True a prefetch insert), so `admit`
  is where a policy learns the current time before a `victim` call.
- `bind(slot_of)`: the table's expert -> slot list (-1 absent), given once by SlotTable;
  ties between equal keys go to the lower slot, as a scan in slot order would.

Construction: `make_policy(name, num_experts, capacity, layer, stats, oracle, **params)`;
every policy accepts and ignores keywords it does not use. `oracle` is a
`NextUse` (future knowledge), needed only by "min" and available only in trace
replay, which builds it from the trace's access sequence.

Registry: lru, lfru, lfu, static, min, "lfru-admit" (the best single policy on the
trained top-2 traces; see `LFRUAdmit`) and "adaptive" (the default: per layer, follows
whichever of lfru-admit, lfru and lfu its ghost caches show hitting more; bench/policy_bench.py).

Cost: every online policy decides in O(log slots) per placement with plain Python ints and floats
(no numpy on tiny arrays): lru from its order, the scored ones from a heap of time-invariant keys.
A decayed score s * d**(now - t) orders like log(s) + t * (-log d), which does not change with
`now`, so an expert's heap entry changes only when it is used (lazy deletion: an entry is live
while it is the expert's current one). `adaptive` keeps one heap (its leader's) and three ghost
caches (lfru-family ghosts inlined, fed once a step: their hits count only when the leader is picked);
where a layer has more than `GHOST_SAMPLE_EXPERTS` experts its ghosts watch a fixed hashed sample of
about half that many, capacity scaled alike (SHARDS-style spatial sampling), so a step costs a few
ghost uses whatever the expert count.
"""

from __future__ import annotations

import bisect
import heapq
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
GHOST_SAMPLE_EXPERTS = (
    64  # adaptive: ghosts watch every expert up to this many, a 1/R sample above (module doc)
)


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
    slot_of: list[int] | None = None

    def __init__(self, num_experts: int, capacity: int, layer: int = 0, stats=None, **_ignored):
        self.num_experts, self.capacity, self.layer = num_experts, capacity, layer

    def bind(self, slot_of: list[int]) -> None:
        self.slot_of = slot_of

    def touch(self, e: int, t: int) -> None: ...

    def insert(self, e: int, t: int) -> None: ...

    def remove(self, e: int) -> None: ...

    def admit(self, e: int, t: int, prefetch: bool = False) -> bool:
        return True

    def victim(self, candidates: list[int]) -> int:
        raise NotImplementedError

    def set_ranking(self, on: bool) -> None:
        """adaptive: whether this policy's victims are asked for (a scored policy keeps its heap only then)."""

    def choose(self, owner: list[int], pinned: set[int]) -> int:
        """The victim among the residents `owner` (slot order, -1 = free) that are not pinned, or -1.
        The default builds the candidate list and asks `victim`; the registry's online policies
        override it without a scan over the slots (O(pinned) for lru, a heap for the scored ones)."""
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
    `fresh` (expert -> its heap entry, while inserted at the current time and not used since:
    such an expert is evicted only if every candidate is, so a prefetch does not evict the
    previous prefetch of the same step; it joins the heap when the clock moves on).
    Subclasses define `key(e)` (the candidate with the smallest key is evicted; a tuple whose last
    element is last_use) and `rank(e)`, a float that orders like key(e)[0] and changes only when e
    is used (the heap's key); `note(e, t)` updates a subclass's state on a use.
    Heap entries: (rank, last_use, slot, e); live iff `entry[e] is` the entry.
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.now = 0
        self.last_use = [-math.inf] * self.num_experts
        self.resident: set[int] = set()
        self.fresh: dict[int, tuple | None] = {}
        self.heap: list[tuple] = []
        self.entry: list[tuple | None] = [None] * self.num_experts
        self.ranking = True

    # -- the heap ---------------------------------------------------------------------------------
    def rank(self, e: int) -> float:
        raise NotImplementedError

    def _entry(self, e: int) -> tuple:
        so = self.slot_of
        return (self.rank(e), self.last_use[e], so[e] if so is not None else e, e)

    def _push(self, e: int) -> None:
        x = self._entry(e)
        self.entry[e] = x
        heapq.heappush(self.heap, x)
        if len(self.heap) > 4 * len(self.resident) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        """Every resident's live entry afresh (drops the stale ones; fresh experts stay aside)."""
        self.entry = [None] * self.num_experts
        for e in self.fresh:
            self.fresh[e] = self._entry(e)
        heap = []
        for e in self.resident:
            if e not in self.fresh:
                x = self.entry[e] = self._entry(e)
                heap.append(x)
        heapq.heapify(heap)
        self.heap = heap

    def set_ranking(self, on):
        if on and not self.ranking:
            self.ranking = True
            self._rebuild()
        elif not on and self.ranking:
            self.ranking = False
            self.heap, self.entry = [], [None] * self.num_experts

    def _clock(self, t: int) -> None:
        if t > self.now:
            self.now = t
            if self.fresh:  # inserted at an earlier time: ordinary candidates now
                if self.ranking:
                    for e, x in self.fresh.items():
                        self.entry[e] = x
                        heapq.heappush(self.heap, x)
                self.fresh.clear()

    def _top(self) -> tuple | None:
        """The live heap entry with the smallest key (stale ones dropped), or None."""
        heap, entry = self.heap, self.entry
        while heap:
            x = heap[0]
            if entry[x[3]] is x:
                return x
            heapq.heappop(heap)
        return None

    # -- the contract -----------------------------------------------------------------------------
    def note(self, e: int, t: int) -> None: ...

    def touch(self, e, t):
        if not self.ranking:  # adaptive's followers: the state only (their clock moves on insert)
            self.fresh.pop(e, None)
            self.last_use[e] = t
            self.note(e, t)
            return
        self._clock(t)
        self.fresh.pop(e, None)
        self.last_use[e] = t
        self.note(e, t)
        if e in self.resident:
            self._push(e)

    def insert(self, e, t):
        self._clock(t)
        self.resident.add(e)
        if t == self.now:  # a demand miss touches right after, which clears it
            self.fresh[e] = self._entry(e) if self.ranking else None
        elif self.ranking:
            self._push(e)

    def remove(self, e):
        self.resident.discard(e)
        self.fresh.pop(e, None)
        self.entry[e] = None

    def admit(self, e, t, prefetch: bool = False):
        self._clock(t)
        return True

    def key(self, e: int) -> tuple:
        raise NotImplementedError

    def victim(self, candidates):
        return min(candidates, key=lambda e: (e in self.fresh, *self.key(e)))

    def choose(self, owner, pinned):
        if not self.ranking:
            self.set_ranking(True)
        heap, entry = self.heap, self.entry
        aside, victim = [], -1
        while heap:
            x = heap[0]
            e = x[3]
            if entry[e] is not x:
                heapq.heappop(heap)
            elif e in pinned:
                aside.append(heapq.heappop(heap))
            else:
                victim = e
                break
        for x in aside:
            heapq.heappush(heap, x)
        if victim < 0 and self.fresh:  # every older candidate pinned: the least of this step's inserts
            free = [x for e, x in self.fresh.items() if e not in pinned]
            if free:
                victim = min(free)[3]
        return victim


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
        self.lam = -math.log(decay)  # rank = log(score) + t_score * lam (module doc)
        self.score = [0.0] * self.num_experts
        self.t_score = [0] * self.num_experts

    def note(self, e, t):
        self.score[e] = self.score[e] * self.decay ** (t - self.t_score[e]) + 1.0
        self.t_score[e] = t

    def touch(self, e, t):  # _Scored.touch with note and the heap entry inlined (the hot path)
        if t > self.now:
            self._clock(t)
        self.fresh.pop(e, None)
        self.last_use[e] = t
        s = self.score[e] = self.score[e] * self.decay ** (t - self.t_score[e]) + 1.0
        self.t_score[e] = t
        if self.ranking and e in self.resident:
            so = self.slot_of
            x = self.entry[e] = (
                s if self.lam == 0.0 else math.log(s) + t * self.lam,
                t,
                so[e] if so is not None else e,
                e,
            )
            heapq.heappush(self.heap, x)
            if len(self.heap) > 4 * len(self.resident) + 64:
                self._rebuild()

    def rank(self, e):
        return self.rank_of(self.score[e], self.t_score[e])

    def _entry(self, e):  # _Scored._entry with rank inlined (the hot path)
        s, so = self.score[e], self.slot_of
        r = s if self.lam == 0.0 else (math.log(s) + self.t_score[e] * self.lam if s > 0 else -math.inf)
        return (r, self.last_use[e], so[e] if so is not None else e, e)

    def rank_of(self, s: float, t: int) -> float:
        """The heap key of score s last raised at time t (orders like s decayed to any common time)."""
        if self.lam == 0.0:
            return s
        return math.log(s) + t * self.lam if s > 0 else -math.inf

    def key(self, e):
        return (self.score[e] * self.decay ** (self.now - self.t_score[e]), self.last_use[e])


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
            self.count = stats[self.layer].tolist()
        else:
            self.count = [0.0] * self.num_experts
        self.t0: int | None = None
        self._update_hot()

    def _update_hot(self):
        order = np.argsort(-np.asarray(self.count), kind="stable")
        self.hot = set(order[: self.capacity].tolist())

    def _tick(self, t):
        if self.t0 is None:
            self.t0 = t
        if not self.frozen and t - self.t0 >= self.warmup:
            self.frozen = True
            self._update_hot()

    def note(self, e, t):
        self._tick(t)
        if not self.frozen:
            self.count[e] += 1

    def admit(self, e, t, prefetch: bool = False):
        super().admit(e, t)
        self._tick(t)
        return (not self.frozen) or e in self.hot or len(self.resident) < self.capacity

    def rank(self, e):
        return self.count[e]

    def key(self, e):
        return (self.count[e], self.last_use[e])


@register("lfru-admit")
class LFRUAdmit(LFRU):
    """Best online policy found on real traces: lfru (decay 0.95) plus a
    TinyLFU-like admission filter.

    Eviction: as lfru (lowest decayed use score, ties least recent).
    Admission: while a slot is free, admit. When every slot is taken, a missed
    (or prefetched) expert e is admitted only if f(e) + 1 >= min over residents r
    of f(r), all scores decayed to now (f(e) + 1 is e's score after this use).
    A refused expert is served once from the slower tier and evicts nothing, so a
    one-off expert cannot push out a steadily used one (the minimum is the heap's top).
    `admit(e, t, prefetch=True)` always admits (a prefetch is predictor-informed).
    A refused use still raises e's score, so an expert asked for again and again gets in.

    Tuned on tinymoe-py16 traces (bench/trace_tinymoe.py): decay 0.95 was the best
    of 0.7..0.99 on the tuning trace and held on a second held-out trace. Because
    it may bypass, its hit rate can exceed demand-caching MIN.
    """

    def __init__(self, decay: float = 0.95, **kw):
        super().__init__(decay=decay, **kw)

    def admit(self, e, t, prefetch: bool = False):
        self._clock(t)
        if prefetch or len(self.resident) < self.capacity:
            return True
        mine = self.score[e] * self.decay ** (t - self.t_score[e]) + 1.0
        if not self.ranking:
            self.set_ranking(True)
        top = self._top()
        least = min(
            [x[0] for x in self.fresh.values()] + ([top[0]] if top is not None else []), default=math.inf
        )
        if self.rank_of(mine, t) >= least:
            return True
        self.score[e], self.t_score[e] = mine, t  # a refused use still counts (as TinyLFU's sketch)
        return False


class _Ghost:
    """A cache of `capacity` slots run by `policy` on the uses it is shown, for its hit count only
    (SlotTable's access semantics: a hit or a placed miss is pinned until `unpin_all`)."""

    __slots__ = ("free", "owner", "pinned", "policy", "slot_of")

    def __init__(self, num_experts: int, capacity: int, policy: Policy):
        self.policy = policy
        self.slot_of = [-1] * num_experts
        self.owner = [-1] * capacity
        self.free = list(range(capacity - 1, -1, -1))
        self.pinned: set[int] = set()
        policy.bind(self.slot_of)

    def access(self, e: int, t: int) -> bool:
        p = self.policy
        if self.slot_of[e] >= 0:
            p.touch(e, t)
            self.pinned.add(e)
            return True
        if not p.admit(e, t):
            return False
        if self.free:
            s = self.free.pop()
        else:
            v = p.choose(self.owner, self.pinned)
            if v < 0:
                return False
            s = self.slot_of[v]
            self.slot_of[v] = -1
            p.remove(v)
        self.slot_of[e], self.owner[s] = s, e
        p.insert(e, t)
        p.touch(e, t)
        self.pinned.add(e)
        return False


class _GhostLFRU:
    """_Ghost of an lfru-family policy (lfru, lfu, lfru-admit: `decay`, `admission`) with the policy
    inlined: the same decisions as _Ghost(LFRU(...)) (a ghost never holds a fresh expert: each
    placement is used at once), in one call per step."""

    def __init__(self, num_experts: int, capacity: int, decay: float, admission: bool):
        self.decay, self.lam, self.admission = decay, -math.log(decay), admission
        self.capacity = capacity
        self.score = [0.0] * num_experts
        self.t_score = [0] * num_experts
        self.last_use = [-math.inf] * num_experts
        self.slot_of = [-1] * num_experts
        self.entry: list[tuple | None] = [None] * num_experts
        self.free = list(range(capacity - 1, -1, -1))
        self.heap: list[tuple] = []

    def step(self, uses: list[int], t: int) -> int:
        """The uses of one step at time t, in order -> how many hit."""
        score, ts, last, slot_of, entry, heap = (
            self.score,
            self.t_score,
            self.last_use,
            self.slot_of,
            self.entry,
            self.heap,
        )
        d, lam, log, push, pop = self.decay, self.lam, math.log, heapq.heappush, heapq.heappop
        pinned: set[int] = set()
        hits = 0
        for e in uses:
            s = slot_of[e]
            if s >= 0:
                hits += 1
            else:
                if self.admission and not self.free:  # lfru-admit's filter against the least resident
                    mine = score[e] * d ** (t - ts[e]) + 1.0
                    while entry[heap[0][3]] is not heap[0]:
                        pop(heap)
                    if (mine if lam == 0.0 else log(mine) + t * lam) < heap[0][0]:
                        score[e], ts[e] = mine, t
                        continue
                if self.free:
                    s = self.free.pop()
                else:
                    aside, v = [], -1
                    while heap:
                        x = heap[0]
                        if entry[x[3]] is not x:
                            pop(heap)
                        elif x[3] in pinned:
                            aside.append(pop(heap))
                        else:
                            v = x[3]
                            break
                    for x in aside:
                        push(heap, x)
                    if v < 0:  # every slot pinned
                        continue
                    s = slot_of[v]
                    slot_of[v], entry[v] = -1, None
                slot_of[e] = s
            sc = score[e] = score[e] * d ** (t - ts[e]) + 1.0
            ts[e], last[e] = t, t
            x = entry[e] = (sc if lam == 0.0 else log(sc) + t * lam, t, s, e)
            push(heap, x)
            pinned.add(e)
        if len(heap) > 4 * self.capacity + 64:
            live = [x for x in entry if x is not None]
            heapq.heapify(live)
            self.heap = live
        return hits


def ghost_sample(num_experts: int, capacity: int, cap_experts: int = GHOST_SAMPLE_EXPERTS) -> int:
    """R: adaptive's ghosts watch the experts e with hash(e) % R == 0 (about num_experts / R of them).
    R = 1 (every expert) up to cap_experts experts; above, halved until about cap_experts / 2 are
    watched, as long as the ghosts keep at least 8 slots (capacity / R)."""
    r = 1
    while num_experts > cap_experts and num_experts > r * (cap_experts // 2) and capacity >= 16 * r:
        r *= 2
    return r


def _hash(e: int) -> int:
    return (e * 2654435761) >> 7 & 0xFFFF  # Knuth's multiplicative hash: spreads consecutive ids


@register("adaptive")
class Adaptive(Policy):
    """Follows whichever candidate policy would have hit most on this layer's recent uses.

    Each candidate ranks the real slots (it sees every touch, insert and remove; only the leader
    keeps its heap) and also drives a ghost cache of the same capacity fed with the same uses (a
    use: a touch, or a refused miss); ghost hits decay by `decay` per step. admit and victim go to
    the leader. Above `GHOST_SAMPLE_EXPERTS` experts the ghosts see a hashed 1/R sample of the
    experts with capacity / R slots (`ghost_sample`). Why: the admission filter of lfru-admit is
    the best on the trained top-2 traces and the worst on a top-8 trace with topic shifts, where
    plain lfru leads; on stationary Zipf skews full-history lfu leads (README, "Policies against the
    optimum": bench/policy_bench.py, untuned traces).
    """

    def __init__(
        self,
        candidates=("lfru-admit", "lfru", "lfu"),
        decay: float = 0.98,
        ghost_experts: int = GHOST_SAMPLE_EXPERTS,
        **kw,
    ):
        super().__init__(**kw)
        E, cap = self.num_experts, self.capacity
        args = {"num_experts": E, "layer": self.layer, "stats": kw.get("stats")}
        self.rankers = [make_policy(n, capacity=cap, **args) for n in candidates]
        r = ghost_sample(E, cap, ghost_experts)
        self.watched = [r == 1 or _hash(e) % r == 0 for e in range(E)]
        gcap = cap if r == 1 else max(1, round(cap * sum(self.watched) / E))  # scaled by the watched share
        self.ghosts = [self._ghost(n, gcap, args) for n in candidates]
        self.step_uses: list[int] = []  # this step's watched uses, shown to the ghosts when the step ends
        self.score = [0.0] * len(candidates)
        self.decay, self.t, self.leader, self.pending, self.pending_t = decay, None, 0, -1, None
        self.lead, self.followers = self.rankers[0], self.rankers[1:]
        for k, rk in enumerate(self.rankers):
            rk.set_ranking(k == 0)
        # scored candidates see the same touches, inserts and removes: they share last_use, resident and
        # fresh (kept by the leader), and a follower only updates its own score on a use
        self.shared = all(isinstance(r, _Scored) and not isinstance(r, MIN) for r in self.rankers)
        if self.shared:
            r0 = self.rankers[0]
            for r in self.rankers[1:]:
                r.last_use, r.resident, r.fresh = r0.last_use, r0.resident, r0.fresh

    @staticmethod
    def _ghost(name: str, capacity: int, args: dict):
        p = make_policy(name, capacity=capacity, **args)
        if type(p) in (LFRU, LFU, LFRUAdmit):
            return _GhostLFRU(p.num_experts, capacity, p.decay, admission=isinstance(p, LFRUAdmit))
        return _Ghost(p.num_experts, capacity, p)

    def bind(self, slot_of):
        super().bind(slot_of)
        for r in self.rankers:
            r.bind(slot_of)

    def _lead(self, lead: int) -> None:
        old, new = self.rankers[self.leader], self.rankers[lead]
        old.set_ranking(False)
        if self.shared:
            new.now = old.now
        elif isinstance(new, _Scored):
            new._clock(self.t)  # a follower's clock lags: drop its stale fresh marks first
        new.set_ranking(True)
        self.leader, self.lead = lead, new
        self.followers = [r for r in self.rankers if r is not new]

    def _step(self, t: int) -> None:
        """A new step at time t: the ghosts see the last step's uses, the scores decay, the leader is picked."""
        if self.step_uses:  # the ghosts' hits only count when the leader is picked: once a step
            sc, uses = self.score, self.step_uses
            for k, g in enumerate(self.ghosts):
                if isinstance(g, _GhostLFRU):
                    sc[k] += g.step(uses, self.t)
                else:
                    g.pinned.clear()
                    sc[k] += sum(g.access(u, self.t) for u in uses)
            uses.clear()
        if self.t is not None:
            d = self.decay ** (t - self.t)
            self.score = sc = [x * d for x in self.score]
            lead = max(range(len(sc)), key=lambda k: (sc[k], -k))
            if lead != self.leader:
                self._lead(lead)
        self.t = t

    def touch(self, e, t):
        if self.pending != e or self.pending_t != t:  # else a miss counted by admit already
            if t != self.t:
                self._step(t)
            if self.watched[e]:
                self.step_uses.append(e)
        self.pending = -1
        self.lead.touch(e, t)
        if self.shared:
            for r in self.followers:
                r.note(e, t)
        else:
            for r in self.followers:
                r.touch(e, t)

    def insert(self, e, t):
        self.lead.insert(e, t)
        if not self.shared:
            for r in self.followers:
                r.insert(e, t)

    def remove(self, e):
        self.lead.remove(e)
        if not self.shared:
            for r in self.followers:
                r.remove(e)

    def admit(self, e, t, prefetch: bool = False):
        if not prefetch:
            if t != self.t:
                self._step(t)
            if self.watched[e]:
                self.step_uses.append(e)
            self.pending, self.pending_t = e, t
        if not self.shared:
            for r in self.followers:
                if isinstance(r, _Scored):
                    r._clock(t)  # keeps its clock; only the leader decides
        return self.lead.admit(e, t, prefetch=prefetch)

    def victim(self, candidates):
        return self.rankers[self.leader].victim(candidates)

    def choose(self, owner, pinned):
        return self.rankers[self.leader].choose(owner, pinned)


# "python": the Python policies everywhere; else the C++ core where it applies
NATIVE_ENV = "EXPERTCACHE_PLANNER"


def native_core(policy: Policy):
    """The C++ core (kernels/csrc/planner_core.cpp `PlannerCore`) making `policy`'s decisions, or None
    where it has none: lru, lfru, lfu, lfru-admit, and adaptive whose candidates are lfru-family
    policies (static and min stay in Python), and only when the C++ kernels load and
    EXPERTCACHE_PLANNER is not "python". The core starts empty (a policy nothing was shown yet)."""
    import os

    if os.environ.get(NATIVE_ENV, "").lower() == "python":
        return None
    from ..kernels.build import extension

    ext = extension()
    core = getattr(ext, "PlannerCore", None)
    if core is None:
        return None
    E, cap = policy.num_experts, policy.capacity
    if type(policy) is LRU:
        return core.lru(E)
    if type(policy) in (LFRU, LFU, LFRUAdmit):
        return core.scored(E, cap, policy.decay, policy.lam, isinstance(policy, LFRUAdmit))
    r = getattr(policy, "rankers", ())
    if (
        type(policy) is Adaptive
        and policy.shared
        and all(type(x) in (LFRU, LFU, LFRUAdmit) for x in r)
        and all(type(g) is _GhostLFRU for g in policy.ghosts)
    ):
        return core.adaptive(
            E,
            cap,
            [x.decay for x in r],
            [x.lam for x in r],
            [isinstance(x, LFRUAdmit) for x in r],
            policy.decay,
            policy.watched,
            policy.ghosts[0].capacity,
        )
    return None


class NativePolicy(Policy):
    """A registry policy whose decisions the C++ core makes (`native_core`): the same placements,
    victims and refusals as the Python policy (tests/experts/test_planner.py), at a fraction of the
    host time. The SlotTable calls reach the core one by one; StepPlanner.plan_step hands it a whole
    layer step in one call (`core.step`). `name` is the Python policy's."""

    def __init__(self, policy: Policy, core):
        super().__init__(policy.num_experts, policy.capacity, policy.layer)
        self.name, self.core = policy.name, core

    def touch(self, e, t):
        self.core.touch(e, t)

    def insert(self, e, t):
        self.core.insert(e, t, self.slot_of[e])  # the table wrote e's slot before calling insert

    def remove(self, e):
        self.core.remove(e)

    def admit(self, e, t, prefetch: bool = False):
        return self.core.admit(e, t, prefetch)

    def choose(self, owner, pinned):
        return self.core.choose(list(pinned))

    def victim(self, candidates):
        raise NotImplementedError("NativePolicy decides through choose (the SlotTable's call)")


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
    is its first use at time >= t. (Replay only: its victim is a scan over the slots.)
    """

    def __init__(self, oracle: NextUse | None = None, **kw):
        super().__init__(**kw)
        if oracle is None:
            raise ValueError(
                "min: needs a next-use oracle (future knowledge); it exists only in trace replay"
            )
        self.oracle = oracle
        self.ranking = False  # keys change with time: no heap

    def set_ranking(self, on):
        pass

    def key(self, e):
        return (-self.oracle.next_use(e, self.now), e)

    def victim(self, candidates):
        return min(candidates, key=self.key)

    def choose(self, owner, pinned):
        return Policy.choose(self, owner, pinned)
