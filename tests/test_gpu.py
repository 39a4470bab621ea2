"""The CUDA path of the expert cache: pinned host slots, copy stream + events, staging waves.

Marked `gpu`: skipped without CUDA (conftest.py). Run on a GPU machine with
`python -m pytest -q -m gpu tests/test_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from expertcache import LLM, SamplingParams

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(cache_checkpoint):
    llm = LLM(str(cache_checkpoint), device="cuda", dtype="float32")
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11], [100, 101, 102]]
    return prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)], llm.logits(list(range(3, 60)))


@pytest.mark.parametrize("kw", [
    dict(device_memory="13%"),
    dict(device_memory="13%", host_memory="13%"),
    dict(device_memory="25%", prefetch=False, cpu_compute="never"),
    dict(device_memory="25%", cpu_compute="always"),
    dict(device_memory="13%", prefill_admit_tokens=10_000),  # waves through the staging slot
])
def test_cuda_cache_equals_resident(cache_checkpoint, reference, kw):
    prompts, tokens, logits = reference
    llm = LLM(str(cache_checkpoint), device="cuda", dtype="float32", verify=True, **kw)
    assert llm.experts.host.buf["gate_up"].is_pinned()
    torch.testing.assert_close(llm.logits(list(range(3, 60))), logits, atol=1e-4, rtol=1e-4)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == tokens
    llm.experts.check(contents=True)
    llm.close()


def test_cuda_bf16_default_runs(cache_checkpoint):
    llm = LLM(str(cache_checkpoint), device="cuda", device_memory="25%")
    assert llm.dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert len(out.token_ids) == 12
    llm.close()
