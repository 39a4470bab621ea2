"""Continuous batching under KV pressure: preemption and recomputation never change outputs."""

from __future__ import annotations

from expertcache import LLM, SamplingParams
from expertcache.engine.kv_cache import KVCache


def test_preemption_recomputes_and_matches_unconstrained(qwen3_checkpoint):
    prompts = [[5 + i, 17, 42, 99, 7, 3, 250, 11, 9 + i] * 3 for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(qwen3_checkpoint), max_model_len=64)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]

    llm = LLM(str(qwen3_checkpoint), max_model_len=64, block_size=4, prefix_caching=False)
    per_block = KVCache.bytes_per_block(llm.cfg.num_layers, 4, llm.cfg.kv_token_shapes, llm.dtype)
    tight = LLM(
        str(qwen3_checkpoint),
        max_model_len=64,
        block_size=4,
        prefix_caching=False,
        kv_cache_memory=per_block * 20,
    )  # 80 tokens for 5 sequences of up to 51
    assert tight.kv.num_blocks == 20
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.kv.num_free == tight.kv.num_blocks  # everything released at the end
    assert tight.engine.counters.prompt_tokens == sum(len(p) for p in prompts)  # recomputation not counted


def test_chunked_prefill_interleaves_with_decode(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), max_num_batched_tokens=8)
    eng = llm.engine
    short = eng.add_request([5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    eng.step()  # the short prompt is prefilled
    long = eng.add_request(list(range(3, 60)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    decoded_during_prefill = 0
    while long.num_computed < long.prompt_len:
        before = len(short.generated)
        eng.step()
        decoded_during_prefill += len(short.generated) - before
    assert decoded_during_prefill >= 5  # the running decode kept going while the long prompt was chunked
    while eng.has_unfinished():
        eng.step()
