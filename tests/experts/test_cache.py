"""The tiered expert cache never changes the math, and keeps its invariants under stress.

Reference: the same checkpoint with every expert resident (itself checked against
transformers in test_families.py). Slot contents are compared with the checkpoint read by
safetensors' own loader (tests/safetensors_reference.py), not by the byte ranges that fill them."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors_reference import independent_slot_checks

from expertcache import LLM, SamplingParams, kernels
from expertcache.errors import BudgetError
from expertcache.experts.policy import POLICIES

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(cache_checkpoint):
    llm = LLM(str(cache_checkpoint))
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11], [100, 101, 102], [9] * 20]
    return {
        "prompts": prompts,
        "logits": llm.logits(list(range(3, 60))),
        "tokens": [o.token_ids for o in llm.generate(prompts, GREEDY)],
    }


@pytest.fixture(autouse=True)
def _slot_checks_read_safetensors(monkeypatch):
    independent_slot_checks(monkeypatch)


def run(cache_checkpoint, reference, **kw):
    llm = LLM(str(cache_checkpoint), verify=True, **kw)
    try:
        logits = llm.logits(list(range(3, 60)))
        toks = [o.token_ids for o in llm.generate(reference["prompts"], GREEDY)]
        llm.experts.check(contents=True)
        assert getattr(llm.experts, "independent_checks", 0) > 0 or not hasattr(llm.experts, "dev_tables")
        return logits, toks, llm.expert_stats()
    finally:
        llm.close()


@pytest.mark.parametrize("policy", sorted(p for p in POLICIES if p != "min"))
@pytest.mark.parametrize("budget", ["2", "4", "8"])  # experts per layer in the fastest tier (top_k .. half)
@pytest.mark.parametrize("prefetch", [True, False])
def test_any_budget_policy_prefetch_gives_resident_output(
    cache_checkpoint, reference, policy, budget, prefetch
):
    # gate_up [64, 64] + down [64, 32] of one expert as the fastest tier holds it: bf16 as stored where
    # the CPU kernels read it, else fp32 compute copies
    per_layer = 3 * 64 * 32 * (2 if kernels.reads_stored("cpu", torch.float32) else 4)
    logits, toks, stats = run(
        cache_checkpoint,
        reference,
        device_memory=int(budget) * per_layer * 3,
        cache_policy=policy,
        prefetch=prefetch,
    )
    torch.testing.assert_close(logits, reference["logits"], atol=1e-5, rtol=0)
    assert toks == reference["tokens"]
    assert stats["hits"] + stats["misses"] > 0
    if not prefetch:
        assert stats["prefetch"]["issued"] == 0


@pytest.mark.parametrize("cpu_compute", ["always", "never", "auto"])
@pytest.mark.parametrize("prefetch", ["auto", "host", "device", "off"])
@pytest.mark.parametrize("overlap_io", [True, False])
def test_cpu_compute_and_streamed_host_tier_give_resident_output(
    cache_checkpoint, reference, cpu_compute, prefetch, overlap_io
):
    logits, toks, stats = run(
        cache_checkpoint,
        reference,
        device_memory="13%",
        host_memory="19%",
        cpu_compute=cpu_compute,
        prefetch=prefetch,
        overlap_io=overlap_io,
    )
    torch.testing.assert_close(logits, reference["logits"], atol=1e-5, rtol=0)
    assert toks == reference["tokens"]
    assert stats["per_tier"]["disk"]["bytes_read"] > 0
    if cpu_compute == "always":
        assert stats["cpu_computed_share"] == 1.0
    host = stats["per_tier"]["host"]
    if prefetch in ("auto", "host"):  # CPU-only auto = disk reads ahead into host RAM
        assert 0 < host["prefetch_useful"] <= host["prefetch_issued"] and stats["prefetch"]["issued"] == 0
    else:
        assert host["prefetch_issued"] == 0 and (stats["prefetch"]["issued"] > 0) == (prefetch == "device")


def test_waves_when_batch_needs_more_experts_than_slots(cache_checkpoint, reference):
    # 2 slots per layer, a 57-token prefill routes to nearly all 16 experts: most go through waves
    logits, toks, stats = run(cache_checkpoint, reference, device_memory="13%", prefill_admit_tokens=10_000)
    torch.testing.assert_close(logits, reference["logits"], atol=1e-5, rtol=0)
    assert toks == reference["tokens"]
    assert sum(layer["waves"] for layer in stats["per_layer"]) > 0


def test_prefill_does_not_evict_decode_working_set(cache_checkpoint):
    llm = LLM(str(cache_checkpoint), device_memory="25%", prefetch=False)  # 4 slots per layer
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0))
    before = [sorted(t.resident()) for t in llm.experts.dev_tables]
    assert all(len(r) == 4 for r in before)  # decode filled every slot
    llm.logits([random.Random(0).randrange(300) for _ in range(200)])  # long prefill
    after = [sorted(t.resident()) for t in llm.experts.dev_tables]
    assert after == before
    llm.close()


def test_budget_below_top_k_is_a_clear_error(cache_checkpoint):
    with pytest.raises(BudgetError, match=r"device_memory=.*top_k=2"):
        LLM(str(cache_checkpoint), device_memory="1KiB")
    with pytest.raises(BudgetError, match=r"host_memory=.*top_k=2"):
        LLM(str(cache_checkpoint), device_memory="13%", host_memory="40KiB")


def test_budget_for_everything_loads_everything_once(cache_checkpoint, reference):
    llm = LLM(str(cache_checkpoint), device_memory="100%")
    assert "every expert resident" in " ".join(llm.plan_lines)
    assert [o.token_ids for o in llm.generate(reference["prompts"], GREEDY)] == reference["tokens"]


def _stress_requests(rng):
    return [
        (
            [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))],
            SamplingParams(max_tokens=rng.randint(1, 8), temperature=1.0, seed=i),
        )
        for i in range(rng.randint(2, 5))
    ]


def test_stress_invariants_every_step(cache_checkpoint):
    """Random batches, budgets and policies; invariants and slot bytes checked after every step, and
    every seeded sample equal to the resident engine's."""
    resident = LLM(str(cache_checkpoint))
    rng = random.Random(1)
    for trial in range(4):
        llm = LLM(
            str(cache_checkpoint),
            verify=True,
            device_memory=f"{rng.choice([13, 19, 25, 50])}%",
            host_memory=rng.choice([None, "13%", "25%"]),
            cache_policy=rng.choice(sorted(set(POLICIES) - {"min"})),
            prefetch=rng.choice(["device", "host", "off"]),
            overlap_io=rng.random() < 0.7,
            exclusive=None if rng.random() < 0.7 else False,
            cpu_compute=rng.choice(["auto", "always", "never"]),
        )
        eng = llm.engine
        requests = _stress_requests(rng)
        seqs = [eng.add_request(prompt, params) for prompt, params in requests]
        while eng.has_unfinished():
            eng.step()
            llm.experts.check(contents=True)
        assert llm.experts.independent_checks > 0
        llm.close()
        want = [resident.generate([prompt], params)[0].token_ids for prompt, params in requests]
        assert [list(s.generated) for s in seqs] == [list(w) for w in want], trial
    resident.close()


