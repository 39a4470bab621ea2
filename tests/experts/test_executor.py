"""The schedule's executors: the CPU backend of the CUDA path (in-order queues, events between them,
on worker threads) under forced interleavings of experts/schedule.py's rules, its emulation of the
CUDA backend's enqueuer (one FIFO per queue), and a tiny model's tiered cache run through every
CPU backend (inline, threads) against every expert resident.

Interleavings are forced with latches in the executor's `before` / `on_wait` hooks (no sleeps, no
timing): an op that would wrongly wait is detected by `on_wait` and recorded, never hung on."""

from __future__ import annotations

import threading

import pytest
import torch

from expertcache import LLM, SamplingParams
from expertcache.experts.executor import ThreadExecutor, make_executor
from expertcache.experts.planner import PlannerConfig, StepPlanner
from expertcache.experts.schedule import ScheduleBuilder

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LATCH_S = 60  # a deadlock guard only: every latch in these tests is released by the other side


def _planner(**kw):
    cfg = dict(num_experts=8, device_slots=2, host_slots=None, expert_bytes=1, cpu_compute="cost")
    cfg.update(kw)
    return StepPlanner(PlannerConfig(**cfg), 2, cpu_faster=lambda n: n <= 1)


def test_cpu_job_runs_while_the_hits_are_held():
    """Rule 1: the hits' MoE is held until the CPU job has ended; the CPU job must not need it."""
    p, b = _planner(), ScheduleBuilder()
    for t, (ex, tok) in enumerate([([0, 1], [2, 2]), ([0, 1, 5], [2, 2, 1])], 1):
        plan = p.plan_step(0, ex, tok, 3, t)
        sched = b.layer(0, plan, ex, tok)
        p.end_step(0, plan)
    hits, job = sched.of("moe", "hits")[0], sched.of("cpu")[0]
    cpu_done, wrongly_waited = threading.Event(), []

    def on_wait(op, pending):
        if op.id == job.id and hits.id in pending:
            wrongly_waited.append(op.id)  # it would have waited: let the hits go so nothing hangs
            cpu_done.set()

    def before(op):
        if op.id == hits.id:
            assert cpu_done.wait(LATCH_S)

    ex = ThreadExecutor(before=before, on_wait=on_wait)
    try:
        fns = {o.id: (cpu_done.set if o.id == job.id else None) for o in sched.ops}
        fns = {k: v for k, v in fns.items() if v is not None}
        ex.run_layer(sched, fns)
        ex.drain()
    finally:
        ex.close()
    assert not wrongly_waited
    order = [(kind, i) for kind, i, _ in ex.log]
    assert order.index(("end", job.id)) < order.index(("start", hits.id))


def test_a_copy_into_a_free_slot_lands_while_the_device_is_held():
    """Rule 2: the hits' MoE (reading slot a) is held until a copy into another slot has landed; the
    copy waits on its slot's events, not on the device queue."""
    p, b = _planner(device_slots=3), ScheduleBuilder()
    for t, ex_ in enumerate([[0, 1], [0, 2]], 1):  # step 2: a hit on 0, a fill of 2 into the free slot
        plan = p.plan_step(0, ex_, [2, 2], 2, t)
        sched = b.layer(0, plan, ex_, [2, 2])
        p.end_step(0, plan)
    hits, copy = sched.of("moe", "hits")[0], sched.of("h2d")[0]
    assert copy.slot not in hits.reads
    landed, wrongly_waited = threading.Event(), []

    def on_wait(op, pending):
        if op.id == copy.id and hits.id in pending:
            wrongly_waited.append(op.id)
            landed.set()

    def before(op):
        if op.id == hits.id:
            assert landed.wait(LATCH_S)

    ex = ThreadExecutor(before=before, on_wait=on_wait)
    try:
        ex.run_layer(sched, {copy.id: landed.set})
        ex.drain()
    finally:
        ex.close()
    assert not wrongly_waited
    order = [(kind, i) for kind, i, _ in ex.log]
    assert order.index(("end", copy.id)) < order.index(("start", hits.id))


