"""The MoE layer as a schedule (experts/schedule.py) and its time (experts/schedule_time.py).

References: hand-worked plans for each rule; random planner runs checked op by op; the
discrete-event makespan against an independent longest path over every chain of the DAG
(waits + queue order + the host's issue order), enumerated by brute force."""

from __future__ import annotations

import random
from functools import lru_cache

import pytest

from expertcache.cost.model import ExpertCost
from expertcache.cost.profiles import Profile
from expertcache.experts.planner import PlannerConfig, StepPlanner
from expertcache.experts.schedule import STAGE, ScheduleBuilder, check_rules, host_waits, queue_order, reaches
from expertcache.experts.schedule_time import evaluate, op_seconds


def planner(layers=2, **kw):
    cfg = dict(num_experts=8, device_slots=2, host_slots=None, expert_bytes=1, cpu_compute="cost")
    cfg.update(kw)
    return StepPlanner(PlannerConfig(**cfg), layers, cpu_faster=lambda n: n <= 1)


def run(p, b, steps, dense=False):
    """steps: [(layer, experts, tokens, rows)] -> the layer schedules, planned and built in order."""
    out = []
    for t, (i, ex, tok, rows) in enumerate(steps, 1):
        plan = p.plan_step(i, ex, tok, rows, t)
        out.append(b.layer(i, plan, ex, tok, dense=dense))
        p.end_step(i, plan)
    return out


def test_a_copy_into_a_slot_waits_for_that_slots_last_reader_only():
    p, b = planner(layers=1), ScheduleBuilder()
    s1 = run(p, b, [(0, [0, 1], [2, 2], 2)])[0]  # cold: two fills, slots 0 and 1, one moe reads both
    s2 = run(p, b, [(0, [1], [2], 1)])[0]  # a hit on expert 1: reads its slot only
    s3 = run(p, b, [(0, [1, 4], [2, 2], 2)])[0]  # 4 evicts 0 (LRU): its copy waits on s1's fills only
    fills1 = s1.of("moe", "fills")[0]
    hits2 = s2.of("moe", "hits")[0]
    copy = s3.of("h2d")[0]
    slot0 = copy.slot
    assert slot0 not in hits2.reads and slot0 in fills1.reads
    writer = [o.id for o in s1.of("h2d") if o.slot == slot0]
    # that slot's last reader and last writer; not the hits of s2 (another slot), nor a queue as a whole
    assert set(copy.waits) == {fills1.id, *writer}
    check_rules([s1, s2, s3])


def test_cpu_job_waits_for_its_rows_and_bytes_never_for_the_hits():
    p, b = planner(layers=1, host_slots=2), ScheduleBuilder()
    scheds = run(p, b, [(0, [0, 1], [2, 2], 2), (0, [0, 1, 5], [2, 2, 1], 3)])
    s = scheds[1]
    job, hits = s.of("cpu")[0], s.of("moe", "hits")[0]
    assert job.experts == (5,)
    kinds = {w: o.kind for o in s.ops for w in [o.id]}
    assert sorted(kinds[w] for w in job.waits) == ["read", "rows"]
    ops = {o.id: o for sc in scheds for o in sc.ops}
    assert not reaches(ops, queue_order(ops), job.id, hits.id)
    assert s.of("add")[0].waits == (job.id,)
    assert host_waits(s) == [s.ids]
    check_rules(scheds)


def test_a_host_slot_read_waits_for_the_copy_reading_it():
    cfg = dict(
        num_experts=8,
        device_slots=2,
        host_slots=2,
        expert_bytes=1,
        cpu_compute="always",
        prefetch="device",
        gate_threshold=None,
    )
    p, b = StepPlanner(PlannerConfig(**cfg), 2), ScheduleBuilder()
    plan0 = p.plan_step(0, [0], [1], 1, 1)
    s0 = b.layer(0, plan0, [0], [1], prefetch=(1, p.plan_prefetch(1, [3], 1, 1)))
    p.end_step(0, plan0)
    pf = [o for o in s0.ops if o.kind == "h2d" and o.tag == "prefetch"][0]
    assert pf.layer == 1 and pf.experts == (3,)
    plan1 = p.plan_step(1, [4, 5], [1, 1], 1, 2)
    s1 = b.layer(1, plan1, [4, 5], [1, 1])
    rewrite = [o for o in s1.ops if o.kind == "read" and o.host_slot == pf.host_slot]
    assert rewrite and pf.id in rewrite[0].waits
    check_rules([s0, s1])
    from dataclasses import replace

    r = rewrite[0]  # the race the rule is about: the read no longer waits for the copy
    s1.ops[s1.ops.index(r)] = replace(r, waits=tuple(w for w in r.waits if w != pf.id))
    with pytest.raises(AssertionError, match="may overwrite it"):
        check_rules([s0, s1])


