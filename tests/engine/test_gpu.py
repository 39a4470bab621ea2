"""The CUDA path of the expert cache: pinned host slots, copy stream + events, staging waves, CPU-computed
misses, prefetch into device slots, a partial host tier read from disk.

Each case's device budget is computed from the plan's own arithmetic (slots x layers x bytes per expert
in the compute dtype, + the one staging expert CUDA reserves), so it holds the slots the case needs;
the test asserts the plan gave exactly those slots, that the feature the case names ran (its counters),
and that logits and greedy tokens equal the fully resident model's. No `verify=True` (its host syncs
would serialise the streams whose concurrency these cases test); slot contents are checked against the
checkpoint once at the end, after everything landed.

Marked `gpu`: skipped without CUDA (conftest.py). `python -m pytest -q -m gpu tests/engine/test_gpu.py`."""

from __future__ import annotations

import json

import pytest
import torch

from expertcache import LLM, SamplingParams

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [100, 101, 102]]
LONG = list(range(3, 60))


def expert_bytes(ckpt, dtype: torch.dtype) -> tuple[int, int]:
    """(MoE layers, bytes of one expert in `dtype`) from config.json: gate, up [I, H] and down [H, I]."""
    cfg = json.loads((ckpt / "config.json").read_text())
    return cfg["num_hidden_layers"], 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * dtype.itemsize


def device_budget(ckpt, slots: int, dtype=torch.float32) -> int:
    """The engine's whole device budget that leaves exactly `slots` expert slots per layer (the plan's
    other terms for LLM's default options on this GPU, plus the slots)."""
    from expertcache.build.plan import GpuSpec
    from expertcache.config import EngineConfig
    from expertcache.plan.model import budget_for_slots, read_model

    cuda = torch.device("cuda")
    config = EngineConfig.from_kwargs(
        device="cuda", dtype=str(dtype).removeprefix("torch."), device_memory="auto"
    )
    return budget_for_slots(read_model(ckpt), config, slots, GpuSpec.from_device(cuda))


def host_budget(ckpt, slots: int) -> int:
    L, per = expert_bytes(ckpt, torch.bfloat16)  # the host tier holds the stored bf16 bytes
    return slots * L * per


@pytest.fixture(scope="module")
def reference(cache_checkpoint):
    llm = LLM(str(cache_checkpoint), device="cuda", dtype="float32")
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm.logits(LONG)
    finally:
        llm.close()


def waves(s):
    return sum(layer["waves"] for layer in s["per_layer"])


# name -> (device slots, host slots or None for every expert in RAM, LLM keywords, what must have happened)
CASES = {
    "waves": (
        2,
        None,
        dict(cpu_compute="never", prefetch="off", prefill_admit_tokens=0),
        lambda s: waves(s) > 0 and s["cpu_computed_share"] == 0.0,
    ),
    "cpu-misses": (
        4,
        None,
        dict(cpu_compute="always", prefetch="off"),
        lambda s: s["misses"] > 0 and s["cpu_computed_share"] == 1.0 and s["hits"] == 0,
    ),
    "prefetch": (
        4,
        None,
        dict(cpu_compute="never", prefetch="device", prefetch_gate=None),
        lambda s: s["prefetch"]["issued"] > 0 and s["prefetch"]["useful"] > 0 and s["hits"] > 0,
    ),
    "partial-host": (
        4,
        8,
        dict(cpu_compute="never", prefetch="device", prefetch_gate=None),
        lambda s: s["per_tier"]["disk"]["bytes_read"] > 0 and s["per_tier"]["host"]["hits"] > 0,
    ),
    "default": (4, None, {}, lambda s: s["hits"] > 0 and s["misses"] > 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_cache_equals_resident(cache_checkpoint, reference, name):
    slots, host_slots, kw, happened = CASES[name]
    tokens, logits = reference
    host = "100%" if host_slots is None else host_budget(cache_checkpoint, host_slots)
    llm = LLM(
        str(cache_checkpoint),
        device="cuda",
        dtype="float32",
        device_memory=device_budget(cache_checkpoint, slots),
        host_memory=host,
        **kw,
    )
    try:
        cache = llm.experts
        assert cache.device_slots == slots and cache.host_slots == (host_slots or 16)
        L, per = expert_bytes(cache_checkpoint, torch.bfloat16)
        assert cache.host.nbytes == (host_slots or 16) * L * per  # exact: no power-of-two rounding
        assert cache.host.pinned and cache.host.pinned_bytes == cache.host.reserved_bytes
        assert cache.host.buf["gate_up"].is_pinned()
        torch.testing.assert_close(llm.logits(LONG), logits, atol=1e-4, rtol=1e-4)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == tokens
        s = llm.expert_stats()
        assert happened(s), {
            k: s[k] for k in ("hits", "misses", "cpu_computed_share", "prefetch", "per_tier")
        }
        cache.check(contents=True)  # after every copy landed: the slots hold the checkpoint's bytes
    finally:
        llm.close()


def test_cuda_bf16_cache_equals_bf16_resident(cache_checkpoint):
    resident = LLM(str(cache_checkpoint), device="cuda")
    assert resident.dtype == torch.bfloat16
    want = resident.logits(LONG)
    resident.close()
    llm = LLM(
        str(cache_checkpoint),
        device="cuda",
        device_memory=device_budget(cache_checkpoint, 4, torch.bfloat16),
        host_memory="100%",
        cpu_compute="never",
    )
    try:
        assert llm.experts.device_slots == 4
        got = llm.logits(LONG)
        # bf16 activations: the grouped and per-slot paths round differently, within bf16's step
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
        assert llm.expert_stats()["misses"] > 0
    finally:
        llm.close()
