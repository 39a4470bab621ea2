"""The step planner: every cache decision of one MoE layer's step, made in one place.

The engine (experts.manager.TieredExperts) and trace replay (trace.replay) both drive a
`StepPlanner` with the same inputs, so replay is the engine with every feature on (prefill
admission, CPU-computed misses, waves, exclusive tiers, a partial host tier, prefetch, the
prefetch gate). The planner changes table state and counters only; it never touches a byte.
The engine then carries a plan out: issue the byte movement, compute the hits while it is in
flight, wait, compute the rest.

One layer's step (`plan_step`), given the step's distinct experts in order of first
appearance with their token counts:
1. every expert of the step that is resident in the device tier is a hit and is pinned
   *before any victim is chosen*, so a miss never evicts an expert the same step needs;
2. each miss, in order: computed on the CPU from its host copy when the cost model says so
   (`cpu_compute`), else given a device slot (its victim: an unpinned, i.e. not-this-step,
   expert); a prefill step (more than `prefill_admit_tokens` rows) only takes free slots; a
   miss with no slot (every slot pinned, admission refused, prefill) is an off-slot "wave";
   with cpu_compute "cost", a miss the cost model sends to the CPU (`cpu_faster(tokens, first)`:
   this step's latency; the first CPU expert of the step pays the CPU job's fixed cost) is still
   admitted into a device slot when the layer's policy predicts reuse (its `admit`, through
   SlotTable.access): the copy runs beside the CPU job, and the next use is
   a hit (`Fill.on_cpu`); otherwise it is computed on the CPU and not cached;
3. host copies of the misses: host-resident ones are pinned first, then the rest get a host
   slot (read from disk), or none when every host slot is pinned (a transient read at use; a
   fill of a `direct` device tier then reads from disk straight into its device slot);
4. exclusive tiers: each expert a fill evicted is demoted into a host slot (its bytes copied
   back before the fill overwrites them); at `end_step` a promoted expert leaves the host tier.
`plan_prefetch` places the predicted experts of a layer before that layer runs ("device":
device + host slots; "host": disk reads into host slots only), behind a per-layer PrefetchGate:
every predicted expert already resident (in the device tier and the host tier alike) is pinned
before any placement, and each placed one as it is placed, so no prediction evicts another (that
one would be loaded again in the same step); these pins end with plan_prefetch.

Counters (experts.stats.LayerCounters) are counted here, bytes included, so the engine's and
replay's agree by construction; the engine adds nothing to them.

The device tier's policy decides in C++ where it can (experts/policy.py `native_core`: lru, lfru, lfu,
lfru-admit, adaptive; `native` of StepPlanner): a step's table accesses are one call (`_accesses`), and
the SlotTable is updated from the answer; the Python policies make the same decisions (the reference,
and the code for static, min, `native=False` or a build without the C++ kernels).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..cost.model import ExpertCost
from .policy import NativePolicy, NextUse, make_policy, native_core
from .prefetch import PrefetchGate, most_predicted
from .slots import SlotTable
from .stats import LayerCounters


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner needs to know about the tiers (all validated by the caller).

    host_slots: None = every expert in host RAM (no host table); 0 = no host tier (low memory).
    cpu_compute: "always" | "never" | "cost" (per miss, `cpu_faster(tokens)` decides).
    prefetch: "device" | "host" | "off" (resolved; experts.prefetch.resolve_prefetch).
    direct: device slots keep the stored format on the CPU, so disk can read straight into them.
    staged_waves: an off-slot wave copies the expert into a staging slot (CUDA), counted as moved.
    """

    num_experts: int
    device_slots: int
    host_slots: int | None
    expert_bytes: int
    policy: str = "lru"
    cpu_compute: str = "never"
    prefetch: str = "off"
    prefill_admit_tokens: int = 64
    exclusive: bool = False
    direct: bool = False
    staged_waves: bool = False
    gate_threshold: float | None = 0.0
    gate_waste: float = 1.0


class HostSource(NamedTuple):
    """Where a miss's bytes come from: host slot `slot` (after a disk read into it when `read`);
    slot -1: no host slot could be had, read from disk into a transient buffer at use."""

    slot: int
    read: bool

    @property
    def transient(self) -> bool:
        return self.slot < 0


NO_HOST = HostSource(-1, False)  # no host tier: a transient read at use