def test_pinned_expert_is_never_the_victim():
    """A policy that always names the newest expert (the just-loaded one) must not get it evicted."""
    from expertcache.experts.policy import Policy
    from expertcache.experts.slots import SlotTable

    class Newest(Policy):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.order = []

        def insert(self, e, t):
            self.order.append(e)

        def remove(self, e):
            self.order.remove(e)

        def victim(self, candidates):
            return max(candidates, key=self.order.index)

    table = SlotTable(8, 2, Newest(num_experts=8, capacity=2))
    a = table.access(0, 1)
    b = table.access(1, 1)
    c = table.access(2, 1)  # both slots pinned: no slot, nothing evicted
    assert (a.slot, b.slot, c.slot) == (0, 1, -1) and c.evicted == -1
    table.unpin_all()
    d = table.access(3, 2)
    assert d.evicted == 1  # the newest unpinned one, after the step ended
    table.check()


def test_expert_stats_layout(cache_checkpoint):
    llm = LLM(str(cache_checkpoint), device_memory="25%")
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0))
    s = llm.expert_stats()
    assert {"hits", "misses", "bytes_moved", "per_tier", "per_layer", "use_counts"} <= set(s)
    assert set(s["per_tier"]) == {"device", "host", "disk"}
    counts = torch.tensor(s["use_counts"])
    assert counts.shape == (3, 16)
    # every forward routes top_k=2 experts per token per layer: 4 prompt + 3 decode tokens
    assert counts.sum(dim=1).tolist() == [2 * 7] * 3
    assert s["hits"] + s["misses"] == sum(p["hits"] + p["misses"] for p in s["per_layer"])
    llm.close()


