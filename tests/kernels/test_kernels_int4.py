"""int4 (zero points, groups a multiple of 32) on the AVX-512 4-bit kernels (csrc/nibble_kernels.cpp)
and on the AVX2 fallback, against float64 references, as tests/kernels/test_kernels_mxfp4.py does for MXFP4:

- y = x W^T for groups of 32, 64, 96 (not a power of two), 128 and one group per row, N odd, K not a
  multiple of the group or of 128, T in {1, 2, 7, 16, 64, 300}, both CPU maths, dispatched and fallback;
- fast math with fewer than 4 tokens and groups a multiple of 128 (the zero point's term taken once per
  row after the loop, rows in pairs): T in {1, 2, 3}, N odd, a tail group, more than 16 groups a row, zero
  points 0..15 against codes 0..15;
- a group that is not a multiple of 32 stays on the AVX2 kernels in both maths;
- a Qwen-style MoE (split gate / up, SiLU) through the fused call with repeated and empty experts.
"""

from __future__ import annotations

import pytest
import torch
from kernel_refs import F32ACT, Q8ACT32, assert_moe_close, moe_reference
from test_kernels import _close, _moe_pool, _packed, _routing
from test_kernels_mxfp4 import (
    AVX512,
    ISAS,
    MATHS,
    TOKENS,
    _linear,
    _skip_unavailable,
    isa,  # noqa: F401 - the fixture
    rounding,
)

from expertcache import kernels
from expertcache.kernels.formats import quant_spec

needs_cpp = pytest.mark.skipif(kernels.backend() != "cpp", reason=f"C++ kernels unavailable: {kernels.why()}")
CASES = [(37, 352, 32), (5, 330, 64), (3, 200, 96), (9, 2880, 128), (4, 160, 1 << 20)]  # (N, K, group)


@needs_cpp
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("math", MATHS)
@pytest.mark.parametrize("n,k,group", CASES)
def test_linear_against_float64(n, k, group, math, isa):
    _skip_unavailable(math)
    m, pool, w = _packed("int4", {"group_size": group}, n, k, seed=group)
    spec = quant_spec(m, pool, "p", n, k)
    want = "avx2-f32act"
    if isa == "dispatched" and AVX512:
        strips = "+strips-amx" if kernels.extension().get_amx() else "+strips"
        want = "avx512vnni-int4-q8act32" + strips if math == "fast" else "avx512-int4-f32act"
    assert kernels.extension().kernel_of(spec, kernels.CPU_MATHS[math]) == want
    rnd = rounding(math, isa)
    for T in TOKENS:
        x = torch.randn(T, k, generator=torch.Generator().manual_seed(T)) * torch.linspace(0.1, 3, k)
        xr = rnd(x)
        _close(_linear(x, spec, math), xr @ w[0].T, xr.abs() @ w[0].abs().T)


@needs_cpp
@pytest.mark.parametrize("group", [128, 256])
def test_few_tokens_with_the_zero_point_after_the_loop(group):
    _skip_unavailable("fast")
    if not AVX512:
        pytest.skip("the AVX-512 4-bit kernels are not dispatched on this CPU")
    n, k = 7, 2880 + 64  # 7 rows: 3 pairs and 1 alone; 23.5 groups of 128: a tail group, two epilogue vectors
    m, pool, _ = _packed("int4", {"group_size": group}, n, k, seed=group + 1)
    z = pool[
        "p.weight_zero"
    ]  # zero points anywhere in 0..15, not only near the middle as random weights give
    pool["p.weight_zero"] = torch.randint(0, 16, z.shape, generator=torch.Generator().manual_seed(3)).to(
        z.dtype
    )
    w = m.dequantize({key: t[0] for key, t in pool.items()}, "p").double()[None]
    spec = quant_spec(m, pool, "p", n, k)
    for T in (1, 2, 3):
        x = torch.randn(T, k, generator=torch.Generator().manual_seed(T)) * torch.linspace(0.1, 3, k)
        xr = Q8ACT32(x)
        _close(_linear(x, spec, "fast"), xr @ w[0].T, xr.abs() @ w[0].abs().T)


@needs_cpp
@pytest.mark.parametrize("math", MATHS)
def test_groups_off_the_32_grid_stay_on_the_avx2_kernels(math):
    _skip_unavailable(math)
    m, pool, w = _packed("int4", {"group_size": 36}, 9, 330)
    spec = quant_spec(m, pool, "p", 9, 330)
    assert kernels.extension().kernel_of(spec, kernels.CPU_MATHS[math]) == "avx2-f32act"
    x = torch.randn(7, 330)
    _close(_linear(x, spec, math), x.double() @ w[0].T, x.double().abs() @ w[0].abs().T)


@needs_cpp
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("math", MATHS)
def test_grouped_moe_against_float64(math, isa):
    _skip_unavailable(math)
    S, H, I, K = 6, 160, 96, 4  # slot S-1 never routed (empty); H: a group of 128 and a partial one
    method, pool, gate, up, down = _moe_pool("int4", {"group_size": 32}, S, H, I)
    rnd = rounding(math, isa)
    for T in TOKENS:
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
        slots, weights = _routing(T, K, S, seed=T)
        out = torch.zeros(T, H)
        with kernels.cpu_math(math):
            assert kernels.moe(x, slots, weights, pool, method, out)
        ref, slack = moe_reference(x, slots, weights, gate, up, down, rnd)
        assert_moe_close(out, ref, slack, f"T={T}")


@needs_cpp
@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_fused_interleaved_gate_up_with_biases_exact(isa):
    """gate / up as the even / odd rows of one int4 gate_up (row strides of two rows, scales and zero
    points sliced the same way), clamped SwiGLU and biases, exact math, against the float64 loop."""
    from test_kernels import _fused_pool

    from expertcache.experts.compute import ExpertFFN

    S, H, I, K, T = 4, 160, 96, 2, 9
    method, pool, gate, up, down = _fused_pool("int4", {"group_size": 32}, S, H, I, interleaved=True)
    ffn = ExpertFFN(act="clamped_swiglu", interleaved=True, fused_quant=True, alpha=1.702, limit=7.0)
    g = torch.Generator().manual_seed(5)
    bg, bu, bd = (
        torch.randn(S, I, generator=g),
        torch.randn(S, I, generator=g),
        torch.randn(S, H, generator=g),
    )
    pool = {**pool, "gate_up_bias": torch.stack([bg, bu], -1).reshape(S, 2 * I), "down_bias": bd}
    gate_spec = kernels.moe_args(pool, method, H, ffn)[0]
    want = "avx512-int4-f32act" if isa == "dispatched" and AVX512 else "avx2-f32act"
    assert kernels.kernel_name(gate_spec) == want
    x = 3 * torch.randn(T, H, generator=g)
    slots, weights = _routing(T, K, S)
    out = torch.zeros(T, H)
    assert kernels.moe(x, slots, weights, pool, method, out, ffn)
    ref, _ = moe_reference(x, slots, weights, gate, up, down, F32ACT, "clamped_swiglu", (bg, bu, bd))
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
