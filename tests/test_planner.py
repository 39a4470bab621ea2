"""The step planner: the whole step is pinned before any victim is chosen; plans are consistent.

References: a hand-worked adversarial order, and a brute-force per-step check of every plan
(each expert of the step accounted for exactly once, no victim from the step, no expert fetched
twice, table contents = the previous contents with exactly the planned evictions and fills)."""

from __future__ import annotations

import random

import pytest

from expertcache.experts.planner import PlannerConfig, StepPlanner
from expertcache.experts.policy import ONLINE


def planner(capacity=2, E=8, policy="lru", **kw):
    return StepPlanner(PlannerConfig(num_experts=E, device_slots=capacity, host_slots=None, expert_bytes=1,
                                     policy=policy, **kw), num_layers=1)


def step(p, t, experts, rows=1):
    plan = p.plan_step(0, experts, [1] * len(experts), rows, t)
    p.end_step(0, plan)
    return plan


def test_adversarial_order_gives_one_miss_not_two():
    p = planner()
    step(p, 1, [0])
    step(p, 2, [1])  # resident 0 (least recent) and 1
    # a miss on 2 comes first; LRU's victim would be 0, which the same step needs next
    plan = step(p, 3, [2, 0])
    c = p.layers[0].counters
    assert [f.expert for f in plan.fills] == [2] and plan.fills[0].evicted == 1
    assert plan.hits == [(0, p.layers[0].device.slot_of[0])]
    assert (c.hits, c.misses) == (1, 3)  # cold 0, cold 1, then only 2 misses at t=3
    assert sorted(p.layers[0].device.resident()) == [0, 2]


@pytest.mark.parametrize("policy", ONLINE)
@pytest.mark.parametrize("seed", range(3))
def test_no_expert_fetched_twice_and_no_victim_from_the_step(policy, seed):
    rng = random.Random(seed)
    E, cap = 12, rng.choice([2, 3, 5])
    cfg = PlannerConfig(num_experts=E, device_slots=cap, host_slots=rng.choice([None, 3, 6]), expert_bytes=1,
                        policy=policy, prefill_admit_tokens=4, cpu_compute="cost")
    p = StepPlanner(cfg, 1, cpu_faster=lambda n: n == 3)  # a miss of 3 tokens is computed on the CPU
    table = p.layers[0].device
    for t in range(1, 120):
        want = rng.sample(range(E), rng.randint(1, min(E, 2 * cap)))
        tokens = [rng.randint(1, 4) for _ in want]
        rows = rng.choice([1, 2, 8])  # 8 rows: a prefill, admitted only into free slots
        before = {e: table.slot_of[e] for e in table.resident()}
        plan = p.plan_step(0, want, tokens, rows, t)
        fetched = plan.fetched()
        assert len(fetched) == len(set(fetched)), "an expert fetched twice in one step"
        assert sorted([e for e, _ in plan.hits] + fetched) == sorted(want), "each expert exactly once"
        assert all(e in before for e, _ in plan.hits)
        assert not set(before) & set(fetched), "a resident expert was fetched"
        victims = [f.evicted for f in plan.fills if f.evicted >= 0]
        assert not set(victims) & set(want), "a victim from the step itself"
        assert len(victims) == len(set(victims))
        after = dict(before)
        for v in victims:
            del after[v]
        for f in plan.fills:
            after[f.expert] = f.slot
        assert {e: table.slot_of[e] for e in table.resident()} == after
        for o in plan.off_slot:
            assert o.on_cpu == (tokens[want.index(o.expert)] == 3)
        p.end_step(0, plan)
        table.check()
        if p.layers[0].host is not None:
            p.layers[0].host.check()