def test_check_rules_catches_each_broken_rule():
    p, b = planner(layers=1, host_slots=2), ScheduleBuilder()
    scheds = run(p, b, [(0, [0, 1], [2, 2], 2), (0, [0, 1, 5], [2, 2, 1], 3), (0, [2, 3], [2, 2], 2)])
    from dataclasses import replace

    s = scheds[1]
    job, hits = s.of("cpu")[0], s.of("moe", "hits")[0]
    s.ops[s.ops.index(job)] = replace(job, waits=tuple(sorted(job.waits + (hits.id,))))
    with pytest.raises(AssertionError, match="waits on device compute"):
        check_rules(scheds)
    s.ops[s.ops.index(replace(job, waits=tuple(sorted(job.waits + (hits.id,)))))] = job
    s3 = scheds[2]
    copy = s3.of("h2d")[0]
    s3.ops[s3.ops.index(copy)] = replace(copy, waits=copy.waits + (s.add,))
    with pytest.raises(AssertionError, match="not of that slot"):
        check_rules(scheds)


@pytest.mark.parametrize("seed", range(4))
def test_random_runs_keep_every_rule(seed):
    rng = random.Random(seed)
    cfg = dict(
        num_experts=12,
        device_slots=3,
        host_slots=rng.choice([None, 4, 0]),
        expert_bytes=1,
        cpu_compute="cost",
        prefetch="device",
        gate_threshold=None,
        direct=False,
        prefill_admit_tokens=4,
    )
    p, b = StepPlanner(PlannerConfig(**cfg), 3, cpu_faster=lambda n: n <= 1), ScheduleBuilder()
    scheds = []
    for t in range(1, 60):
        for i in range(3):
            rows = rng.choice([1, 1, 2, 6])
            ex = rng.sample(range(12), min(12, rows * 2))
            tok = [rng.randint(1, rows) for _ in ex]
            plan = p.plan_step(i, ex, tok, rows, t)
            pf = None
            if i < 2:
                j = i + 1
                pf = (j, p.plan_prefetch(j, rng.sample(range(12), 3), 1, t))
            scheds.append(b.layer(i, plan, ex, tok, prefetch=pf))
            p.end_step(i, plan)
    check_rules(scheds)
    ops = [o for s in scheds for o in s.ops]
    assert any(o.kind == "cpu" for o in ops) and any(o.slot == STAGE for o in ops)
    assert any(o.tag == "prefetch" for o in ops)


# -- the time of a schedule ------------------------------------------------------------------------


def brute_makespan(scheds, sec):
    """Longest chain through the DAG of waits, queue order (io: one lane), the host's issue order
    (every op after its layer's ids, the add after the CPU job, the next layer after both):
    every path enumerated."""
    ops = {o.id: o for s in scheds for o in s.ops}
    preds = {i: set(o.waits) for i, o in ops.items()}
    last = {}
    for o in ops.values():
        if o.queue in last:
            preds[o.id].add(last[o.queue])
        last[o.queue] = o.id
    host = set()  # the ops whose end the host waited for before issuing the next op
    for s in scheds:
        for o in s.ops:
            if o.kind == "add":
                host |= set(o.waits)  # the host joins the CPU job
            preds[o.id] |= host
            if o.id == s.ids:
                host = {o.id}

    @lru_cache(None)
    def longest(i):
        return sec(ops[i]) + max((longest(p) for p in preds[i]), default=0.0)

    return max(longest(i) for i in ops)


PROF = Profile("t", link_gbs=10, disk_gbs=2, cpu_mem_gbs=50, cpu_gflops=100, gpu_mem_gbs=1000, gpu_tflops=100)


