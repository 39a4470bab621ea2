"""The one cost model: the per-miss choice on both sides of its break-even, hand-computed, and the
same decision wherever it is made (the step planner, trace simulate)."""

from __future__ import annotations

import numpy as np

from expertcache.cost.model import ExpertCost
from expertcache.cost.profiles import Profile
from expertcache.experts.planner import PlannerConfig, StepPlanner
from expertcache.trace.format import RoutingTrace
from expertcache.trace.replay import replay
from expertcache.trace.simulate import ModelShape, simulate

# 100 MB experts of 50 M parameters; link 10 GB/s, CPU 50 GB/s and 100 GFLOP/s, GPU 1 TB/s and 100 TFLOP/s:
#   CPU:  max(1e8 / 50e9, 2 * 5e7 * u / 1e11) = max(2 ms, 1 ms * u)
#   move: 1e8 / 1e10 + max(1e8 / 1e12, 2 * 5e7 * u / 1e14) = 10 ms + max(0.1 ms, 1 us * u)
# so the CPU wins while 1 ms * u < 10 ms + 0.1 ms: up to u = 10 rows, the device from u = 11.
PROF = Profile(
    "hand", link_gbs=10, disk_gbs=2, cpu_mem_gbs=50, cpu_gflops=100, gpu_mem_gbs=1000, gpu_tflops=100
)
COST = ExpertCost(PROF, expert_bytes=10**8, expert_params=5 * 10**7)


def test_per_miss_choice_on_both_sides_of_break_even():
    assert COST.cpu_use(10) == 10e-3 and COST.transfer() + COST.gpu_use(10) == 10.1e-3
    assert [COST.cpu_faster(u) for u in (1, 2, 10, 11, 100)] == [True, True, True, False, False]
    assert COST.cpu_faster(10, from_disk=True) and not COST.cpu_faster(
        11, from_disk=True
    )  # disk on both sides
    no_gpu = ExpertCost(
        Profile("cpu", link_gbs=0, disk_gbs=2, cpu_mem_gbs=50, cpu_gflops=100), 10**8, 5 * 10**7
    )
    assert no_gpu.cpu_faster(1000)


def test_planner_and_simulate_make_the_same_choice():
    cfg = PlannerConfig(
        num_experts=4, device_slots=2, host_slots=None, expert_bytes=10**8, cpu_compute="cost"
    )
    p = StepPlanner(cfg, 1, cpu_faster=COST.cpu_faster)
    plan = p.plan_step(0, [0, 1], [10, 11], rows=11, t=1)
    # 10 rows: computed on the CPU, and admitted beside it (LRU predicts reuse); 11 rows: moved
    assert plan.off_slot == []
    assert [(f.expert, f.on_cpu) for f in plan.fills] == [(0, True), (1, False)]
    shape = ModelShape(expert_params=5 * 10**7, dense_params=0)
    for rows, on_cpu in ((10, True), (11, False)):  # one step of `rows` rows, all routed to expert 0
        t = RoutingTrace(
            experts=np.zeros((rows, 1, 1), np.int32),
            num_experts=4,
            step=np.zeros(rows, np.int64),
            expert_bytes=10**8,
        )
        pred = simulate(replay(t, "lru", 2, with_min=False), shape, PROF)
        assert (pred.misses_on_cpu, pred.misses_transferred) == ((1, 0) if on_cpu else (0, 1))


def test_measured_machine_profile_needs_a_cuda_device():
    import pytest
    import torch

    from expertcache.cost.measure import resolve_profile

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: test_cuda_profile_is_measured_once covers it")
    with pytest.raises(ValueError, match="'this-machine' measures a CUDA device"):
        resolve_profile("this-machine", "cuda")
    prof, how = resolve_profile(None, "cpu")
    assert prof.name == "cpu-only" and "default" in how


@__import__("pytest").mark.gpu
def test_cuda_profile_is_measured_once(tmp_path, monkeypatch):
    import pytest
    import torch

    from expertcache.cost import measure

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measure._MEASURED.clear()
    prof, how = measure.resolve_profile(None, "cuda")
    assert prof.name == "this-machine" and "measured now" in how
    assert (
        prof.link_gbs > 0 and prof.gpu_mem_gbs > prof.link_gbs and prof.gpu_tflops > 0 and prof.cpu_gflops > 0
    )
    measure._MEASURED.clear()
    again, how2 = measure.resolve_profile(None, "cuda")
    assert again == prof and "cached" in how2


