"""The MoE layer as an explicit schedule: operations on queues, with the events between them.

The step planner (experts/planner.py) decides; this module turns one layer's StepPlan (and the
next layer's prefetch) into the operations that carry it out. An executor (experts/executor.py)
runs them; a discrete-event evaluation (experts/schedule_time.py) prices them.

Queues (each runs its operations one at a time in issue order, as a CUDA stream does; `io` is a
pool of lanes):

    queue    what runs there                                       on CUDA
    device   dense: the layer's attention + router (pricing only)   the compute stream
             moe: the MoE over device slots (hits, fills, a wave)
             add: the CPU's partial sums into the layer output
    d2h      ids: the step's expert ids -> host (the host waits)    a side stream
             rows: the rows the CPU job needs -> pinned host
             demote: device slot -> host slot (exclusive tiers;
             a CPU device only)
    h2d      h2d: host slot -> device slot (fill, prefetch, wave's   the copy stream
             staging slot)
    cpu      cpu: every CPU-computed expert of the layer, one call   a worker thread
    io       read: disk -> host slot (or device slot when direct)   the I/O pool

Op legend: `waits` are ids of ops issued earlier (an event recorded after each); `slot` the device
slot an op writes (STAGE: the wave's staging slot, one per pool: its events are keyed (-1, STAGE)
whatever the layer), `reads` the device slots a moe / demote op reads, `host_slot` the host slot a
read or demote writes / an h2d reads, `host_reads` those the CPU job (or an unstaged wave) reads;
`experts`, `tokens` the experts an op moves or computes and the rows routed to each.

Waves: `staged` (CUDA) copies the expert into the staging slot and computes from it; unstaged (a
CPU device: the host slot is already where the compute runs) computes from its host bytes, one
moe op reading the host slot. Exclusive tiers: a demotion copies a device slot back into a host
slot before the fill that evicted it overwrites the device slot (the fill waits for it, as for any
reader of its slot).

Rules (tests/experts/test_schedule.py asserts each, `check_rules` states them):
1. the CPU job never waits for the device's compute (only for its rows copy and its host bytes);
2. a write into device slot s waits for the last reader of s (a per-slot event) and its last
   writer, never for a whole queue;
3. the host thread waits for one device op per layer: the ids read (`host_waits`); the add is
   issued once the CPU job is done (a host-side join of host work, not a device wait);
4. a host slot is not rewritten (read or demote op) while a copy or CPU job reading it is queued: the read
   waits for the slot's last reader.
Ops of one layer are issued after its ids read (the host needs them to plan), so every op
implicitly starts after that layer's `ids` op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .planner import Demotion, Fill, HostSource, StepPlan

QUEUES = ("device", "d2h", "h2d", "cpu", "io")
KINDS = {
    "dense": "device",
    "moe": "device",
    "add": "device",
    "ids": "d2h",
    "rows": "d2h",
    "demote": "d2h",
    "h2d": "h2d",
    "cpu": "cpu",
    "read": "io",
}
STAGE = -2  # the staging slot of off-slot waves


def _key(i: int, slot: int) -> tuple[int, int]:
    """A device slot's event key: (layer, slot); the staging slot is one for every layer."""
    return (-1, STAGE) if slot == STAGE else (i, slot)


@dataclass(slots=True)
class Op:
    id: int
    kind: str
    layer: int
    waits: tuple[int, ...] = ()
    experts: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    slot: int = -1  # device slot written (h2d, a direct read) or -1
    reads: tuple[int, ...] = ()  # device slots read (moe)
    host_slot: int = -1  # host slot written (read, demote) or read (h2d); -1 none / transient
    host_reads: tuple[int, ...] = ()  # host slots the CPU job (or an unstaged wave) reads
    tag: str = (
        ""  # moe: hits | fills | all (hits and fills in one) | wave; h2d/read: demand | prefetch | admit
    )

    @property
    def queue(self) -> str:
        return KINDS[self.kind]


