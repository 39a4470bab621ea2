"""A MoE layer's attention half in one C++ call (layers/block.py, csrc/decode_block.cpp).

- It is the layer's Python path bit for bit (the same kernels in the same order): prefill logits and
  decode log-probabilities equal with the block on and off, for Qwen3-MoE (head q/k norm), Qwen2-MoE
  (qkv biases, a shared expert) and Mixtral (no q/k norm), in exact and fast CPU math, and with
  `--dense int8` projections. Against an independent reference: the whole bf16 model through the
  kernels equals the torch path within 1e-4 (test_kernels.py), which now runs through the block.
- With every expert resident the layer's MoE kernel call runs inside the block too (not beside a
  shared expert); the results stay the Python path's.
- Every MoE layer of those models gets a block (so the tests above exercise it); layers whose
  pieces are not all kernel calls do not: float32 weights (torch's F.linear), GLM-4.5's sigmoid router,
  MLA.
- A near-tie of router logits, which the fused top-k declines, is routed by the router's torch code.
- A step the attention kernel does not take (more than MAX_Q new tokens a sequence) runs the Python path.
"""

from __future__ import annotations

import pytest
import torch

from expertcache import LLM, SamplingParams, kernels
from expertcache.kernels import attention as KA
from expertcache.layers import block as block_mod
from test_fast_math import needs_fast
from test_kernels import SEQ, needs_cpp

TINY = dict(dtype=torch.bfloat16, hidden_size=64, moe_intermediate_size=32, num_experts=8, num_hidden_layers=2,
            num_experts_per_tok=2)
FAMILIES = {"qwen3_moe": {}, "qwen2_moe": dict(shared_expert_intermediate_size=48), "mixtral": {}}
PROMPTS = [SEQ[:9], SEQ[5:8]]


def _both_paths(llm: LLM, provider_calls: list | None = None):
    """(prefill logits, decode log-probabilities) with the block on, then off; provider_calls gets the
    number of expert-provider forwards made with the block on (0: every MoE ran inside the block)."""
    out = []
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, ignore_eos=True)
    real, calls = llm.experts.forward, []
    for fused in (True, False):
        llm.model.fused_blocks = fused
        llm.experts.forward = lambda *a: calls.append(fused) or real(*a)
        decoded = [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, params)]
        out.append((llm.logits(SEQ), decoded))
    llm.experts.forward = real
    llm.model.fused_blocks = True
    if provider_calls is not None:
        provider_calls.append(sum(calls))
    return out


def _blocks(llm: LLM) -> int:
    return sum(b is not None for b in llm.model.blocks)


@needs_cpp
@pytest.mark.parametrize("math", ["exact", pytest.param("fast", marks=needs_fast)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_block_is_the_python_path_bit_for_bit(family, math, checkpoint):
    kw = dict(TINY, **FAMILIES[family])
    if family == "mixtral":
        kw["intermediate_size"] = kw.pop("moe_intermediate_size")
        kw["num_local_experts"] = kw.pop("num_experts")
    llm = LLM(str(checkpoint(family, **kw)), cpu_math=math)
    assert _blocks(llm) == len(llm.model.layers)
    calls = []
    (a, da), (b, db) = _both_paths(llm, calls)
    assert torch.equal(a, b)
    assert da == db
    # every expert resident: the MoE runs inside the block, except beside a shared expert (qwen2_moe)
    assert (calls[0] > 0) == (family == "qwen2_moe")


@needs_cpp
def test_the_block_reads_dense_int8_projections(checkpoint):
    llm = LLM(str(checkpoint("qwen3_moe", **TINY)), dense="int8")
    assert _blocks(llm) == len(llm.model.layers)
    assert all(isinstance(b.qkv[0], tuple) and b.qkv[0][1].dtype == torch.int8 for b in llm.model.blocks)
    (a, da), (b, db) = _both_paths(llm)
    assert torch.equal(a, b) and da == db


@needs_cpp
def test_layers_with_a_torch_piece_get_no_block(checkpoint):
    fp32 = LLM(str(checkpoint("qwen3_moe", **dict(TINY, dtype=torch.float32))))
    assert _blocks(fp32) == 0  # float32 weights: F.linear in the Python path
    for family in ("glm4_moe", "deepseek_v3"):  # a sigmoid (noaux_tc) router; MLA attention
        assert _blocks(LLM(str(checkpoint(family, dtype=torch.bfloat16)))) == 0


@needs_cpp
def test_a_router_near_tie_is_routed_by_torch(checkpoint, monkeypatch):
    llm = LLM(str(checkpoint("qwen3_moe", **TINY)))
    for layer in llm.model.layers:  # two identical router rows: tied logits for every token
        layer["router"][1].copy_(layer["router"][0])
    routed = []
    real = block_mod.route_logits
    monkeypatch.setattr(block_mod, "route_logits", lambda *a: routed.append(1) or real(*a))
    (a, da), (b, db) = _both_paths(llm)
    assert routed, "the fused top-k should have declined the tie"
    assert torch.equal(a, b) and da == db


@needs_cpp
def test_a_step_the_attention_kernel_declines_runs_the_python_path(checkpoint, monkeypatch):
    llm = LLM(str(checkpoint("qwen3_moe", **TINY)))
    calls = []
    real = kernels.attn_block
    monkeypatch.setattr(kernels, "attn_block", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(KA, "MAX_Q", 4)  # the prompt's 40 tokens: more than the kernel takes
    want = llm.logits(SEQ)
    assert not calls
    llm.model.fused_blocks = False
    assert torch.equal(llm.logits(SEQ), want)
