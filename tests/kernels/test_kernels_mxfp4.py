"""The MXFP4 kernels (csrc/mxfp4_kernels.cpp, AVX-512) and their AVX2 fallback against float64 references.

- y = x W^T for shapes that are not multiples of the 128-feature group, the 64-byte load or the row
  pair (N odd, K = 32, 96, 160, 352; a K that is not a multiple of the 32-block through a spec made by
  hand), T in {1, 2, 7, 16, 64, 300}, both CPU maths, on the kernel the machine dispatches to and on
  the AVX2 fallback (set_avx512(False));
- exact math: x @ W^T in float64 (W decoded from the codes and e8m0 bytes by tests/kernel_refs.py);
  fast math on the AVX-512 kernel: x quantized per block of 32 (scale max|x| / 127, round half to even)
  first, then the float64 sum, so the kernel may differ only by float32 sums; the fallback computes
  exactly in both;
- NaN e8m0 scales and non-finite activations spoil their own rows / tokens only; bytes 0 and 255 under 4 tokens;
- the GPT-OSS expert (fused interleaved gate_up, biases, clamped SwiGLU) through the fused MoE call,
  with repeated and empty experts, against a float64 per-pair loop;
- EXPERTCACHE_CPU_ISA=avx2 starts a process on the fallback.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernel_refs import F32ACT, Q8ACT32, assert_moe_close, moe_reference, mxfp4_weight
from test_kernels import _close, _packed, _routing

from expertcache import kernels
from expertcache.experts.compute import ExpertFFN
from expertcache.kernels.formats import MXFP4, quant_spec

needs_cpp = pytest.mark.skipif(kernels.backend() != "cpp", reason=f"C++ kernels unavailable: {kernels.why()}")
AVX512 = kernels.backend() == "cpp" and kernels.extension().avx512_supported()
FAST = kernels.backend() == "cpp" and kernels.extension().fast_supported()
TOKENS = [1, 2, 7, 16, 64, 300]
SHAPES = [(1, 32), (5, 96), (37, 352), (8, 160), (3, 2880)]
ISAS = ["dispatched", "avx2"]
MATHS = ["exact", "fast"]


@pytest.fixture
def isa(request):
    """Sets the kernels' ISA for a test (request.param: dispatched / avx2) and restores it."""
    ext = kernels.extension()
    saved = ext.get_avx512()
    ext.set_avx512(request.param == "dispatched")
    yield request.param
    ext.set_avx512(saved)


def rounding(math: str, isa: str):
    """How the kernel of (math, isa) sees the activations: the q8 rounding, or none (float64 of x)."""
    return Q8ACT32 if math == "fast" and isa == "dispatched" and AVX512 else F32ACT


def _linear(x, spec, math):
    return kernels.extension().linear(x, spec, 0, 1 << 30, 8, kernels.CPU_MATHS[math])


def _skip_unavailable(math):
    if math == "fast" and not FAST:
        pytest.skip("the fast CPU math needs AVX-512 BF16/VNNI")


@needs_cpp
def test_the_kernel_each_math_and_isa_dispatches_to():
    m, pool, _ = _packed("mxfp4", {}, 4, 64)
    spec = quant_spec(m, pool, "p", 4, 64)
    ext = kernels.extension()
    saved = ext.get_avx512()
    try:
        ext.set_avx512(True)
        want = "avx512-mxfp4-f32act" if AVX512 else "avx2-f32act"
        assert ext.kernel_of(spec, 0) == want
        if FAST:
            strips = "+strips-amx" if ext.amx_supported() and ext.get_amx() else "+strips"
            assert ext.kernel_of(spec, 1) == "avx512vnni-mxfp4-q8act32" + strips
        ext.set_avx512(False)
        assert ext.kernel_of(spec, 0) == "avx2-f32act"
        if FAST:
            assert ext.kernel_of(spec, 1) == "avx2-f32act"  # the fallback stays exact in fast math
    finally:
        ext.set_avx512(saved)