def test_makespan_equals_the_longest_chain_and_the_critical_path_adds_up():
    rng = random.Random(1)
    cfg = dict(
        num_experts=8,
        device_slots=3,
        host_slots=4,
        expert_bytes=10**8,
        cpu_compute="cost",
        prefetch="device",
        gate_threshold=None,
    )
    p, b = StepPlanner(PlannerConfig(**cfg), 2, cpu_faster=lambda n: n <= 1), ScheduleBuilder()
    scheds = []
    for t in range(1, 12):
        for i in range(2):
            ex = rng.sample(range(8), 3)
            tok = [rng.randint(1, 2) for _ in ex]
            plan = p.plan_step(i, ex, tok, 2, t)
            pf = (1, p.plan_prefetch(1, rng.sample(range(8), 2), 1, t)) if i == 0 else None
            scheds.append(b.layer(i, plan, ex, tok, prefetch=pf, dense=True))
            p.end_step(i, plan)
    sec = op_seconds(ExpertCost(PROF, 10**8, 5 * 10**7), hidden=64, dense_s=1e-3)
    tl = evaluate(scheds, sec, io_lanes=1)
    assert tl.makespan == pytest.approx(brute_makespan(scheds, sec), rel=1e-12)
    ops = {o.id: o for s in scheds for o in s.ops}
    path = tl.critical_path()
    assert sum(sec(ops[i]) for i in path) == pytest.approx(tl.makespan, rel=1e-12)
    for a, c in zip(path, path[1:]):
        assert tl.end[a] == pytest.approx(tl.start[c])


def test_cpu_compute_takes_the_misses_off_the_links_critical_path():
    """One decode layer, one hit and one miss of 1 row: moved (10 ms link) vs on the CPU (2 ms):
    the critical paths are dense -> ids -> h2d -> fills vs dense -> ids -> rows -> cpu -> add."""
    cost = ExpertCost(PROF, 10**8, 5 * 10**7)
    sec = op_seconds(cost, hidden=64, dense_s=1e-3)
    times = {}
    for mode in ("never", "always"):
        p, b = planner(layers=1, cpu_compute=mode, expert_bytes=10**8), ScheduleBuilder()
        run(p, b, [(0, [0], [1], 1)], dense=True)  # expert 0 resident
        s = run(p, b, [(0, [0, 3], [1, 1], 1)], dense=True)[0]
        tl = evaluate([s], sec)
        times[mode] = tl.makespan
        kinds = [next(o for o in s.ops if o.id == i).kind for i in tl.critical_path()]
        assert kinds == (
            ["dense", "ids", "h2d", "moe"] if mode == "never" else ["dense", "ids", "rows", "cpu", "add"]
        )
    assert times["never"] == pytest.approx(1e-3 + 10e-6 + 10e-6 + 1e-2 + 1e-4)
    assert times["always"] < times["never"]


def test_scheduled_decode_prediction_by_hand():
    """One layer, one expert of top-1, one slot, two decode rows: a miss then a hit.
    step 1: dense, ids, h2d (latency + 3 ms), MoE 0.1 ms; step 2: dense, ids, MoE."""
    import numpy as np

    from expertcache.trace.format import RoutingTrace
    from expertcache.trace.simulate import ModelShape, simulate_schedule

    prof = Profile(
        "t", link_gbs=100 / 3, disk_gbs=2, cpu_mem_gbs=50, cpu_gflops=100, gpu_mem_gbs=1000, gpu_tflops=100
    )
    shape = ModelShape(expert_params=5 * 10**7, dense_params=5 * 10**8)  # dense: 1 GB / 1 TB/s = 1 ms a step
    t = RoutingTrace(
        experts=np.zeros((2, 1, 1), np.int32),
        num_experts=2,
        step=np.arange(2),
        expert_bytes=10**8,
        phase=np.ones(2, np.int8),
    )
    lat = 10e-6
    r = simulate_schedule(t, shape, prof, "lru", 1, hidden=64, cpu_compute=False)
    want = (1e-3 + lat + lat + 3e-3 + 1e-4) + (1e-3 + lat + 1e-4)
    assert r.decode_s == pytest.approx(want, rel=1e-9) and r.tok_s == pytest.approx(2 / want, rel=1e-9)
    assert r.critical == {"dense": 2, "ids": 2, "h2d": 1, "moe": 2}
    # the CPU (2 ms) beats the move (3.1 ms): the miss is computed there and admitted beside it
    r = simulate_schedule(t, shape, prof, "lru", 1, hidden=64, cpu_compute=True)
    assert (r.misses_on_cpu, r.misses_admitted) == (1, 1)
    assert r.decode_s < want