@dataclass
class LayerSchedule:
    """One layer's ops in issue order; `ids` the op the host waits for; `add` the op issued after
    the CPU job is joined (None when no expert is computed on the CPU)."""

    layer: int
    ops: list[Op] = field(default_factory=list)
    ids: int = -1
    add: int | None = None

    def of(self, kind: str, tag: str | None = None) -> list[Op]:
        return [o for o in self.ops if o.kind == kind and (tag is None or o.tag == tag)]


class ScheduleBuilder:
    """Issues op ids and keeps, per (layer, device slot), the last op that read it (its readers are
    all on the device queue) and the last that wrote it, and per (layer, host slot) its readers
    since its last write (copies and the CPU job, on two queues) and that write: the per-slot
    events later ops wait on. One per cache; its
    state spans steps (a copy into a slot may wait on a reader of an earlier step)."""

    def __init__(self, staged_waves: bool = True):
        self.staged_waves = staged_waves
        self.next_id = 0
        self.dev_reader: dict[tuple[int, int], int] = {}
        self.dev_writer: dict[tuple[int, int], int] = {}
        # since its last write: the last reader on each queue (h2d, cpu, device; a queue's earlier ones
        # end before it: the executors keep one FIFO per queue)
        self.host_readers: dict[tuple[int, int], dict[str, int]] = {}
        self.host_writer: dict[tuple[int, int], int] = {}

    def _op(self, sched: LayerSchedule, kind: str, waits=(), layer: int | None = None, **kw) -> Op:
        """An op of `sched` (about MoE layer `layer`, default the schedule's: a prefetch's is the next)."""
        if waits:
            if len(waits) == 1:
                waits = () if waits[0] is None else (waits[0],)
            else:
                ws = set(waits)
                ws.discard(None)
                waits = tuple(sorted(ws))
        op = Op(self.next_id, kind, sched.layer if layer is None else layer, waits, **kw)
        self.next_id += 1
        sched.ops.append(op)
        return op

    def _host_bytes(self, sched, i: int, e: int, src: HostSource | None, tag: str):
        """The op after which expert e's host bytes are in (a read into its host slot, a transient
        read, or the slot's last writer) -> (op id or None, host slot)."""
        if src is None:
            return None, -1
        key = (i, src.slot)
        if src.transient or src.read:
            waits = (
                [] if src.transient else [*self.host_readers.pop(key, {}).values(), self.host_writer.get(key)]
            )
            op = self._op(sched, "read", waits, layer=i, experts=(e,), host_slot=src.slot, tag=tag)
            if not src.transient:
                self.host_writer[key] = op.id
            return op.id, src.slot
        return self.host_writer.get(key), src.slot

    def _into_slot(self, sched, i: int, e: int, slot: int, src: HostSource | None, tag: str, got=None) -> int:
        """Expert e's bytes into device slot `slot` of layer i (h2d from its host bytes, or disk
        straight into the slot when src is None) -> the writing op's id. `got`: the host bytes'
        (op, host slot) already issued (an admitted expert the CPU job reads too)."""
        key = _key(i, slot)
        slot_free = [self.dev_reader.get(key), self.dev_writer.get(key)]
        if src is None:  # direct: disk -> device slot
            op = self._op(sched, "read", slot_free, layer=i, experts=(e,), slot=slot, tag=tag)
        else:
            after, hs = got or self._host_bytes(sched, i, e, src, tag)
            op = self._op(
                sched, "h2d", [after, *slot_free], layer=i, experts=(e,), slot=slot, host_slot=hs, tag=tag
            )
            if hs >= 0:
                self.host_readers.setdefault((i, hs), {})["h2d"] = op.id
        self.dev_writer[key] = op.id
        return op.id

    def _moe(
        self, sched, i: int, pairs: list[tuple[int, int]], tokens: dict[int, int], tag: str, waits=()
    ) -> Op:
        experts, slots = zip(*pairs)
        keys = [(i, s) for s in slots] if STAGE not in slots else [_key(i, s) for s in slots]
        w = [x for x in map(self.dev_writer.get, keys) if x is not None]
        if waits:
            w.extend(waits)
        op = self._op(
            sched,
            "moe",
            w,
            experts=experts,
            tokens=tuple(map(tokens.__getitem__, experts)),
            reads=slots,
            tag=tag,
        )
        reader, n = self.dev_reader, op.id
        for k in keys:
            reader[k] = n
        return op

    def _demote(self, sched, i: int, d: Demotion) -> None:
        """Device slot d.dev_slot's bytes back into host slot d.host_slot (before the slot is refilled)."""
        dkey, hkey = (i, d.dev_slot), (i, d.host_slot)
        waits = [
            self.dev_writer.get(dkey),
            *self.host_readers.pop(hkey, {}).values(),
            self.host_writer.get(hkey),
        ]
        op = self._op(
            sched, "demote", waits, layer=i, experts=(d.expert,), reads=(d.dev_slot,), host_slot=d.host_slot
        )
        self.dev_reader[dkey] = op.id  # the fill into the slot waits for it
        self.host_writer[hkey] = op.id

    def _wave(self, sched, i: int, o, n: dict[int, int], got) -> None:
        """An off-slot expert on the device: staged (a copy into the staging slot), or from its host bytes."""
        if self.staged_waves:
            w = self._into_slot(sched, i, o.expert, STAGE, o.src, "wave", got)
            self._moe(sched, i, [(o.expert, STAGE)], n, "wave", [w])
            return
        after, hs = got
        op = self._op(
            sched,
            "moe",
            [after],
            experts=(o.expert,),
            tokens=(n[o.expert],),
            host_reads=(hs,) if hs >= 0 else (),
            tag="wave",
        )
        if hs >= 0:
            self.host_readers.setdefault((i, hs), {})["device"] = op.id

    def layer(
        self,
        i: int,
        plan: StepPlan,
        experts: list[int],
        tokens: list[int],
        prefetch: tuple[int, list] | None = None,
        dense: bool = False,
        merge: bool = False,
    ) -> LayerSchedule:
        """Layer i's step: `plan` from StepPlanner.plan_step for `experts` with `tokens` rows each;
        `prefetch` (layer j, StepPlanner.plan_prefetch's items: Prefetch and Demotion) issued after
        the layer's own copies; `dense`: lead with the layer's dense op (pricing; the engine runs it
        as ordinary code); `merge`: hits and fills in one moe op after the fills' bytes (an executor
        that runs ops in issue order gains nothing from computing the hits first)."""
        sched = LayerSchedule(i)
        d = self._op(sched, "dense", tokens=(max(tokens, default=0),)) if dense else None
        sched.ids = self._op(sched, "ids", (d.id,) if d else ()).id
        if not (plan.fills or plan.off_slot or plan.demotions or (prefetch and prefetch[1])):  # all hits
            if plan.hits:  # every expert of the step, in its order
                self._moe(sched, i, plan.hits, dict(zip(experts, tokens)), "hits")
            return sched
        n = dict(zip(experts, tokens))
        cpu = [o for o in plan.off_slot + plan.fills if o.on_cpu]  # off-slot, or admitted beside the CPU job
        waves = [o for o in plan.off_slot if not o.on_cpu]
        fills = [f for f in plan.fills if not f.on_cpu]
        for dm in plan.demotions:  # before any fill overwrites a device slot
            self._demote(sched, i, dm)
        # demand bytes: CPU experts' host copies first (the CPU job waits for them), then fills
        cpu_src = [self._host_bytes(sched, i, o.expert, o.src, "demand") for o in cpu]
        wave_src = (
            [self._host_bytes(sched, i, o.expert, o.src, "demand") for o in waves]
            if not self.staged_waves
            else [None] * len(waves)
        )
        rows = (
            self._op(
                sched, "rows", experts=tuple(o.expert for o in cpu), tokens=(sum(n[o.expert] for o in cpu),)
            )
            if cpu
            else None
        )
        fill_ops = [self._into_slot(sched, i, f.expert, f.slot, f.src, "demand") for f in fills]
        merged = merge and fills
        if plan.hits and not merged:
            self._moe(sched, i, plan.hits, n, "hits")
        if cpu:
            job = self._op(
                sched,
                "cpu",
                [rows.id, *(a for a, _ in cpu_src)],
                experts=tuple(o.expert for o in cpu),
                tokens=tuple(n[o.expert] for o in cpu),
                host_reads=tuple(hs for _, hs in cpu_src if hs >= 0),
            )
            for _, hs in cpu_src:
                if hs >= 0:
                    self.host_readers.setdefault((i, hs), {})["cpu"] = job.id
        if merged:
            self._moe(sched, i, plan.hits + [(f.expert, f.slot) for f in fills], n, "all", fill_ops)
        elif fills:
            self._moe(sched, i, [(f.expert, f.slot) for f in fills], n, "fills", fill_ops)
        for o, got in zip(cpu, cpu_src):
            if isinstance(o, Fill):  # admitted: its copy runs beside the CPU job, the next use is a hit
                self._into_slot(sched, i, o.expert, o.slot, o.src, "admit", got)
        for o, got in zip(waves, wave_src):
            self._wave(sched, i, o, n, got)
        if prefetch:
            j, items = prefetch
            for p in items:
                if isinstance(p, Demotion):
                    self._demote(sched, j, p)
                elif p.slot < 0:  # host read-ahead only
                    self._host_bytes(sched, j, p.expert, p.src, "prefetch")
                else:
                    self._into_slot(sched, j, p.expert, p.slot, p.src, "prefetch")
        if cpu:
            sched.add = self._op(sched, "add", [job.id], experts=tuple(o.expert for o in cpu)).id
        return sched


