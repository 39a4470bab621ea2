"""The aten dispatches a MoE layer costs at decode, counted (never timed).

Every eager op is a host-side dispatch (on CUDA at least one launch or allocator call), so the count
is what the cache step adds to a decode step whatever the machine. A TorchDispatchMode counts every
aten op on the calling thread (the inline executor runs the whole step there) over greedy decode
steps of the shipped demo model (6 MoE layers, 32 experts, top-4): the decode steps' count is that of
a generate with N + 1 tokens less that of one with 1 (the prefill), so sampling and the engine count
alike for both configurations. Resident (every expert in the pool) against tiered (75% of the
experts in the fastest tier, all of them in host RAM): the tiered step's own dispatches (inside the
provider's forward) and what it adds to the whole step, per MoE layer and decode step.
"""

from __future__ import annotations

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from expertcache import LLM, SamplingParams
from expertcache.demo import demo_model_dir

# aten dispatches per MoE layer per decode step beyond attention: issue #35's goal was 25; the step
# measured 19.2 (its own forward 13.3) before the ids were read in place, 10.7 (7.5) after
BUDGET = 14
OWN_BUDGET = 9  # inside the cache's forward
PROMPT = [5, 6, 7, 8, 9, 10]
STEPS = 8


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _generate_count(llm, tokens: int) -> int:
    with Count() as c:
        llm.generate([PROMPT], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return c.n


def _decode_count(llm) -> tuple[float, list[int]]:
    """Dispatches per MoE layer per decode step, and the tokens."""
    p = SamplingParams(max_tokens=STEPS + 1, temperature=0.0, ignore_eos=True)
    toks = llm.generate([PROMPT], p)[0].token_ids  # warm-up: kernels built, every cache path taken once
    n = _generate_count(llm, STEPS + 1) - _generate_count(llm, 1)
    layers = sum(1 for layer in llm.model.layers if "router" in layer)
    return n / STEPS / layers, toks


@pytest.fixture(scope="module")
def demo():
    return str(demo_model_dir(progress=False))


def test_the_cache_step_adds_at_most_its_budget_of_dispatches_at_decode(demo):
    resident = LLM(demo, prefix_caching=False)
    try:
        base, want = _decode_count(resident)
    finally:
        resident.close()
    tiered = LLM(demo, prefix_caching=False, device_memory="75%", host_memory="100%")
    try:
        cache = tiered.experts
        assert cache.executor.inline
        total, got = _decode_count(tiered)
        forward, calls = cache.forward, []

        def counted(layer, x, ids, w):
            with Count() as c:
                out = forward(layer, x, ids, w)
            if x.shape[0] == 1:
                calls.append(c.n)
            return out

        cache.forward = counted
        tiered.generate([PROMPT], SamplingParams(max_tokens=STEPS + 1, temperature=0.0, ignore_eos=True))
        stats = tiered.expert_stats()
    finally:
        tiered.close()
    assert got == want  # the same tokens: the count is of the same work
    assert stats["hits"] > 0 and stats["misses"] > 0
    own = sum(calls) / len(calls)
    print(
        f"resident {base:.1f}, tiered {total:.1f} dispatches per MoE layer per decode step; "
        f"the cache step's own {own:.1f}"
    )
    assert own <= OWN_BUDGET
    assert total - base <= BUDGET
