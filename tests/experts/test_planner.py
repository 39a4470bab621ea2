"""The step planner: the whole step is pinned before any victim is chosen; plans are consistent.

References: a hand-worked adversarial order, and a brute-force per-step check of every plan
(each expert of the step accounted for exactly once, no victim from the step, no expert fetched
twice, table contents = the previous contents with exactly the planned evictions and fills)."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

from expertcache.experts.planner import PlannerConfig, StepPlanner
from expertcache.experts.policy import ONLINE


def planner(capacity=2, E=8, policy="lru", **kw):
    return StepPlanner(
        PlannerConfig(
            num_experts=E, device_slots=capacity, host_slots=None, expert_bytes=1, policy=policy, **kw
        ),
        num_layers=1,
    )


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
    cfg = PlannerConfig(
        num_experts=E,
        device_slots=cap,
        host_slots=rng.choice([None, 3, 6]),
        expert_bytes=1,
        policy=policy,
        prefill_admit_tokens=4,
        cpu_compute="cost",
    )
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


# -- CPU compute of misses, and admission beside it, against a brute-force optimum --------------------


def _cost_profile():
    from expertcache.cost.model import ExpertCost
    from expertcache.cost.profiles import Profile

    # 100 MB experts of 50 M parameters: CPU max(2 ms, 1 ms * rows); link 3 ms; GPU 0.1 ms
    prof = Profile(
        "hand", link_gbs=100 / 3, disk_gbs=2, cpu_mem_gbs=50, cpu_gflops=100, gpu_mem_gbs=1000, gpu_tflops=100
    )
    return ExpertCost(prof, 10**8, 5 * 10**7)


DENSE_S = 5e-3  # the rest of a step, on the device: a background copy lands within it


def realized(cost, trace, choices):
    """Seconds of a one-slot layer over `trace` [(expert, rows)] with a choice per miss ("cpu",
    "admit" = CPU + copy beside it, "move"); None when `choices` do not match the misses. The link
    carries one copy at a time; a hit waits for its copy to land."""
    clock, link_free, resident, landed, k = 0.0, 0.0, -1, 0.0, 0
    for e, n in trace:
        t0 = clock + DENSE_S
        if e == resident:
            clock = max(t0, landed) + cost.gpu_use(n)
            continue
        if k >= len(choices):
            return None
        c = choices[k]
        k += 1
        if c in ("move", "admit"):
            start = max(t0, link_free)
            landed = link_free = start + cost.transfer()
            resident = e
        clock = landed + cost.gpu_use(n) if c == "move" else t0 + cost.cpu_use(n)
    return clock if k == len(choices) else None


def brute_force(cost, trace):
    import itertools

    best = None
    for m in range(len(trace) + 1):
        for choices in itertools.product(("cpu", "admit", "move"), repeat=m):
            t = realized(cost, trace, list(choices))
            if t is not None and (best is None or t < best[0] - 1e-12):
                best = (t, list(choices))
    return best


def planner_choices(cost, trace, cpu_compute="cost"):
    p = StepPlanner(
        PlannerConfig(
            num_experts=8, device_slots=1, host_slots=None, expert_bytes=10**8, cpu_compute=cpu_compute
        ),
        1,
        cpu_faster=cost.cpu_faster,
    )
    out = []
    for t, (e, n) in enumerate(trace, 1):
        plan = p.plan_step(0, [e], [n], n, t)
        out += ["admit" if f.on_cpu else "move" for f in plan.fills] + [
            "cpu" for o in plan.off_slot if o.on_cpu
        ]
        p.end_step(0, plan)
    return out, p.layers[0].counters


@pytest.mark.parametrize(
    "trace",
    [
        [(0, 1)] * 3 + [(1, 1)] * 3 + [(0, 1)] * 2,  # decode with reuse: CPU now, admitted beside it
        [(0, 1), (1, 1), (2, 1), (3, 1)],  # no reuse: the CPU; the copy beside it costs nothing here
        [(0, 10), (0, 1), (1, 12), (2, 1), (2, 1)],  # many rows: moving beats the CPU
        [(0, 3), (0, 3), (1, 4)],  # both sides of the break-even (3 rows: CPU 3 ms < move 3.1 ms)
    ],
    ids=["reuse", "no-reuse", "prefill-rows", "break-even"],
)
def test_cpu_compute_and_admission_reach_the_brute_force_optimum(trace):
    cost = _cost_profile()
    best, _ = brute_force(cost, trace)
    choices, c = planner_choices(cost, trace)
    assert realized(cost, trace, choices) == pytest.approx(best, rel=1e-12)
    assert c.cpu_computed == choices.count("cpu") + choices.count("admit")
    assert c.cpu_admitted == choices.count("admit")


def test_never_admitting_cpu_misses_is_what_the_optimum_beats():
    """The old rule (a miss sent to the CPU is never cached) on a decode trace with reuse."""
    cost = _cost_profile()
    trace = [(0, 1)] * 3 + [(1, 1)] * 3 + [(0, 1)] * 2
    best, _ = brute_force(cost, trace)
    always, _ = planner_choices(cost, trace, cpu_compute="always")
    assert always == ["cpu"] * len(trace)
    assert realized(cost, trace, always) > best * 1.05


def _optimum_hits(steps: list[list[int]], capacity: int) -> int:
    """Brute force: with prefetch before every step any set of experts can be resident when it starts,
    so a step hits at most the largest subset of its experts that fits: max over every subset of at
    most `capacity` experts of its overlap with the step."""
    from itertools import combinations

    best = 0
    for s in steps:
        best += max(
            len(set(c) & set(s)) for n in range(min(capacity, len(s)) + 1) for c in combinations(s, n)
        )
    return best


@pytest.mark.parametrize("policy", ["lru", "lfru", "adaptive"])
@pytest.mark.parametrize("host_slots", [None, 10])
def test_perfect_prefetch_loads_no_expert_twice_and_reaches_the_optimum(policy, host_slots):
    """The predictor names the step's true experts. Predicted experts already resident are pinned before
    any placement (device and host tier), so no prediction evicts another: counted per step, no expert
    is loaded twice (prefetch + fill), no host copy is read twice, and the hits are the optimum."""
    from collections import Counter

    rng = random.Random(3)
    E, cap, K = 16, 6, 4
    steps = [
        list(dict.fromkeys(e for _ in range(rng.choice([1, 1, 1, 2])) for e in rng.sample(range(E), K)))
        for _ in range(300)
    ]
    p = StepPlanner(
        PlannerConfig(
            num_experts=E,
            device_slots=cap,
            host_slots=host_slots,
            expert_bytes=1,
            policy=policy,
            prefetch="device",
            gate_threshold=None,
        ),
        num_layers=1,
    )
    hits = 0
    for t, s in enumerate(steps, 1):
        pf = p.plan_prefetch(0, s, len(s), t)
        plan = p.plan_step(0, s, [1] * len(s), len(s), t)
        p.end_step(0, plan)
        loads = Counter(
            [x.expert for x in pf if getattr(x, "slot", -1) >= 0] + [f.expert for f in plan.fills]
        )
        assert max(loads.values(), default=0) <= 1, (t, s, pf, plan)
        reads = Counter(
            [x.expert for x in pf if getattr(x, "src", None) is not None and x.src.read]
            + [f.expert for f in plan.fills if f.src is not None and f.src.read]
            + [o.expert for o in plan.off_slot if o.src.read]
        )
        assert max(reads.values(), default=0) <= 1, (t, s, pf, plan)
        hits += len(plan.hits)
        p.layers[0].device.check()
    assert hits == _optimum_hits(steps, cap)


def _native_or_skip():
    from expertcache.experts.policy import NATIVE_ENV
    from expertcache.kernels.build import extension, why

    if os.environ.get(NATIVE_ENV, "").lower() == "python":
        pytest.skip(f"{NATIVE_ENV}=python")
    if getattr(extension(), "PlannerCore", None) is None:
        pytest.skip(f"no C++ planner core: {why() or 'an older build'}")


def _plan_key(plan):
    return (plan.hits, plan.fills, plan.off_slot, plan.demotions)


def _state(p):
    out = []
    for st in p.layers:
        tables = [st.device] + ([st.host] if st.host is not None else [])
        out.append(
            (
                [(t.slot_of, t.owner, t.free, sorted(t.pinned), t.hits, t.misses) for t in tables],
                dataclasses.asdict(st.counters),
                sorted(st.prefetched),
                sorted(st.pf_evicted),
            )
        )
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_cpp_core_decides_as_the_python_policies(seed):
    """Every plan (hits, fills and their victims, off-slot experts, demotions), every prefetch placement
    and the tables and counters after each step equal the Python policies', for each policy the C++
    core runs, on random Zipf traces with prefill steps, CPU-computed misses, prefetch, a partial
    host tier and exclusive tiers."""
    _native_or_skip()
    import numpy as np

    rng = random.Random(seed)
    E = rng.choice([8, 16, 32, 64, 128])
    cap = rng.randint(2, max(2, E // 3))
    k = rng.randint(1, min(8, cap))
    host = rng.choice([None, None, cap + rng.randint(1, max(1, E // 2)), 0])
    gen = np.random.default_rng(seed)
    w = 1 / np.arange(1, E + 1) ** rng.choice([0.0, 0.8, 1.2])
    w /= w.sum()
    for policy in ("lru", "lfru", "lfu", "lfru-admit", "adaptive"):
        cfg = PlannerConfig(
            num_experts=E,
            device_slots=cap,
            host_slots=host,
            expert_bytes=1,
            policy=policy,
            prefill_admit_tokens=4,
            cpu_compute=rng.choice(["never", "cost", "always"]),
            prefetch=rng.choice(["off", "device", "host"]) if host else rng.choice(["off", "device"]),
            exclusive=bool(host) and seed % 2 == 1,
            gate_threshold=None,
        )
        planners = [StepPlanner(cfg, 2, cpu_faster=lambda n: n % 3 == 0, native=nat) for nat in (True, False)]
        assert planners[0].native and not planners[1].native
        for t in range(1, 160):
            i = t % 2
            rows = rng.choice([1, 1, 1, 2, 6])
            ids = gen.choice(E, (rows, k), p=w).tolist()
            flat = [e for r in ids for e in r]
            experts = list(dict.fromkeys(flat))
            tokens = [flat.count(e) for e in experts]
            pred = gen.choice(E, (rows, k), p=w).reshape(-1).tolist()
            got = []
            for p in planners:
                pf = p.plan_prefetch(i, pred, rows, t)
                plan = p.plan_step(i, experts, tokens, rows, t)
                p.end_step(i, plan)
                got.append((pf, _plan_key(plan), _state(p)))
            assert got[0] == got[1], (policy, t)
        for st in planners[0].layers:
            st.device.check()


def test_native_is_honoured_or_refused():
    """native=True where the C++ core has no policy (static) is refused; None falls back to Python there."""
    _native_or_skip()
    cfg = PlannerConfig(num_experts=8, device_slots=2, host_slots=None, expert_bytes=1, policy="static")
    with pytest.raises(ValueError, match="static"):
        StepPlanner(cfg, 1, native=True)
    assert StepPlanner(cfg, 1).implementation == "python"
    lru = dataclasses.replace(cfg, policy="lru")
    assert StepPlanner(lru, 1).implementation == "native"
    assert StepPlanner(lru, 1, native=False).implementation == "python"
