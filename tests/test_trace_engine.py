"""A trace recorded during a real generation replays to exactly the engine's own counters."""

from __future__ import annotations

import pytest
import torch

from expertcache import LLM, SamplingParams
from expertcache.trace.format import RoutingTrace
from expertcache.trace.recorder import RoutingRecorder
from expertcache.trace.replay import replay


@pytest.mark.parametrize("policy", ["lru", "lfru", "lfru-admit"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_replay_equals_engine_counters(cache_checkpoint, tmp_path, policy, prefetch):
    llm = LLM(str(cache_checkpoint), device_memory="25%", cache_policy=policy, prefetch=prefetch, cpu_compute="never",
              prefill_admit_tokens=10**6)
    slots = llm.experts.device_slots
    llm.engine.recorder = RoutingRecorder(llm)
    llm.generate([[5, 6, 7, 8, 9], [40, 41], list(range(100, 130))],
                 [SamplingParams(max_tokens=n, temperature=0.8, seed=n) for n in (12, 20, 6)])
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
        assert (res.prefetch_issued, res.prefetch_useful) == (stats["prefetch"]["issued"], stats["prefetch"]["useful"])


def test_recorded_rows_match_use_counts(cache_checkpoint, tmp_path):
    llm = LLM(str(cache_checkpoint), device_memory="25%")
    llm.engine.recorder = RoutingRecorder(llm)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0))
    trace = llm.engine.recorder.trace()
    counts = torch.tensor(llm.expert_stats()["use_counts"])
    for li in range(3):
        assert torch.equal(torch.bincount(torch.from_numpy(trace.experts[:, li].ravel()).long(), minlength=16), counts[li])
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