def test_host_slot_is_not_rewritten_while_its_copy_is_queued():
    """Rule 4: a prefetch copies host slot h to the device; a demand read into h comes next. The
    copy is held until the read is either blocked on it (correct) or running (the race); the
    bytes the copy delivers are the prefetched expert's."""
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
    items = p.plan_prefetch(1, [3], 1, 1)  # expert 3 of layer 1: disk -> host slot -> device slot
    s0 = b.layer(0, plan0, [0], [1], prefetch=(1, items))
    p.end_step(0, plan0)
    pf_copy = [o for o in s0.ops if o.kind == "h2d" and o.tag == "prefetch"][0]
    hs = pf_copy.host_slot
    # layer 1's step: experts 4, 5 (CPU-computed) need host slots; one of them is hs
    plan1 = p.plan_step(1, [4, 5], [1, 1], 1, 2)
    s1 = b.layer(1, plan1, [4, 5], [1, 1])
    p.end_step(1, plan1)
    rewrite = [o for o in s1.ops if o.kind == "read" and o.host_slot == hs][0]
    host, device = {hs: None}, {}
    released, race = threading.Event(), []

    def on_wait(op, pending):
        if op.id == rewrite.id and pf_copy.id in pending:
            released.set()

    def before(op):
        if op.id == rewrite.id and not released.is_set():
            race.append(op.id)
            released.set()
        if op.id == pf_copy.id:
            assert released.wait(LATCH_S)

    def write(e):
        return lambda: host.__setitem__(hs, e)

    fns = {o.id: write(o.experts[0]) for o in s0.ops + s1.ops if o.kind == "read" and o.host_slot == hs}
    fns[pf_copy.id] = lambda: device.__setitem__(pf_copy.slot, host[hs])
    ex = ThreadExecutor(before=before, on_wait=on_wait)
    try:
        ex.run_layer(s0, fns)
        ex.run_layer(s1, fns)
        ex.drain()
    finally:
        ex.close()
    assert not race
    assert device[pf_copy.slot] == 3


def test_ops_start_after_their_waits_and_in_queue_order():
    """The backend's recorded order against the schedule: every op starts after each op it waits on
    ended, and each queue runs its ops in issue order (io lanes excepted)."""
    p, b = _planner(host_slots=3), ScheduleBuilder()
    scheds = []
    g = torch.Generator().manual_seed(0)
    for t in range(1, 30):
        for i in range(2):
            ex_ = torch.randperm(8, generator=g)[:3].tolist()
            tok = torch.randint(1, 3, (3,), generator=g).tolist()
            plan = p.plan_step(i, ex_, tok, 3, t)
            scheds.append(b.layer(i, plan, ex_, tok))
            p.end_step(i, plan)
    ex = ThreadExecutor(io_lanes=2)
    try:
        for s in scheds:
            ex.run_layer(s, {o.id: (lambda: None) for o in s.ops})
        ex.drain()
    finally:
        ex.close()
    pos = {(kind, i): n for n, (kind, i, _) in enumerate(ex.log)}
    ops = [o for s in scheds for o in s.ops]
    for o in ops:
        for w in o.waits:
            assert pos[("end", w)] < pos[("start", o.id)], f"op {o.id} started before op {w} ended"
    for q in ("device", "d2h", "h2d", "cpu"):
        started = [i for kind, i, qq in ex.log if kind == "start" and qq == q]
        assert started == sorted(o.id for o in ops if o.queue == q)


def test_an_op_error_reaches_the_host_and_its_dependents():
    p, b = _planner(), ScheduleBuilder()
    plan = p.plan_step(0, [0, 1], [2, 2], 2, 1)
    s = b.layer(0, plan, [0, 1], [2, 2])
    h2d = s.of("h2d")[0]

    def boom():
        raise OSError("disk gone")

    ex = ThreadExecutor()
    try:
        ex.run_layer(s, {h2d.id: boom})
        with pytest.raises(OSError, match="disk gone"):
            ex.join(s.of("moe", "fills")[0].id)
    finally:
        ex.close()


def test_make_executor_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="CUDA device"):
        make_executor("cuda", torch.device("cpu"))
    with pytest.raises(ValueError, match="one of inline, threads, cuda"):
        make_executor("streams", torch.device("cpu"))


@pytest.fixture(scope="module")
def reference(cache_checkpoint):
    llm = LLM(str(cache_checkpoint))
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11], [100, 101, 102], [9] * 20]
    try:
        return {
            "prompts": prompts,
            "logits": llm.logits(list(range(3, 40))),
            "tokens": [o.token_ids for o in llm.generate(prompts, GREEDY)],
        }
    finally:
        llm.close()