def host_waits(sched: LayerSchedule) -> list[int]:
    """The device-side ops the host thread blocks on in this layer: the ids read only."""
    return [sched.ids]


def check_rules(scheds: list[LayerSchedule]) -> None:
    """AssertionError naming the op that breaks a rule of the module doc (ops across `scheds`,
    in issue order)."""
    ops = {o.id: o for s in scheds for o in s.ops}
    prev = queue_order(ops)
    readers: dict[tuple[int, int], list[int]] = {}  # host slot -> its copies / CPU jobs so far
    for s in scheds:
        for o in s.ops:
            assert all(w < o.id for w in o.waits), f"op {o.id} waits on a later op"
            deps = [ops[w] for w in o.waits if w in ops]
            if o.kind == "cpu":
                bad = [w.id for w in deps if w.queue == "device"]
                assert not bad, f"cpu op {o.id} waits on device compute {bad}"
            if o.slot != -1:  # a write into a device slot: only that slot's readers and writers
                for w in deps:
                    ok = (
                        o.slot in w.reads
                        or w.slot == o.slot
                        or (w.kind == "read" and w.host_slot == o.host_slot and w.slot == -1)
                    )
                    assert ok, (
                        f"op {o.id} writing slot {o.slot} waits on op {w.id} ({w.kind}), not of that slot"
                    )
            key = (o.layer, o.host_slot)
            if o.kind in ("read", "demote") and o.host_slot >= 0 and o.slot == -1:
                for r in readers.pop(key, []):
                    assert reaches(ops, prev, o.id, r), (
                        f"read {o.id} into host slot {o.host_slot} may overwrite it while op {r} reads it"
                    )
            elif o.kind == "h2d" and o.host_slot >= 0:
                readers.setdefault(key, []).append(o.id)
            for hs in o.host_reads:
                readers.setdefault((o.layer, hs), []).append(o.id)
        assert host_waits(s) == [s.ids] and ops[s.ids].kind == "ids"


def queue_order(ops: dict[int, Op]) -> dict[int, int]:
    """op id -> the op before it on its queue (io lanes: none)."""
    last: dict[str, int] = {}
    prev = {}
    for i in sorted(ops):
        q = ops[i].queue
        if q != "io" and q in last:
            prev[i] = last[q]
        last[q] = i
    return prev


def reaches(ops: dict[int, Op], prev: dict[int, int], start: int, target: int) -> bool:
    """Does op `start` begin after op `target` ended (through waits, or a queue's order)?"""
    seen, todo = set(), [start]
    while todo:
        x = todo.pop()
        if x == target:
            return True
        if x in seen or x not in ops or x < target:
            continue
        seen.add(x)
        todo.extend(ops[x].waits)
        if x in prev:
            todo.append(prev[x])
    return False
