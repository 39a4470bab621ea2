"""A trace recorded during a real generation replays to exactly the engine's own counters."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors_reference import independent_slot_checks

from expertcache import LLM, SamplingParams
from expertcache.trace.format import RoutingTrace
from expertcache.trace.recorder import RoutingRecorder
from expertcache.trace.replay import replay, replay_config


@pytest.fixture(autouse=True)
def _slot_checks_read_safetensors(monkeypatch):
    """verify=True and check(contents=True) compare slots with the checkpoint read by safetensors."""
    independent_slot_checks(monkeypatch)


@pytest.mark.parametrize("policy", ["lru", "lfru", "lfru-admit"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_replay_equals_engine_counters(cache_checkpoint, tmp_path, policy, prefetch):
    llm = LLM(
        str(cache_checkpoint),
        device_memory="25%",
        cache_policy=policy,
        prefetch=prefetch,
        cpu_compute="never",
        prefill_admit_tokens=10**6,
    )
    slots = llm.experts.device_slots
    llm.engine.recorder = RoutingRecorder(llm)
    llm.generate(
        [[5, 6, 7, 8, 9], [40, 41], list(range(100, 130))],
        [SamplingParams(max_tokens=n, temperature=0.8, seed=n) for n in (12, 20, 6)],
    )
    path = tmp_path / "trace.npz"
    llm.engine.recorder.save(path)
    stats = llm.expert_stats()
    llm.close()

    trace = RoutingTrace.load(path)
    trace.validate(num_layers=3)
    assert set(trace.phase.tolist()) == {0, 1}
    res = replay(trace, policy, slots, prefetch=prefetch, with_min=False)
    assert (res.hits, res.misses) == (stats["hits"], stats["misses"])
    for ours, theirs in zip(stats["per_layer"], res.per_layer):
        assert (ours["hits"], ours["misses"]) == (theirs["hits"], theirs["misses"])
    if prefetch:
        assert (res.prefetch_issued, res.prefetch_useful) == (
            stats["prefetch"]["issued"],
            stats["prefetch"]["useful"],
        )


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
@pytest.mark.parametrize("prefetch", ["host", "device"])
def test_replay_equals_engine_with_every_feature_on(cache_checkpoint, tmp_path, policy, prefetch):
    """Prefill admission, CPU-computed misses, waves, exclusive tiers, a partial host tier read
    from disk, prefetch and its gate: all on; every counter of every layer agrees, and the output
    is still the resident one."""
    kw = dict(device_memory="25%", host_memory="38%", prefill_admit_tokens=12, prefetch=prefetch)
    prompts = [[5, 6, 7, 8, 9], [40, 41], list(range(100, 130)), [7, 7, 8]]
    params = [SamplingParams(max_tokens=n, temperature=0.8, seed=n) for n in (12, 20, 6, 9)]
    ref = LLM(str(cache_checkpoint))
    want = [o.token_ids for o in ref.generate(prompts, params)]
    ref.close()
    llm = LLM(str(cache_checkpoint), cache_policy=policy, **kw)
    planner = llm.experts.planner
    assert llm.experts.exclusive and llm.experts.host_slots < 16
    planner.cfg = replace(
        planner.cfg, cpu_compute="cost"
    )  # force the per-miss choice: 1-token misses on the CPU
    planner.cpu_faster = lambda tokens: tokens == 1
    llm.engine.recorder = RoutingRecorder(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    llm.experts.check(contents=True)
    path = tmp_path / "trace.npz"
    llm.engine.recorder.save(path)
    stats = llm.expert_stats()
    llm.close()
    tot = {k: sum(layer[k] for layer in stats["per_layer"]) for k in stats["per_layer"][0] if k != "layer"}
    for k in (
        "cpu_computed",
        "waves",
        "demoted",
        "host_misses",
        "host_hits",
        "disk_bytes",
        "prefetch_issued" if prefetch == "device" else "host_prefetch_issued",
    ):
        assert tot[k] > 0, f"{k}: the feature was not exercised"
    res = replay_config(RoutingTrace.load(path), planner.cfg, cpu_faster=planner.cpu_faster)
    for ours, theirs in zip(stats["per_layer"], res.per_layer):
        assert ours == {k: v for k, v in theirs.items() if k != "hit_rate"}


def test_recorded_rows_match_use_counts(cache_checkpoint, tmp_path):
    llm = LLM(str(cache_checkpoint), device_memory="25%")
    llm.engine.recorder = RoutingRecorder(llm)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0))
    trace = llm.engine.recorder.trace()
    counts = torch.tensor(llm.expert_stats()["use_counts"])
    for li in range(3):
        assert torch.equal(
            torch.bincount(torch.from_numpy(trace.experts[:, li].ravel()).long(), minlength=16), counts[li]
        )
    assert trace.token.tolist() == list(range(7))  # 3 prompt tokens + 4 decoded inputs
    llm.close()


def test_record_routing_option_writes_trace_on_close(cache_checkpoint, tmp_path):
    path = tmp_path / "run.npz"
    llm = LLM(str(cache_checkpoint), record_routing=str(path))  # the same option `generate` and `serve` pass
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0))
    llm.close()
    trace = RoutingTrace.load(path)
    trace.validate(num_layers=3)
    assert len(set(trace.seq.tolist())) == 2
    assert len(trace) == 3 + 2 + 2 * 2  # prompts, then 2 decode inputs each