@pytest.mark.parametrize(
    "kw",
    [
        dict(device_memory="27%", cpu_compute="always", prefetch="device"),  # every miss on the CPU queue
        dict(
            device_memory="27%", cpu_compute="never", prefetch="device", prefill_admit_tokens=10_000
        ),  # fills
        dict(
            device_memory="13%", host_memory="19%", cpu_compute="always", prefetch="host", exclusive=False
        ),  # partial host tier
        dict(
            device_memory="13%", host_memory="19%", cpu_compute="never", prefetch="device", exclusive=False
        ),  # fills + waves
    ],
    ids=["cpu", "fills", "host-partial-cpu", "host-partial-fills-waves"],
)
@pytest.mark.parametrize("backend", ["inline", "threads"])
def test_tiered_cache_through_each_cpu_backend_equals_resident(cache_checkpoint, reference, kw, backend):
    llm = LLM(str(cache_checkpoint), **kw)
    try:
        llm.experts.use_executor(backend)
        logits = llm.logits(list(range(3, 40)))
        toks = [o.token_ids for o in llm.generate(reference["prompts"], GREEDY)]
        llm.experts.check(contents=True)
        stats = llm.expert_stats()
    finally:
        llm.close()
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=1e-4)
    assert toks == reference["tokens"]
    assert stats["misses"] > 0
    if kw["cpu_compute"] == "always":
        assert stats["cpu_computed_share"] == 1.0
    else:
        assert stats["cpu_computed_share"] == 0.0 and stats["per_tier"]["device"]["bytes_in"] > 0
    if (
        kw["device_memory"] == "13%" and kw["cpu_compute"] == "never"
    ):  # 2 slots, top-2: batches go through waves
        assert sum(layer["waves"] for layer in stats["per_layer"]) > 0


@pytest.mark.parametrize("backend", ["inline", "threads"])
def test_cpu_computed_misses_admitted_beside_the_cpu_job_give_the_same_tokens(
    cache_checkpoint, reference, backend
):
    """The cost rule as on CUDA (here: one-row uses go to the CPU): decode misses are computed on
    the CPU queue and copied into their slots beside it; the next use reads the slot."""
    from dataclasses import replace

    llm = LLM(str(cache_checkpoint), device_memory="27%", prefetch="off")
    try:
        cache = llm.experts
        cache.planner.cfg = replace(cache.planner.cfg, cpu_compute="cost")
        cache.planner.cpu_faster = lambda rows: rows <= 1
        cache.use_executor(backend)
        toks = [o.token_ids for o in llm.generate(reference["prompts"], GREEDY)]
        cache.check(contents=True)
        stats = llm.expert_stats()
    finally:
        llm.close()
    assert toks == reference["tokens"]
    per = stats["per_layer"]
    assert sum(layer["cpu_admitted"] for layer in per) > 0
    assert 0 < stats["cpu_admitted_share"] <= stats["cpu_computed_share"] < 1


