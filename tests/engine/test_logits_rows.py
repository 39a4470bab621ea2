"""The device plan's logits term is a bound the engine keeps: a step computes at most
`max_logits_rows` prompt tokens' logits (prompt logprobs), and outputs do not depend on it."""

from __future__ import annotations

import torch

from expertcache import LLM, SamplingParams
from expertcache.build.plan import LOGITS_BLOCK_BYTES, logits_block_rows, workspace_bytes


def test_prompt_logprobs_steps_hold_the_logits_bound(qwen3_checkpoint):
    prompt = list(range(3, 43))  # 40 prompt tokens, each needs its logits
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    expected = LLM(str(qwen3_checkpoint), max_num_batched_tokens=64).generate([prompt], params)[0]

    llm = LLM(str(qwen3_checkpoint), max_num_batched_tokens=64)
    llm.engine.scheduler.max_logits_rows = 7
    rows_per_step = []
    real_run_rows = llm.engine.runner.run_rows

    def spy(work, full):
        logits, spans = real_run_rows(work, full)
        rows_per_step.append(logits.shape[0])
        return logits, spans

    llm.engine.runner.run_rows = spy
    got = llm.generate([prompt], params)[0]
    assert max(rows_per_step) <= 7 and len(rows_per_step) >= 40 // 7 + 3  # the prompt went in chunks of <= 7
    assert got.token_ids == expected.token_ids
    assert len(got.prompt_logprobs) == len(expected.prompt_logprobs) == len(prompt)
    for a, b in zip(got.prompt_logprobs[1:], expected.prompt_logprobs[1:]):  # (token, logprob, top-k)
        assert a[0] == b[0] and abs(a[1] - b[1]) < 1e-5
        assert [t for t, _ in a[2]] == [t for t, _ in b[2]]
    # LLM.logits takes the same bound by default: equal to one pass
    whole = llm.logits(prompt, block_rows=64)
    assert torch.allclose(llm.logits(prompt), whole, atol=1e-5)


def test_logits_term_is_the_bound_on_every_device(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint))
    cfg, T, B = llm.cfg, 2048, 16
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    F = logits_block_rows(151936, torch.bfloat16, cuda, T)
    assert F == LOGITS_BLOCK_BYTES // (151936 * 6) == 294  # rows of bf16 + fp32 logits in 256 MiB
    assert logits_block_rows(151936, torch.bfloat16, cpu, T) == F  # RAM is bounded as VRAM is
    assert logits_block_rows(1000, torch.bfloat16, cpu, T) == T  # a small vocabulary: the token budget
    per_row = cfg.vocab_size * 6
    want = min(T, B + logits_block_rows(cfg.vocab_size, torch.bfloat16, cuda, T)) * per_row
    assert [workspace_bytes(cfg, torch.bfloat16, T, B, 256, d)[1] for d in (cpu, cuda)] == [want, want]
    assert llm.engine.scheduler.max_logits_rows == logits_block_rows(cfg.vocab_size, llm.dtype, cpu, 2048)
