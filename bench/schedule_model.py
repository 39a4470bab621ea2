"""The schedule model's predicted makespan against the CPU backend's measured one, on a synthetic
workload: a routing trace planned by the engine's planner, built into schedules, each op a
busy-wait of known duration (time.sleep: it releases the GIL, so the queues' threads overlap as
streams would), issued as the engine issues them (the host waits for each layer's ids read, and
joins the CPU job before the add). One line per configuration:

    schedule_model cpu_compute=on capacity=6 layers=4 steps=24 predicted_ms=... measured_ms=... error=+3.1%

The model is given the backend's cost per op (`op_overhead_us`: the hand-off between queues,
measured on a chain of empty ops, plus how much a sleep overshoots here), as it is given a link's
latency; each line reports the error with it and without any.

Usage: python bench/schedule_model.py [--steps 24] [--reps 3]   (the best of --reps runs is kept)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import hardware_line  # noqa: E402
from expertcache.experts.executor import ThreadExecutor  # noqa: E402
from expertcache.experts.planner import PlannerConfig, StepPlanner  # noqa: E402
from expertcache.experts.schedule import ScheduleBuilder  # noqa: E402
from expertcache.experts.schedule_time import evaluate  # noqa: E402
from expertcache.trace.replay import schedule  # noqa: E402
from expertcache.trace.synthetic import synth_trace  # noqa: E402

# seconds per op kind (per expert for moe and cpu): a link slower than the CPU for one row
SECONDS = {
    "dense": 2e-3,
    "ids": 2e-4,
    "rows": 2e-4,
    "add": 2e-4,
    "read": 4e-3,
    "h2d": 3e-3,
    "moe": 5e-4,
    "cpu": 1.5e-3,
}


def seconds(o) -> float:
    return SECONDS[o.kind] * (len(o.experts) if o.kind in ("moe", "cpu") else 1)


def build(layers: int, steps: int, capacity: int, cpu: bool):
    trace = synth_trace(layers=layers, experts=16, top_k=2, tokens=steps, seed=0, zipf=1.1, reuse=0.4)
    st = schedule(trace)
    p = StepPlanner(
        PlannerConfig(
            num_experts=16,
            device_slots=capacity,
            host_slots=None,
            expert_bytes=1,
            cpu_compute="cost" if cpu else "never",
        ),
        layers,
        cpu_faster=lambda n: n <= 1,
    )
    b, out = ScheduleBuilder(), []
    for k in range(len(st[0])):
        for i in range(layers):
            s = st[i][k]
            plan = p.plan_step(i, s.experts, s.tokens, s.rows, s.t)
            out.append(b.layer(i, plan, s.experts, s.tokens, dense=True))
            p.end_step(i, plan)
    return out


def measure(scheds) -> float:
    ex = ThreadExecutor(io_lanes=4)

    def busy(d):
        return lambda: time.sleep(d)

    t0 = time.perf_counter()
    try:
        for s in scheds:
            for o in s.ops:
                if o.id == s.add:
                    for w in o.waits:
                        ex.join(w)
                ex.submit(o, busy(seconds(o)))
                if o.id == s.ids:
                    ex.join(o.id)  # the host reads the step's ids, then plans the rest
        ex.drain()
        return time.perf_counter() - t0
    finally:
        ex.close()


def handoff_s(n: int = 400) -> float:
    """The CPU backend's cost per op when nothing overlaps: a chain of n empty ops, each on the other
    of two queues and waiting for the one before (an event set, a thread woken)."""
    from expertcache.experts.schedule import Op

    ex = ThreadExecutor()
    try:
        t0 = time.perf_counter()
        for i in range(n):
            ex.submit(Op(i, "moe" if i % 2 else "cpu", 0, (i - 1,) if i else ()), lambda: None)
        ex.drain()
        return (time.perf_counter() - t0) / n
    finally:
        ex.close()


def issue_s(n: int = 2000) -> float:
    """The host's time to issue one op (build it, submit it) to a queue whose ops wait for nothing."""
    from expertcache.experts.schedule import Op

    ex = ThreadExecutor()
    try:
        t0 = time.perf_counter()
        for i in range(n):
            ex.submit(Op(i, "cpu", 0, ()), None)
        dt = (time.perf_counter() - t0) / n
        ex.drain()
        return dt
    finally:
        ex.close()


def overshoot_s(n: int = 50, d: float = 1e-3) -> float:
    """How much longer than asked a busy-wait of d seconds takes here (timer slack, wake-up)."""
    t0 = time.perf_counter()
    for _ in range(n):
        time.sleep(d)
    return (time.perf_counter() - t0) / n - d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(hardware_line())
    handoff = min(handoff_s() for _ in range(3))
    op_s = handoff + overshoot_s()
    issue = min(issue_s() for _ in range(3))
    print(
        f"schedule_model handoff_us={handoff * 1e6:.0f} op_overhead_us={op_s * 1e6:.0f} issue_us={issue * 1e6:.0f} "
        f"(measured: the model adds op_overhead to every op, handoff to the host's wait for each layer's ids, "
        f"issue to the host's clock per op issued)"
    )
    for cpu in (True, False):
        for capacity in (4, 8):
            scheds = build(args.layers, args.steps, capacity, cpu)
            predicted = evaluate(
                scheds, seconds, io_lanes=4, op_s=op_s, host_s=handoff, issue_s=issue
            ).makespan
            bare = evaluate(scheds, seconds, io_lanes=4).makespan
            measure(scheds[: args.layers])  # warm-up: threads started, code paths run once
            measured = min(measure(scheds) for _ in range(args.reps))
            print(
                f"schedule_model cpu_compute={'on' if cpu else 'off'} capacity={capacity} layers={args.layers} "
                f"steps={args.steps} ops={sum(len(s.ops) for s in scheds)} predicted_ms={predicted * 1e3:.1f} "
                f"measured_ms={measured * 1e3:.1f} error={(predicted - measured) / measured:+.1%} "
                f"error_without_handoff={(bare - measured) / measured:+.1%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