@pytest.mark.gpu
@pytest.mark.parametrize("cpu_compute", ["auto", "never", "always"])
def test_cuda_executor_gives_the_resident_tokens(cache_checkpoint, cpu_compute):
    """On a GPU: the tiered cache runs its steps through the CUDA executor (streams, per-slot
    events, the CPU job on its worker) and decodes the tokens of every expert resident."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11], [100, 101, 102]]
    ref = LLM(str(cache_checkpoint), device="cuda", dtype=torch.float32)
    try:
        want = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    finally:
        ref.close()
    llm = LLM(
        str(cache_checkpoint),
        device="cuda",
        dtype=torch.float32,
        device_memory="50%",
        cpu_compute=cpu_compute,
    )
    try:
        assert llm.experts.executor is not None
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        llm.experts.check(contents=True)
        stats = llm.expert_stats()
    finally:
        llm.close()
    assert got == want
    assert stats["misses"] > 0
    if cpu_compute == "always":
        assert stats["cpu_computed_share"] == 1.0


@pytest.mark.parametrize("backend", ["inline", "threads"])
def test_a_failed_read_fails_the_step_and_close_still_closes(cache_checkpoint, reference, backend):
    """A disk read on the io queue fails: the step that needed it raises the read's error (not a
    hang, not garbage), and close() still closes."""
    llm = LLM(str(cache_checkpoint), device_memory="13%", host_memory="19%", exclusive=False, prefetch="off")
    cache = llm.experts
    cache.use_executor(backend)

    def gone(i, e, dst):
        raise OSError(f"layer index {i} expert {e}: disk gone")

    cache.read_into = gone
    try:
        with pytest.raises(OSError, match="disk gone"):
            llm.logits(list(range(3, 40)))
    finally:
        llm.close()
    ex = cache.executor
    threads = (
        ex.threads
        if backend == "threads"
        else [t for p in (ex.io, ex.copy) for t in getattr(p, "_threads", ())]
    )
    assert not any(t.is_alive() for t in threads)


def _op(i, kind, waits=(), **kw):
    from expertcache.experts.schedule import Op

    return Op(i, kind, 0, tuple(waits), **kw)


@pytest.mark.parametrize("enqueuer", [True, False])
def test_a_copy_behind_host_work_is_not_overtaken_by_a_later_copy_of_its_queue(enqueuer):
    """The CUDA backend's routing, emulated on threads (`enqueuer=True`): copy A waits on a disk read
    still running, so it goes through the enqueuer; copy B of the same queue, issued after it with
    no waits, must not run first (a host slot's last reader is tracked per queue, assuming FIFO).
    The read is held until B was submitted; without the per-queue rule B would end before A started."""
    release = threading.Event()
    read, a, b = (
        _op(0, "read", experts=(1,), host_slot=0),
        _op(1, "h2d", [0], slot=0, host_slot=0),
        _op(2, "h2d", slot=1, host_slot=0),
    )
    ex = ThreadExecutor(enqueuer=enqueuer)
    try:
        ex.submit(read, lambda: release.wait(LATCH_S))
        ex.submit(a, lambda: None)
        ex.submit(b, lambda: None)
        release.set()
        ex.drain()
    finally:
        ex.close()
    order = [(kind, i) for kind, i, _ in ex.log]
    assert order.index(("end", a.id)) < order.index(("start", b.id))


def _tensor_bytes_held(ex) -> int:
    """Bytes of the tensors reachable from executor `ex` through Python references, and from the
    local variables of its threads' frames (modules, classes and functions' globals not followed):
    what an executor keeps alive."""
    import gc
    import sys
    import types

    threads = list(getattr(ex, "threads", ())) + [
        t for p in (getattr(ex, "io", None), getattr(ex, "copy", None)) for t in getattr(p, "_threads", ())
    ]
    frames = sys._current_frames()
    roots = [ex]
    for t in threads:
        f = frames.get(t.ident)
        while f is not None:
            roots.extend(f.f_locals.values())
            f = f.f_back
    seen, todo, total, storages = {id(r) for r in roots}, roots, 0, set()
    while todo:
        for r in gc.get_referents(todo.pop()):
            if id(r) in seen or isinstance(r, (type, types.ModuleType)):
                continue
            seen.add(id(r))
            if isinstance(r, torch.Tensor):
                key = r.untyped_storage().data_ptr()
                if key not in storages:
                    storages.add(key)
                    total += r.untyped_storage().nbytes()
                continue
            if isinstance(r, types.FunctionType):
                r = r.__closure__ or ()
            todo.append(r)
    return total


@pytest.mark.parametrize("backend", ["inline", "threads"])
def test_a_long_prefill_leaves_no_layer_result_held_by_the_executor(checkpoint, backend):
    """A 2048-token prompt through a tiny model with every miss computed on the CPU (each layer's
    CPU job makes a [rows, H] result and the layer an output [2048, H]): afterwards the executor
    references no tensor bytes at all (a brute-force walk of what it holds)."""
    ck = checkpoint(
        "qwen3_moe",
        dtype=torch.bfloat16,
        num_experts=16,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        max_position_embeddings=4096,
    )
    llm = LLM(str(ck), device_memory="25%", cpu_compute="always", prefetch="off", max_model_len=4096)
    try:
        llm.experts.use_executor(backend)
        prompt = [3 + (7 * n) % 300 for n in range(2048)]
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        ex = llm.experts.executor
        ex.drain()
        stats = llm.expert_stats()
        held = _tensor_bytes_held(ex)
    finally:
        llm.close()
    assert stats["cpu_computed_share"] == 1.0 and stats["misses"] > 0
    assert held == 0
