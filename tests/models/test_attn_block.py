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
- The stack of blocks (one call for every layer, AttnStack) is the blocks called one by one bit for
  bit; it hands a layer whose MoE needs Python (a shared expert, a declined top-k) back to Python and
  resumes at the next layer.
"""

from __future__ import annotations

import pytest
import torch
from test_fast_math import needs_fast
from test_kernels import SEQ, needs_cpp

from expertcache import LLM, SamplingParams, kernels
from expertcache.kernels import attention as KA
from expertcache.layers import block as block_mod


@pytest.fixture(autouse=True)
def _no_prefill_gemm():
    """The block declines a fast-math prefill step the bf16 matmul may take (kernels.prefill_step); these
    tests are about the block, so that path is off here (tests/kernels/test_prefill_gemm.py tests it)."""
    saved = kernels.prefill_gemm.enabled()
    kernels.prefill_gemm.enable(False)
    yield
    kernels.prefill_gemm.enable(saved)


TINY = dict(
    dtype=torch.bfloat16,
    hidden_size=64,
    moe_intermediate_size=32,
    num_experts=8,
    num_hidden_layers=2,
    num_experts_per_tok=2,
)
FAMILIES = {"qwen3_moe": {}, "qwen2_moe": dict(shared_expert_intermediate_size=48), "mixtral": {}}
PROMPTS = [SEQ[:9], SEQ[5:8]]


def _both_paths(llm: LLM, provider_calls: list | None = None):
    """(prefill logits, decode log-probabilities) with the block on, then off; provider_calls gets the
    number of expert-provider forwards made with the block on (0: every MoE ran inside the block).
    With the block on, through the stack of blocks, then through the blocks one by one: both must
    agree bit for bit (checked here), and the stack must have been used where it was built."""
    out = []
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, ignore_eos=True)
    real, calls = llm.experts.forward, []
    m, stack = llm.model, llm.model.stack
    stack_calls, block_calls = [], []
    real_stack, real_block = kernels.attn_stack, kernels.attn_block
    kernels.attn_stack = lambda *a: stack_calls.append(a[6]) or real_stack(*a)
    kernels.attn_block = lambda *a: block_calls.append(1) or real_block(*a)
    try:
        for fused, stacked in ((True, True), (True, False), (False, False)):
            m.fused_blocks, m.stack = fused, stack if stacked else None
            llm.experts.forward = lambda *a: calls.append(fused and stacked) or real(*a)
            decoded = [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, params)]
            out.append((llm.logits(SEQ), decoded))
            if fused and stacked and stack is not None:
                assert stack_calls and not block_calls, "the stack should run every layer"
    finally:
        kernels.attn_stack, kernels.attn_block = real_stack, real_block
        llm.experts.forward = real
        m.fused_blocks, m.stack = True, stack
    (a, da), (b, db) = out[0], out[1]
    assert torch.equal(a, b) and da == db, "the stack differs from the blocks called one by one"
    if provider_calls is not None:
        provider_calls.append(sum(calls))
        provider_calls.append(stack_calls)
    return out[1:]


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
    assert _blocks(llm) == len(llm.model.layers) and llm.model.stack is not None
    calls = []
    (a, da), (b, db) = _both_paths(llm, calls)
    assert torch.equal(a, b)
    assert da == db
    # every expert resident: the MoE runs inside the block, except beside a shared expert (qwen2_moe),
    # where the stack hands each layer back to Python and resumes at the next
    assert (calls[0] > 0) == (family == "qwen2_moe")
    starts = set(calls[1])
    assert starts == ({0, 1} if family == "qwen2_moe" else {0})


@needs_cpp
@pytest.mark.parametrize("fmt,stored", [("int8", torch.int8), ("int4", torch.uint8)])
def test_the_block_reads_dense_quantized_projections(fmt, stored, checkpoint):
    llm = LLM(str(checkpoint("qwen3_moe", **TINY)), dense=fmt)
    assert _blocks(llm) == len(llm.model.layers)
    assert all(isinstance(b.qkv[0], tuple) and b.qkv[0][1].dtype == stored for b in llm.model.blocks)
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
    layer = llm.model.layers[0]  # two identical router rows in the first layer: tied logits for every token
    layer["router"][1].copy_(layer["router"][0])
    routed = []
    real = block_mod.route_logits
    monkeypatch.setattr(block_mod, "route_logits", lambda *a: routed.append(1) or real(*a))
    calls = []
    (a, da), (b, db) = _both_paths(llm, calls)
    assert routed, "the fused top-k should have declined the tie"
    assert torch.equal(a, b) and da == db
    assert set(calls[1]) == {0, 1}, "the stack should hand layer 0 to Python and resume at layer 1"


@needs_cpp
def test_a_step_the_attention_kernel_declines_runs_the_python_path(checkpoint, monkeypatch):
    llm = LLM(str(checkpoint("qwen3_moe", **TINY)))
    calls = []
    for name in ("attn_block", "attn_stack"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real: calls.append(1) or real(*a))
    monkeypatch.setattr(KA, "MAX_Q", 4)  # the prompt's 40 tokens: more than the kernel takes
    want = llm.logits(SEQ)
    assert not calls
    llm.model.fused_blocks = False
    assert torch.equal(llm.logits(SEQ), want)
