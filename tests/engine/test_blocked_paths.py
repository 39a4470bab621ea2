"""Bounded transient memory: LLM.logits run and moved to the host a block of rows at a time, and a
load-time int8 weight dequantized a block of rows at a time on the torch path (the CUDA path),
each against the unblocked computation and an independent reference."""

from __future__ import annotations

import checkpoints as C
import pytest
import torch

from expertcache import kernels
from expertcache.layers import basic
from expertcache.layers.basic import QuantizedWeight, load_quant_method

PROMPT = list(range(3, 40))


def test_logits_in_row_blocks_equal_the_whole_prompt_and_transformers(qwen3_llm, qwen3_reference):
    whole = qwen3_llm.logits(PROMPT)
    ref = C.reference_logits(qwen3_reference, PROMPT)
    torch.testing.assert_close(whole, ref, atol=1e-4, rtol=1e-4)
    for rows in (1, 5, 36):  # one token a block, a ragged last block, one row short of the prompt
        blocked = qwen3_llm.logits(PROMPT, block_rows=rows)
        assert blocked.device.type == "cpu" and blocked.shape == whole.shape
        torch.testing.assert_close(blocked, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_logits_refuses_a_bad_block_size(qwen3_llm, bad):
    with pytest.raises(ValueError, match="block_rows must be a positive integer"):
        qwen3_llm.logits(PROMPT, block_rows=bad)


def test_int8_linear_in_row_blocks_equals_the_whole_matrix(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1030, 64, generator=gen)
    x = torch.randn(2, 3, 64, generator=gen)
    qw = QuantizedWeight(w, load_quant_method("int8"))
    monkeypatch.setattr(kernels, "quant_linear", lambda x, spec: None)  # the torch path, as on CUDA
    whole = qw.linear(x)  # 1030 rows x 64 x 4 bytes fit the default scratch: one block
    monkeypatch.setattr(basic, "DEQUANT_BYTES", 100 * 64 * 4)  # 100 rows a block, the last one 30
    assert basic.dequant_rows(64) == 100
    blocked = qw.linear(x)
    torch.testing.assert_close(blocked, whole, atol=1e-6, rtol=1e-6)
    # against float64 over the dequantized weight (the format's own decode: q * scale per group of 128)
    q, scale = qw.parts["w.weight"], qw.parts["w.weight_scale"]
    w64 = q.double() * scale.double().repeat_interleave(128, dim=1)[:, :64]
    torch.testing.assert_close(blocked.double(), x.double() @ w64.T, atol=1e-5, rtol=1e-5)
    # and within int8's error of the original weight
    assert (w64 - w.double()).abs().max() <= scale.max() / 2 + 1e-7


def test_int8_linear_keeps_the_input_dtype(monkeypatch):
    w = torch.randn(300, 32, generator=torch.Generator().manual_seed(1))
    qw = QuantizedWeight(w, load_quant_method("int8"))
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    monkeypatch.setattr(basic, "DEQUANT_BYTES", 64 * 32 * 4)
    got = qw.linear(x)
    assert got.dtype == torch.bfloat16
    want = (x.float() @ load_quant_method("int8").dequantize(qw.parts, "w").T).to(torch.bfloat16)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