class Fill(NamedTuple):
    """Miss placed in device slot `slot` (evicting `evicted`, -1 none); src None: disk -> slot directly.
    on_cpu: admitted but computed on the CPU this step from its host copy (the copy into the slot
    is off the step's critical path; the next use is a hit)."""

    expert: int
    slot: int
    evicted: int
    src: HostSource | None
    on_cpu: bool = False


class OffSlot(NamedTuple):
    """Miss computed without a device slot: on the CPU from its host copy, or as a wave."""

    expert: int
    on_cpu: bool
    src: HostSource


class Demotion(NamedTuple):
    """Exclusive tiers: copy device slot `dev_slot` (expert `expert`) back into host slot `host_slot`."""

    expert: int
    dev_slot: int
    host_slot: int


class Prefetch(NamedTuple):
    """A predicted expert placed ahead: device slot `slot` (-1 for a host-only read-ahead) and its
    host source (None: disk straight into the device slot)."""

    expert: int
    slot: int
    evicted: int
    src: HostSource | None


@dataclass
class StepPlan:
    """One layer's step. Execution order: demotions (before any fill overwrites a slot), the
    reads of fills/off-slot sources, hits (computed while reads are in flight), fills, off-slot."""

    hits: list[tuple[int, int]] = field(default_factory=list)  # (expert, device slot)
    fills: list[Fill] = field(default_factory=list)
    off_slot: list[OffSlot] = field(default_factory=list)
    demotions: list[Demotion] = field(default_factory=list)

    def fetched(self) -> list[int]:
        """Experts whose bytes this step brings to the compute tier (each at most once)."""
        return [f.expert for f in self.fills] + [o.expert for o in self.off_slot]


def _pin_resident(table: SlotTable, experts: list[int]) -> list[int]:
    """Pin the experts of `experts` resident in `table` (and not pinned already) -> those pinned."""
    pins = [e for e in experts if e in table and e not in table.pinned]
    table.pinned.update(pins)
    return pins


def _pin(table: SlotTable, e: int, pins: list[int]) -> None:
    if e not in table.pinned:
        table.pinned.add(e)
        pins.append(e)


class LayerState:
    """One MoE layer's cache state in every tier: device and host tables, what prefetch put where,
    and the prefetch gate's accounting for the layer's next step."""

    def __init__(
        self,
        cfg: PlannerConfig,
        layer: int,
        stats=None,
        oracle: NextUse | None = None,
        native: bool | None = None,
        **params,
    ):
        E = cfg.num_experts
        policy = make_policy(cfg.policy, E, cfg.device_slots, layer, stats, oracle=oracle, **params)
        core = native_core(policy) if native is not False and cfg.device_slots > 0 else None
        if native and core is None:
            raise ValueError(
                f"native=True: no C++ planner core for policy {cfg.policy!r} here (lru, lfru, lfu, lfru-admit "
                "and adaptive have one, with the C++ kernels loaded and EXPERTCACHE_PLANNER unset)"
            )
        # the device table's policy; `core` (or None): its C++ core, handed a whole step in plan_step
        self.core = core
        self.device = SlotTable(E, cfg.device_slots, policy if core is None else NativePolicy(policy, core))
        partial = cfg.host_slots is not None and cfg.host_slots > 0
        self.host = (
            SlotTable(E, cfg.host_slots, make_policy("lru", E, cfg.host_slots, layer)) if partial else None
        )
        self.prefetched: set[int] = set()  # device prefetches not yet used
        self.host_prefetched: set[int] = set()
        self.pf_evicted: set[int] = set()  # experts this step's prefetches evicted
        self.issued = self.used = self.harm = 0
        self.counters = LayerCounters()