# the same, with a CPU job that costs 2 ms per layer whatever its experts: the first CPU expert of a
# step wins only while 1 ms * u + 2 ms < 10.1 ms (u <= 8), the later ones while 1 ms * u < 10.1 ms (u <= 10)
JOB = ExpertCost(
    Profile(
        "hand-job",
        link_gbs=10,
        disk_gbs=2,
        cpu_mem_gbs=50,
        cpu_gflops=100,
        gpu_mem_gbs=1000,
        gpu_tflops=100,
        cpu_job_ms=2.0,
    ),
    expert_bytes=10**8,
    expert_params=5 * 10**7,
)


def test_the_first_cpu_expert_of_a_layer_pays_the_cpu_jobs_fixed_cost():
    assert JOB.cpu_job() == 2e-3
    assert [JOB.cpu_faster(u, first=True) for u in (1, 8, 9, 10)] == [True, True, False, False]
    assert [JOB.cpu_faster(u) for u in (8, 9, 10, 11)] == [True, True, True, False]


def test_planner_prices_the_cpu_job_once_per_step():
    """A step of misses [8 rows, 10 rows]: 8 + 2 < 10.1 goes to the CPU, then 10 (job already paid) too;
    [10, 8]: 10 + 2 > 10.1 moves, then 8 + 2 < 10.1 opens the job. Without the fixed cost both steps
    would put both experts on the CPU; with a plain rows -> bool rule the planner asks rows only."""
    cfg = PlannerConfig(
        num_experts=8, device_slots=8, host_slots=None, expert_bytes=10**8, cpu_compute="cost"
    )
    for tokens, on_cpu in (([8, 10], [True, True]), ([10, 8], [False, True]), ([9, 9], [False, False])):
        p = StepPlanner(cfg, 1, cpu_faster=JOB.cpu_faster)
        plan = p.plan_step(0, [0, 1], tokens, rows=sum(tokens), t=1)
        got = {f.expert: f.on_cpu for f in plan.fills} | {o.expert: o.on_cpu for o in plan.off_slot}
        assert [got[0], got[1]] == on_cpu, tokens
    asked = []
    p = StepPlanner(cfg, 1, cpu_faster=lambda n: asked.append(n) or True)
    p.plan_step(0, [0, 1], [9, 9], rows=18, t=1)
    assert asked == [9, 9]


def test_host_figures_of_the_profiles():
    """GPU cards carry the measured-on-the-CPU layer overhead and CPU-job cost (not the 0.1 ms once
    assumed); `this-cpu` scales the reference machine's layer overhead by this host's op cost, and
    `plan`'s prediction pays it once per MoE layer per step."""
    import pytest

    from expertcache.cost import measure
    from expertcache.cost.profiles import BUILTIN, GPU_CPU_JOB_MS, GPU_LAYER_MS, HOST_REF

    cards = [p for p in BUILTIN.values() if p.has_gpu]
    assert cards and all(
        p.layer_overhead_ms == GPU_LAYER_MS and p.cpu_job_ms == GPU_CPU_JOB_MS for p in cards
    )
    assert GPU_LAYER_MS >= 0.5 and not BUILTIN["cpu-only"].cpu_job_ms
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(measure, "host_op_us", lambda n=0, reps=0, device=None: 2 * HOST_REF["op_us"])
        assert measure.host_layer_ms(BUILTIN["cpu-only"]) == 2 * BUILTIN["cpu-only"].layer_overhead_ms
    finally:
        mp.undo()
    op = measure.host_op_us(n=200, reps=2)
    assert 0 < op < 1000
    assert 0 < measure.cpu_job_ms("cpu", hidden=64, reps=3) < 100
    shape = ModelShape(expert_params=5 * 10**7, dense_params=0)
    t = RoutingTrace(
        experts=np.zeros((6, 3, 1), np.int32), num_experts=4, step=np.arange(6), expert_bytes=10**8
    )
    prof = BUILTIN["h200-141gb"]
    pred = simulate(replay(t, "lru", 2, with_min=False), shape, prof)
    assert pred.overhead_s == pytest.approx(6 * 3 * GPU_LAYER_MS / 1e3)  # 6 steps x 3 MoE layers
