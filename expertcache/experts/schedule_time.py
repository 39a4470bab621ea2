"""The time of a schedule: a discrete-event evaluation of experts/schedule.py's ops.

Semantics (those of the executors, experts/executor.py): an op starts when every op it waits on
has ended, the op before it on its queue has ended (io: when one of `io_lanes` lanes is free), and
the host has issued it. The host issues a layer's ops after that layer's ids read ended (plus
`host_s` of planning), and its add only after the CPU job ended (the host joins it); the next
layer is issued after that. Given per-op seconds, this gives each op's start and end, the makespan
and the critical path (the chain of ops, each the one that held the next back).

Per-op seconds from a cost profile (`op_seconds`): read = expert bytes / disk; h2d and demote =
link latency + expert bytes / link; moe = sum of gpu_use(tokens) over its experts; cpu = the job's fixed
cost + sum of cpu_use;
rows = link latency + rows * hidden * 2 bytes / link; ids, add = link latency; dense = given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..cost.model import ExpertCost
from .schedule import LayerSchedule, Op


@dataclass
class Timeline:
    start: dict[int, float]
    end: dict[int, float]
    held_by: dict[int, int | None]  # op -> the op whose end let it start (None: it started at 0)
    makespan: float

    def critical_path(self) -> list[int]:
        """Op ids from the first to the last-ending op, each the one that held the next back."""
        if not self.end:
            return []
        x = max(self.end, key=lambda o: (self.end[o], o))
        path = []
        while x is not None:
            path.append(x)
            x = self.held_by[x]
        return path[::-1]

    def order(self) -> list[int]:
        """Op ids by start time (ties: issue order)."""
        return sorted(self.start, key=lambda o: (self.start[o], o))


def evaluate(
    scheds: list[LayerSchedule],
    seconds: Callable[[Op], float],
    io_lanes: int = 4,
    host_s: float = 0.0,
    op_s: float = 0.0,
    issue_s: float = 0.0,
) -> Timeline:
    """Start and end of every op (module doc); `op_s` is added to every op: the executor's
    hand-off from one queue to the next (an event set, a thread woken); `issue_s` is the host's
    time to issue one op (its clock advances by it per op); both measured by the caller."""
    start, end, held = {}, {}, {}
    queue_free: dict[str, tuple[float, int | None]] = {}
    lanes: list[tuple[float, int | None]] = [(0.0, None)] * max(io_lanes, 1)
    host: tuple[float, int | None] = (0.0, None)
    for s in scheds:
        cpu_job = None
        for o in s.ops:
            if o.kind == "add" and cpu_job is not None:
                host = max(host, (end[cpu_job], cpu_job))  # the host joins the CPU job, then issues the add
            host = (host[0] + issue_s, host[1])
            cands = [host] + [(end[w], w) for w in o.waits if w in end]
            if o.queue == "io":
                lane = min(range(len(lanes)), key=lambda k: lanes[k][0])
                cands.append(lanes[lane])
            else:
                cands.append(queue_free.get(o.queue, (0.0, None)))
            t0, by = max(cands, key=lambda c: c[0])
            start[o.id], held[o.id] = t0, (by if t0 > 0 else None)
            end[o.id] = t0 + seconds(o) + op_s
            if o.queue == "io":
                lanes[lane] = (end[o.id], o.id)
            else:
                queue_free[o.queue] = (end[o.id], o.id)
            if o.id == s.ids:
                host = (end[o.id] + host_s, o.id)
            if o.kind == "cpu":
                cpu_job = o.id
    return Timeline(start, end, held, max(end.values(), default=0.0))


def op_seconds(
    cost: ExpertCost, hidden: int, dense_s: float = 0.0, link_latency_s: float = 10e-6, act_bytes: int = 2
) -> Callable[[Op], float]:
    """Per-op seconds under a cost profile (module doc)."""
    link = cost.profile.link_gbs * 1e9

    def sec(o: Op) -> float:
        if o.kind == "dense":
            return dense_s
        if o.kind == "read":
            return cost.disk()
        if o.kind in ("h2d", "demote"):
            return link_latency_s + cost.transfer()
        if o.kind == "moe":
            return sum(cost.gpu_use(n) for n in o.tokens)
        if o.kind == "cpu":
            return cost.cpu_job() + sum(
                cost.cpu_use(n) for n in o.tokens
            )  # one job per layer: its fixed cost once
        if o.kind == "rows":
            return link_latency_s + (sum(o.tokens) * hidden * act_bytes / link if link > 0 else 0.0)
        return link_latency_s  # ids, add

    return sec