class StepPlanner:
    """Plans every layer's steps (see module doc); `layers[i]` is the state of MoE layer index i."""

    def __init__(
        self,
        cfg: PlannerConfig,
        num_layers: int,
        stats=None,
        cpu_faster: Callable[[int], bool] | None = None,
        oracles: list[NextUse] | None = None,
        native: bool | None = None,
        **policy_params,
    ):
        """`native`: the device tables' decisions by the C++ core (policy.native_core): None where one
        applies, True required (ValueError where none does), False never (the Python policies)."""
        if cfg.cpu_compute not in ("always", "never", "cost"):
            raise ValueError(f"cpu_compute must be always, never or cost, got {cfg.cpu_compute!r}")
        if cfg.cpu_compute == "cost" and cpu_faster is None:
            raise ValueError("cpu_compute='cost' needs the cost model's cpu_faster(tokens)")
        self.cfg, self.cpu_faster = cfg, cpu_faster
        self.layers = [
            LayerState(cfg, i, stats, oracle=oracles[i] if oracles else None, native=native, **policy_params)
            for i in range(num_layers)
        ]
        self.native = any(st.core is not None for st in self.layers)
        # which code decides (benchmarks print it): "native" (the C++ core) or "python"
        self.implementation = "native" if self.native else "python"
        self.gate = PrefetchGate(num_layers, cfg.gate_threshold, waste=cfg.gate_waste)
        # every expert in host RAM (host_slots None): expert e's source is host slot e, made once
        self.in_ram = (
            [HostSource(e, False) for e in range(cfg.num_experts)] if cfg.host_slots is None else None
        )

    @property
    def cpu_faster(self) -> Callable[..., bool] | None:
        return self._cpu_faster

    @cpu_faster.setter
    def cpu_faster(self, rule: Callable[..., bool] | None) -> None:
        # a rule that takes `first` (cost.model.ExpertCost.cpu_faster) prices the CPU job's fixed cost
        # on the step's first CPU expert; a plain rows -> bool rule is asked with the rows only
        self._cpu_faster = rule
        self.priced_first = rule is not None and "first" in inspect.signature(rule).parameters
        # ExpertCost's rule is a pure function of (rows, first) (its profile is frozen): asked once per pair
        self.cpu_memo: dict[tuple[int, bool], bool] | None = (
            {} if isinstance(getattr(rule, "__self__", None), ExpertCost) else None
        )

    def _cpu(self, rows: int, first: bool) -> bool:
        memo = self.cpu_memo
        if memo is None:
            return self._cpu_faster(rows, first=first) if self.priced_first else self._cpu_faster(rows)
        got = memo.get((rows, first))
        if got is None:
            got = memo[(rows, first)] = (
                self._cpu_faster(rows, first=first) if self.priced_first else self._cpu_faster(rows)
            )
        return got

    # -- one step ---------------------------------------------------------------------------------
    def plan_step(self, i: int, experts: list[int], tokens: list[int], rows: int, t: int) -> StepPlan:
        """Layer i's step at time t: `experts` distinct (first-appearance order), `tokens[j]` the
        rows routed to experts[j], `rows` the step's token count."""
        cfg, st = self.cfg, self.layers[i]
        c, table, plan = st.counters, st.device, StepPlan()
        slot_of, hit_list, misses = table.slot_of, plan.hits, []
        for e, n in zip(experts, tokens):  # every resident expert of the step is pinned first
            s = slot_of[e]
            if s >= 0:
                hit_list.append((e, s))
                c.hits += 1
                if e in st.prefetched:
                    c.prefetch_useful += 1
                    st.used += 1
                    st.prefetched.discard(e)
            else:
                misses.append((e, n))
        admit = rows <= cfg.prefill_admit_tokens
        # per miss: computed on the CPU?, and its table mode (0 bypassed, 1 accessed, 2 only into a free slot)
        cpus, modes = [], []
        job = False  # an expert of this step already goes to the CPU (its job's fixed cost is paid)
        always = cfg.cpu_compute == "always"
        for e, n in misses:
            if cfg.cpu_compute == "cost":
                cpu = self._cpu(n, not job)
                job = job or cpu
            else:
                cpu = always
            cpus.append(cpu)
            modes.append(0 if cpu and always else 1 if admit else 2)
        placed = self._accesses(st, hit_list, misses, modes, t)
        if not misses:
            return plan
        fills: list[tuple[int, int, int, bool]] = []
        offs: list[tuple[int, bool]] = []
        pf_evicted = st.pf_evicted if cfg.prefetch == "device" else ()
        on_cpu_n = admitted = 0
        for (e, _), cpu, (slot, evicted) in zip(misses, cpus, placed):
            if e in pf_evicted:
                st.harm += 1
            on_cpu_n += cpu
            if slot < 0:  # bypassed (-2: CPU always, or no free slot at prefill) or not placed (-1)
                offs.append((e, cpu))
                continue
            if evicted >= 0:
                st.prefetched.discard(evicted)
            admitted += cpu  # cost: admitted where the policy predicts reuse, even if computed on the CPU
            fills.append((e, slot, evicted, cpu))
        c.misses += len(misses)
        c.cpu_computed += on_cpu_n
        c.cpu_admitted += admitted
        src = self._host_sources(st, [f[0] for f in fills] + [e for e, _ in offs], t)
        if cfg.exclusive:  # after the misses pinned their host slots
            for _, s, ev, _ in fills:
                if ev >= 0:
                    d = self._demote(st, ev, s, t)
                    if d is not None:
                        plan.demotions.append(d)
        nb, direct, disk = cfg.expert_bytes, cfg.direct, 0
        out = plan.fills
        for e, s, ev, on_cpu in fills:
            h = src[e]
            if h.slot < 0 and direct and not on_cpu:  # no host slot: disk straight into the device slot
                h = None
            disk += h is None or h.read or h.slot < 0
            out.append(Fill(e, s, ev, h, on_cpu))
        c.bytes_moved += nb * len(fills)
        out = plan.off_slot
        for e, on_cpu in offs:
            h = src[e]
            disk += h.read or h.slot < 0
            if not on_cpu:
                c.waves += 1
                c.bytes_moved += nb * cfg.staged_waves
            out.append(OffSlot(e, on_cpu, h))
        c.disk_bytes += nb * disk
        return plan

    @staticmethod
    def _accesses(st: LayerState, hits, misses, modes, t: int) -> list[tuple[int, int]]:
        """The device table's accesses of one step in order: every hit (touched, pinned), then each miss
        by its mode (0 bypassed, 1 accessed, 2 accessed while a free slot is left, else bypassed) ->
        per miss (slot, evicted): slot -2 bypassed, -1 not placed. One call into the C++ core where
        the layer has one (the table then updated from its answer), else the SlotTable's calls."""
        table, core = st.device, st.core
        if core is None:
            out = []
            for e, _ in hits:
                table.access(e, t)
            for (e, _), mode in zip(misses, modes):
                if mode == 0 or (mode == 2 and not table.free):
                    table.bypass(e, t)
                    out.append((-2, -1))
                else:
                    a = table.access(e, t)
                    out.append((a.slot, a.evicted))
            return out
        hit_e = [e for e, _ in hits]
        got = core.step(hit_e, [e for e, _ in misses], modes, table.free, list(table.pinned), t)
        slot_of, owner, pinned = table.slot_of, table.owner, table.pinned
        table.hits += len(hit_e)
        table.misses += len(misses)
        pinned.update(hit_e)
        out = []
        for j, (e, _) in enumerate(misses):
            s, ev = got[2 * j], got[2 * j + 1]
            out.append((s, ev))
            if s >= 0:
                if ev >= 0:
                    slot_of[ev] = -1
                slot_of[e], owner[s] = s, e
                pinned.add(e)
        if got[-1]:
            del table.free[len(table.free) - got[-1] :]
        return out

    def end_step(self, i: int, plan: StepPlan) -> None:
        """Layer i's step is computed: unpin, forget prefetch marks, promoted experts leave the host
        tier (exclusive), the gate learns from this step."""
        st = self.layers[i]
        st.device.unpin_all()
        st.prefetched.clear()  # "useful" = prefetched for this step and used in it
        if st.host is not None:
            st.host.unpin_all()
            st.host_prefetched.clear()
            for f in plan.fills if self.cfg.exclusive else []:
                st.host.drop(f.expert)
        self.gate.update(i, st.issued, st.used, st.harm)
        st.issued = st.used = st.harm = 0
        st.pf_evicted.clear()

    def _host_sources(self, st: LayerState, experts: list[int], t: int) -> dict[int, HostSource]:
        """Host slots of a step's misses, pinned: the host-resident ones first (so no miss evicts a
        host copy this step needs), then the rest."""
        if self.cfg.host_slots is None:
            every = self.in_ram
            return {e: every[e] for e in experts}
        if st.host is None:
            return dict.fromkeys(experts, NO_HOST)
        c, host, out = st.counters, st.host, {}
        for e in sorted(experts, key=lambda e: e not in host):  # stable: hits first, in order
            if e in st.pf_evicted and self.cfg.prefetch == "host":
                st.harm += e not in host
            a = host.access(e, t, pin=True)
            c.host_hits += a.hit
            c.host_misses += not a.hit
            if a.hit and e in st.host_prefetched:
                c.host_prefetch_useful += 1
                st.used += 1
            if a.slot >= 0 and not a.hit:
                st.host_prefetched.discard(a.evicted)
            out[e] = HostSource(a.slot, a.slot >= 0 and not a.hit)
        return out

    def _demote(self, st: LayerState, e: int, dev_slot: int, t: int) -> Demotion | None:
        """e leaves device slot dev_slot: keep its bytes in a host slot (None: already there, or none free)."""
        a = st.host.insert(e, t)
        if a.slot < 0 or a.hit:
            return None
        st.host_prefetched.discard(a.evicted)
        st.counters.demoted += 1
        return Demotion(e, dev_slot, a.slot)

    # -- prefetch ---------------------------------------------------------------------------------
    def plan_prefetch(self, i: int, predicted: list[int], rows: int, t: int) -> list[Prefetch | Demotion]:
        """Place layer i's predicted experts (flat, -1 skipped) before its step at time t. Carried out
        in list order: a Demotion copies an evicted expert's bytes out before its slot is refilled."""
        cfg, st = self.cfg, self.layers[i]
        if cfg.prefetch == "off" or rows > cfg.prefill_admit_tokens or not self.gate.allow(i):
            return []  # a prefill is not admitted into the slots, so nothing is fetched ahead for it
        c, out = st.counters, []
        order = most_predicted(predicted)
        dev, host = st.device, st.host
        if cfg.prefetch == "host":
            order = [e for e in order[: cfg.host_slots] if e not in dev]
            pins = _pin_resident(host, order)  # before any placement: no prediction evicts another
            try:
                for e in order:
                    a = host.insert(e, t)
                    if a.slot < 0 or a.hit:
                        continue
                    _pin(host, e, pins)
                    st.host_prefetched.discard(a.evicted)
                    if a.evicted >= 0:
                        st.pf_evicted.add(a.evicted)
                    st.host_prefetched.add(e)
                    c.host_prefetch_issued += 1
                    st.issued += 1
                    c.disk_bytes += cfg.expert_bytes
                    out.append(Prefetch(e, -1, -1, HostSource(a.slot, True)))
            finally:
                host.pinned.difference_update(pins)
            return out
        order = order[: cfg.device_slots]
        pins = _pin_resident(dev, order)  # before any placement: no prediction evicts another
        host_pins = _pin_resident(host, order) if host is not None else []
        try:
            for e in order:
                if e in dev:
                    continue
                a = dev.insert(e, t)
                if a.slot < 0:
                    continue
                if a.evicted >= 0:
                    st.prefetched.discard(a.evicted)
                    st.pf_evicted.add(a.evicted)
                    d = self._demote(st, a.evicted, a.slot, t) if cfg.exclusive else None
                    if d is not None:
                        out.append(d)
                if cfg.host_slots is None:
                    h = self.in_ram[e]
                elif host is None:
                    h = NO_HOST
                else:
                    ha = host.insert(e, t)
                    if ha.slot >= 0:
                        _pin(host, e, host_pins)
                        if not ha.hit:
                            st.host_prefetched.discard(ha.evicted)
                    h = HostSource(ha.slot, ha.slot >= 0 and not ha.hit)
                if h.transient and not cfg.direct:  # every host slot pinned: give the device slot back
                    dev.drop(e)
                    continue
                _pin(dev, e, pins)
                st.prefetched.add(e)
                c.prefetch_issued += 1
                st.issued += 1
                c.bytes_moved += cfg.expert_bytes
                c.disk_bytes += cfg.expert_bytes * (h.transient or h.read)
                out.append(Prefetch(e, a.slot, a.evicted, None if h.transient else h))
        finally:  # the step's own pins come from plan_step
            dev.pinned.difference_update(pins)
            if host is not None:
                host.pinned.difference_update(host_pins)
        return out

    # -- warm start -------------------------------------------------------------------------------
    def warm(self, i: int, experts: list[int]) -> list[tuple[int, int]]:
        """Place saved-statistics favourites at startup -> (expert, device slot) to fill; not counted."""
        out = []
        for e in experts[: self.cfg.device_slots]:
            a = self.layers[i].device.insert(e, 0)
            if a.slot >= 0:
                out.append((e, a.slot))
        return out