@needs_cpp
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("math", MATHS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_against_float64(n, k, math, isa):
    _skip_unavailable(math)
    m, pool, w = _packed("mxfp4", {}, n, k, seed=k)
    spec = quant_spec(m, pool, "p", n, k)
    rnd = rounding(math, isa)
    for T in TOKENS:
        x = torch.randn(T, k, generator=torch.Generator().manual_seed(T)) * torch.linspace(0.1, 3, k)
        xr = rnd(x)
        _close(_linear(x, spec, math), xr @ w[0].T, xr.abs() @ w[0].abs().T)


def _hand_spec(n: int, k: int, seed: int, lo: int = 100, hi: int = 140):
    """A spec made from random codes and e8m0 bytes in [lo, hi) (any even K) -> (spec, float64 W [n, k])."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (1, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(lo, hi, (1, n, -(-k // 32)), generator=g).to(torch.uint8)
    return (MXFP4, codes, None, scales, n, k, 32, 1), codes, scales


@needs_cpp
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("math", MATHS)
@pytest.mark.parametrize("k", [2, 30, 70, 190, 258])
def test_rows_ending_inside_a_block(k, math, isa):
    """K not a multiple of 32 (the last block partial), and row strides of a sliced pool (every other row)."""
    _skip_unavailable(math)
    spec, codes, scales = _hand_spec(9, k, seed=k)
    w = mxfp4_weight(codes[0], scales[0], k)
    rnd = rounding(math, isa)
    for T in (1, 2, 7, 16):
        x = torch.randn(T, k, generator=torch.Generator().manual_seed(T))
        xr = rnd(x)
        _close(_linear(x, spec, math), xr @ w.T, xr.abs() @ w.abs().T)
    odd = (MXFP4, codes[:, 1::2], None, scales[:, 1::2], 4, k, 32, 1)
    x = torch.randn(7, k)
    xr = rnd(x)
    _close(_linear(x, odd, math), xr @ w[1::2].T, xr.abs() @ w[1::2].abs().T)


@needs_cpp
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("math", MATHS)
def test_nan_scales_and_non_finite_activations_stay_in_their_rows_and_tokens(math, isa):
    _skip_unavailable(math)
    spec, codes, scales = _hand_spec(7, 352, seed=1)
    scales[0, 2, 5] = 255  # row 2's block 5: NaN
    w = mxfp4_weight(codes[0], scales[0], 352)
    x = torch.randn(5, 352)
    x[1, 3], x[3, 200] = float("nan"), float("inf")
    y = _linear(x, spec, math)
    assert torch.isnan(y[:, 2]).all()
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[3]).any()
    ok_t, ok_n = [0, 2, 4], [0, 1, 3, 4, 5, 6]
    xr = rounding(math, isa)(x[ok_t])
    _close(y[ok_t][:, ok_n], xr @ w[ok_n].T, xr.abs() @ w[ok_n].abs().T)


@needs_cpp
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("math", MATHS)
def test_special_scale_bytes_under_four_tokens(math, isa):
    """e8m0 bytes 0 (2^-127) and 255 (NaN) in one row of a pass each, at T = 1, 2, 3: a pass checks its
    rows' scale bytes once and skips the per-load check only where none is special."""
    _skip_unavailable(math)
    spec, codes, scales = _hand_spec(9, 2880, seed=7)
    scales[0, 1, 3] = 0  # row 1 (the first pass of rows): a 2^-127 block
    scales[0, 6, 80] = 255  # row 6 (the second pass): a NaN block
    w = mxfp4_weight(codes[0], scales[0], 2880)
    ok = [n for n in range(9) if n != 6]
    for T in (1, 2, 3):
        x = torch.randn(T, 2880, generator=torch.Generator().manual_seed(T))
        y = _linear(x, spec, math)
        assert torch.isnan(y[:, 6]).all(), f"T={T}"
        xr = rounding(math, isa)(x)
        _close(y[:, ok], xr @ w[ok].T, xr.abs() @ w[ok].abs().T)


def _gpt_oss_pool(S: int, H: int, I: int):
    """A GPT-OSS expert pool as the checkpoint ships it: gate_up [S, 2I, H] MXFP4 with gate rows even and
    up rows odd, down [S, H, I], biases -> (method, pool, ffn, float64 gate, up, down, biases)."""
    method, pgu, gu = _packed("mxfp4", {}, 2 * I, H, S, seed=4)
    _, pd, down = _packed("mxfp4", {}, H, I, S, seed=5)
    pool = {
        **{k.replace("p.", "gate_up.", 1): t for k, t in pgu.items()},
        **{k.replace("p.", "down.", 1): t for k, t in pd.items()},
    }
    g = torch.Generator().manual_seed(6)
    bgu, bd = torch.randn(S, 2 * I, generator=g), torch.randn(S, H, generator=g)
    pool.update(gate_up_bias=bgu, down_bias=bd)
    ffn = ExpertFFN(act="clamped_swiglu", interleaved=True, fused_quant=True, alpha=1.702, limit=7.0)
    biases = (bgu[:, 0::2].double(), bgu[:, 1::2].double(), bd.double())
    return method, pool, ffn, gu[:, 0::2], gu[:, 1::2], down, biases


@needs_cpp
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("math", MATHS)
def test_gpt_oss_experts_through_the_fused_call(math, isa):
    _skip_unavailable(math)
    S, H, I, K = 6, 96, 160, 4  # I: a group of 128 and a partial one; slot S-1 never routed (empty)
    method, pool, ffn, gate, up, down, biases = _gpt_oss_pool(S, H, I)
    rnd = rounding(math, isa)
    for T in TOKENS:
        x = 2 * torch.randn(T, H, generator=torch.Generator().manual_seed(T))  # the clamps at +-7 engage
        slots, weights = _routing(T, K, S, seed=T)
        start = torch.randn(T, H)
        out = start.clone()
        with kernels.cpu_math(math):
            assert kernels.moe(x, slots, weights, pool, method, out, ffn)
        ref, slack = moe_reference(x, slots, weights, gate, up, down, rnd, "clamped_swiglu", biases)
        assert_moe_close(out.double() - start.double(), ref, slack, f"T={T}")


@needs_cpp
def test_env_var_starts_a_process_on_the_fallback():
    code = (
        "from expertcache import kernels; e = kernels.extension(); "
        "from expertcache.kernels.formats import MXFP4; import torch; "
        "spec = (MXFP4, torch.zeros(1, 2, 16, dtype=torch.uint8), None, "
        "torch.full((1, 2, 1), 127, dtype=torch.uint8), 2, 32, 32, 1); "
        "print(e.get_avx512(), e.kernel_of(spec, 0))"
    )
    env = {**os.environ, "EXPERTCACHE_CPU_ISA": "avx2"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    out = run.stdout
    assert out.split() == ["False", "avx2-f32act"]


@needs_cpp
@pytest.mark.parametrize("math", MATHS)
def test_prefetch_setting_changes_no_result_and_refuses_a_negative_count(math):
    _skip_unavailable(math)
    spec, _, _ = _hand_spec(40, 352, seed=3)
    ext = kernels.extension()
    x = torch.randn(2, 352)
    saved = ext.get_prefetch_rows()
    try:
        ext.set_prefetch_rows(0)
        off = _linear(x, spec, math)
        ext.set_prefetch_rows(7)
        assert torch.equal(_linear(x, spec, math), off)
        with pytest.raises(RuntimeError, match="rows ahead must be >= 0, got -1"):
            ext.set_prefetch_rows(-1)
    finally:
        ext.set_prefetch_rows(saved)