def test_saved_stats_warm_start(cache_checkpoint, tmp_path):
    llm = LLM(str(cache_checkpoint), device_memory="25%")
    llm.generate([[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=6, temperature=0))
    path = tmp_path / "stats.json"
    llm.experts.save_stats(path)
    counts = torch.tensor(llm.expert_stats()["use_counts"])
    llm.close()
    warm = LLM(str(cache_checkpoint), device_memory="25%", load_stats=str(path), cache_policy="static")
    for i, table in enumerate(warm.experts.dev_tables):
        hottest = set(torch.argsort(counts[i], descending=True, stable=True)[:4].tolist())
        assert len(set(table.resident()) & hottest) >= 3  # ties at the cut may pick another
    warm.close()
    bad = tmp_path / "bad.json"
    bad.write_text('{"layers": [0], "use_counts": [[1, 2]]}')
    with pytest.raises(ValueError, match="stats are for layers"):
        LLM(str(cache_checkpoint), device_memory="25%", load_stats=str(bad))


@pytest.mark.parametrize("host", ["0", None, "25%"])
@pytest.mark.parametrize("prefetch", ["auto", "off"])
@pytest.mark.parametrize("overlap_io", [True, False])
def test_low_memory_mode_gives_resident_output(cache_checkpoint, reference, host, prefetch, overlap_io):
    """Stored-dtype dense weights and expert slots, converted per use; with host_memory=0 no host tier:
    misses (and, auto, the next layer's predicted experts) are read from disk straight into the slots."""
    budget = 6 * 3 * (3 * 64 * 32 * 2)  # 6 bf16 experts x 3 layers (3 experts if they were fp32)
    logits, toks, stats = run(
        cache_checkpoint,
        reference,
        device_memory=budget,
        host_memory=host,
        low_memory=True,
        prefetch=prefetch,
        overlap_io=overlap_io,
    )
    torch.testing.assert_close(logits, reference["logits"], atol=1e-5, rtol=0)
    assert toks == reference["tokens"]
    llm = LLM(
        str(cache_checkpoint), device_memory=budget, host_memory=host, low_memory=True, prefetch=prefetch
    )
    assert (
        llm.model.lm_head.dtype == torch.bfloat16 and llm.experts.dev.buf["gate_up"].dtype == torch.bfloat16
    )
    assert llm.experts.device_slots == 6
    if host == "0":
        assert llm.experts.direct and llm.experts.prefetch_mode == {"auto": "device", "off": "off"}[prefetch]
        assert stats["per_tier"]["host"]["hits"] == 0 and stats["per_tier"]["disk"]["bytes_read"] > 0
        # each read lands in a device slot (demand fill or prefetch) or serves one wave, nothing else
        waves = sum(layer["waves"] for layer in stats["per_layer"])
        assert (
            stats["per_tier"]["disk"]["bytes_read"]
            == stats["per_tier"]["device"]["bytes_in"] + waves * 3 * 64 * 32 * 2
        )
        assert (stats["prefetch"]["useful"] > 0) == (prefetch == "auto")
    llm.close()


@pytest.mark.parametrize("kw", [{}, {"device_memory": "25%"}, {"device_memory": "25%", "host_memory": "25%"}])
def test_progress_callback_counts_every_checkpoint_byte(cache_checkpoint, kw):
    seen = []
    llm = LLM(str(cache_checkpoint), progress=lambda read, total: seen.append((read, total)), **kw)
    reads = [r for r, _ in seen]
    assert reads == sorted(reads) and seen[-1][0] <= seen[-1][1]
    if "host_memory" not in kw:  # everything is read at load (a streamed host tier reads on demand)
        assert seen[-1][0] == seen[-1][1] == llm.index.nbytes()
    llm.close()


@pytest.mark.parametrize(
    "policy,backend,prefetch",
    [
        ("lru", "inline", "off"),
        ("lfru-admit", "inline", "off"),
        ("lru", "threads", "off"),
        ("lru", "threads", "host"),
        ("lru", "inline", "device"),
        ("lru", "threads", "device"),
    ],
)
def test_exclusive_tiers_hold_disjoint_experts_and_exact_bytes(
    cache_checkpoint, reference, policy, backend, prefetch
):
    """Device evictions are demoted into host slots (fp32 -> bf16, exact), promotions free theirs; the
    demotions are schedule ops, so the threads backend (the CUDA path's ordering) runs them too."""
    llm = LLM(
        str(cache_checkpoint),
        verify=True,
        device_memory="13%",
        host_memory="25%",
        cache_policy=policy,
        prefetch=prefetch,
    )
    assert llm.experts.exclusive
    llm.experts.use_executor(backend)
    eng = llm.engine
    seqs = [eng.add_request(prompt, GREEDY) for prompt in reference["prompts"]]
    while eng.has_unfinished():
        eng.step()
        llm.experts.check(contents=True)  # host slot bytes == checkpoint bytes, demoted ones included
        for dev, host in zip(llm.experts.dev_tables, llm.experts.host_tables):
            # (a device prefetch also places its expert in a host slot: the planner's plan_prefetch)
            assert prefetch == "device" or not set(dev.resident()) & set(host.resident())
    assert [seq.generated for seq in seqs] == reference["tokens"]
    s = llm.expert_stats()
    assert s["per_tier"]["host"]["demoted"] > 0 and s["per_tier"]["host"]["hits"] > 0
    llm.close()


def test_exclusive_tiers_raise_the_ram_hit_rate(cache_checkpoint):
    """Same run with and without demotion: exclusive tiers hold more distinct experts in RAM."""
    rates = {}
    for exclusive in (False, True):
        llm = LLM(
            str(cache_checkpoint),
            device_memory="13%",
            host_memory="13%",
            cache_policy="lru",
            prefetch="off",
            exclusive=exclusive,
        )
        llm.generate([[5, 17, 42, 99]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        s = llm.expert_stats()
        rates[exclusive] = s["per_tier"]["disk"]["bytes_read"]
        llm.close()
    assert rates[True] < rates[False]


@pytest.mark.parametrize(
    "argv, want",
    [
        ([], None),
        (["--prefetch"], "device"),
        (["--prefetch", "host"], "host"),
        (["--no-prefetch"], "off"),
        (["--prefetch", "auto"], "auto"),
    ],
)
def test_cli_prefetch_flag(argv, want):
    import argparse

    from expertcache.cli_common import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(argv)).get("prefetch") == want


def test_slot_check_catches_a_swapped_expert(cache_checkpoint):
    """The safetensors-based slot check can fail: a device slot given another expert's bytes (what a
    wrong byte range would do) is named by layer and expert."""
    llm = LLM(str(cache_checkpoint), device_memory="25%", prefetch="off")
    try:
        llm.generate([[5, 17, 42, 99]], GREEDY)
        llm.experts.check(contents=True)
        lut = list(llm.experts.lut[0])
        held = [e for e in range(len(lut)) if lut[e] >= 0]
        a, b = held[0], held[1]
        va, vb = llm.experts.dev.views(0, lut[a]), llm.experts.dev.views(0, lut[b])
        for n in va:
            va[n].copy_(vb[n])
        with pytest.raises(AssertionError, match=f"layer {llm.experts.layers[0]} expert {a} part"):
            llm.experts.check(contents=True)
    finally:
        llm.close()
