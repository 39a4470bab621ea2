"""The 4-bit strips of the fast math (csrc/nibble_kernels.cpp: T >= get_strip_tokens() tokens, 32 rows
decoded once per 512 features, rows in the lanes) and the pairs of rows they replace (set_strip_tokens(0)),
both against float64 references of the q8-rounded activations:

- MXFP4 and int4 (groups of 32, 96, 128) for T in {4, 7, 16, 64, 300}, N around the 32-row strip (5, 37, 70)
  and K not a multiple of the 32-block or the 512-feature chunk, a sliced pool (every other row);
- int4 zero points above 16 (the strip's unsigned bytes cannot hold code - zero + 16: the pairs compute it);
- NaN e8m0 scales and non-finite activations spoil their own rows / tokens only, in the second strip too;
- the GPT-OSS (MXFP4) and Qwen-style (int4) experts through the fused MoE call at prefill sizes, with repeated
  and empty experts;
- the kernel's name says whether the strips are on; a negative token count is refused;
- where the CPU has AMX, the strips on AMX (TDPBSUD) give the VNNI strips' outputs bit for bit, for every
  token count around its 16-token passes, and the setting falls back to VNNI where AMX is missing or refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from kernel_refs import Q8ACT32, assert_moe_close, int4_weight, moe_reference, mxfp4_weight
from test_kernels import _close, _moe_pool, _packed, _routing
from test_kernels_mxfp4 import FAST, _gpt_oss_pool, _hand_spec

from expertcache import kernels
from expertcache.kernels.formats import INT4

STRIPS = kernels.backend() == "cpp" and FAST and kernels.extension().avx512_supported()
pytestmark = pytest.mark.skipif(not STRIPS, reason="needs the C++ kernels on a CPU with AVX-512 BF16/VNNI")
AMX = STRIPS and kernels.extension().amx_supported()
NO_AMX = "needs a CPU with AMX-TILE/INT8 whose OS grants the tile state"  # .ci/check_skips.py allows it
TOKENS = [4, 7, 16, 64, 300]
WAYS = ["strips-amx", "strips", "pairs"]


@contextmanager
def _setting(way: str):
    """The strips on AMX, on VNNI (from 4 tokens), or off (pairs of rows at every T); restores the settings."""
    ext = kernels.extension()
    saved = ext.get_avx512(), ext.get_strip_tokens(), ext.get_amx()
    ext.set_avx512(True)
    ext.set_strip_tokens(0 if way == "pairs" else 4)
    ext.set_amx(way == "strips-amx")
    try:
        yield way
    finally:
        ext.set_avx512(saved[0])
        ext.set_strip_tokens(saved[1])
        ext.set_amx(saved[2])


@pytest.fixture(params=WAYS)
def way(request):
    if request.param == "strips-amx" and not AMX:
        pytest.skip(NO_AMX)
    with _setting(request.param) as w:
        yield w


def _linear(x, spec, rows_per_unit=1 << 20):
    """y = x W^T in fast math, the weight's rows in units of rows_per_unit (default: one unit, every
    strip)."""
    return kernels.extension().linear(x, spec, 0, 1 << 30, rows_per_unit, kernels.CPU_MATHS["fast"])


def _check(spec, w: torch.Tensor, tokens=TOKENS) -> None:
    k = w.shape[1]
    for T in tokens:
        x = torch.randn(T, k, generator=torch.Generator().manual_seed(T)) * torch.linspace(0.1, 3, k)
        xr = Q8ACT32(x)
        for units in (1 << 20, 8):  # every strip of the weight in one call; 8 rows a call (a part of a strip)
            _close(_linear(x, spec, units), xr @ w.T, xr.abs() @ w.abs().T)


@pytest.mark.parametrize("n,k", [(5, 352), (37, 190), (70, 2880), (33, 30), (100, 1100)])
def test_mxfp4_against_float64(n, k, way):
    spec, codes, scales = _hand_spec(n, k, seed=n)
    _check(spec, mxfp4_weight(codes[0], scales[0], k))


def test_mxfp4_sliced_rows(way):
    spec, codes, scales = _hand_spec(75, 352, seed=2)
    w = mxfp4_weight(codes[0], scales[0], 352)
    odd = (spec[0], codes[:, 1::2], None, scales[:, 1::2], 37, 352, 32, 1)
    _check(odd, w[1::2], tokens=[7, 64])


@pytest.mark.parametrize("n,k,group", [(37, 352, 32), (70, 330, 96), (33, 2880, 128), (5, 200, 128)])
def test_int4_against_float64(n, k, group, way):
    m, pool, _ = _packed("int4", {"group_size": group}, n, k, seed=group)
    spec = (INT4, pool["p.weight"], pool["p.weight_scale"], pool["p.weight_zero"], n, k, group, 1)
    assert (
        kernels.kernel_name(spec, "fast")
        == "avx512vnni-int4-q8act32" + {"strips-amx": "+strips-amx", "strips": "+strips", "pairs": ""}[way]
    )
    w = int4_weight(pool["p.weight"][0], pool["p.weight_scale"][0], pool["p.weight_zero"][0], k, group)
    _check(spec, w)


def test_int4_zero_points_above_16(way):
    """Zero points anywhere in 0..255: strips holding one above 16 are computed by the pairs of rows."""
    n, k, group = 70, 352, 32
    m, pool, _ = _packed("int4", {"group_size": group}, n, k, seed=9)
    zero = pool["p.weight_zero"].clone()
    zero[0, 40:45] = torch.randint(
        17, 256, zero[0, 40:45].shape, generator=torch.Generator().manual_seed(1), dtype=torch.uint8
    )  # the second strip only
    spec = (INT4, pool["p.weight"], pool["p.weight_scale"], zero, n, k, group, 1)
    w = int4_weight(pool["p.weight"][0], pool["p.weight_scale"][0], zero[0], k, group)
    _check(spec, w, tokens=[7, 64])


def test_nan_scales_and_non_finite_activations_stay_in_their_rows_and_tokens(way):
    spec, codes, scales = _hand_spec(70, 352, seed=1)
    scales[0, 40, 5] = 255  # row 40 (second strip), block 5: NaN
    w = mxfp4_weight(codes[0], scales[0], 352)
    x = torch.randn(16, 352)
    x[1, 3], x[9, 200] = float("nan"), float("inf")
    y = _linear(x, spec)
    assert torch.isnan(y[:, 40]).all()
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[9]).any()
    ok_t = [t for t in range(16) if t not in (1, 9)]
    ok_n = [i for i in range(70) if i != 40]
    xr = Q8ACT32(x[ok_t])
    _close(y[ok_t][:, ok_n], xr @ w[ok_n].T, xr.abs() @ w[ok_n].abs().T)


@pytest.mark.parametrize("T", [16, 200])
def test_gpt_oss_experts_through_the_fused_call(T, way):
    S, H, I, K = 6, 352, 160, 4  # slot S-1 never routed (empty); a repeated slot in token 0
    method, pool, ffn, gate, up, down, biases = _gpt_oss_pool(S, H, I)
    x = 2 * torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    slots, weights = _routing(T, K, S, seed=T)
    out = torch.zeros(T, H)
    with kernels.cpu_math("fast"):
        assert kernels.moe(x, slots, weights, pool, method, out, ffn)
    ref, slack = moe_reference(x, slots, weights, gate, up, down, Q8ACT32, "clamped_swiglu", biases)
    assert_moe_close(out, ref, slack, f"T={T}")


@pytest.mark.parametrize("T", [16, 200])
def test_qwen_int4_experts_through_the_fused_call(T, way):
    S, H, I, K = 6, 384, 96, 4
    method, pool, gate, up, down = _moe_pool("int4", {"group_size": 128}, S, H, I)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    slots, weights = _routing(T, K, S, seed=T)
    out = torch.zeros(T, H)
    with kernels.cpu_math("fast"):
        assert kernels.moe(x, slots, weights, pool, method, out)
    ref, slack = moe_reference(x, slots, weights, gate, up, down, Q8ACT32)
    assert_moe_close(out, ref, slack, f"T={T}")


def test_strip_setting_is_named_and_refuses_a_negative_count():
    ext = kernels.extension()
    spec, _, _ = _hand_spec(4, 64, seed=0)
    saved = ext.get_avx512(), ext.get_strip_tokens(), ext.get_amx()
    try:
        ext.set_avx512(True)
        ext.set_amx(False)
        ext.set_strip_tokens(8)
        assert ext.get_strip_tokens() == 8
        assert kernels.kernel_name(spec, "fast") == "avx512vnni-mxfp4-q8act32+strips"
        assert kernels.kernel_name(spec, "exact") == "avx512-mxfp4-f32act"  # exact math has no strips
        ext.set_strip_tokens(0)
        assert kernels.kernel_name(spec, "fast") == "avx512vnni-mxfp4-q8act32"
        with pytest.raises(RuntimeError, match="tokens must be >= 0 .0: never., got -1"):
            ext.set_strip_tokens(-1)
        with pytest.raises(ValueError, match="strip_tokens: tokens must be >= 0 .0: never., got -2"):
            kernels.isa.strip_tokens = -2
        kernels.isa.strip_tokens = 5
        assert ext.get_strip_tokens() == 5 == kernels.isa.strip_tokens
        with kernels.isa.override(strip_tokens=0, avx512=False):
            assert (ext.get_strip_tokens(), ext.get_avx512()) == (0, False)
        assert (ext.get_strip_tokens(), ext.get_avx512()) == (5, True)
    finally:
        ext.set_avx512(saved[0])
        ext.set_strip_tokens(saved[1])
        ext.set_amx(saved[2])


@pytest.mark.skipif(not AMX, reason=NO_AMX)
@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_amx_equals_the_vnni_strips_bit_for_bit(fmt):
    """The same int32 sums, converted and scaled in the same order: equal outputs, not merely close."""
    for n, k, seed in [(37, 352, 1), (70, 2880, 2), (5, 1100, 3)]:
        if fmt == "mxfp4":
            spec, _, _ = _hand_spec(n, k, seed=seed)
        else:
            _, pool, _ = _packed("int4", {"group_size": 128}, n, k, seed=seed)
            spec = (INT4, pool["p.weight"], pool["p.weight_scale"], pool["p.weight_zero"], n, k, 128, 1)
        for T in (4, 5, 8, 13, 16, 17, 31, 33, 300):
            x = torch.randn(T, k, generator=torch.Generator().manual_seed(T)) * torch.linspace(0.1, 3, k)
            with _setting("strips-amx"):
                assert kernels.kernel_name(spec, "fast").endswith("+strips-amx")
                got = _linear(x, spec)
            with _setting("strips"):
                want = _linear(x, spec)
            assert torch.equal(got, want), (fmt, n, k, T, (got - want).abs().max().item())


def test_amx_setting_follows_the_cpu_and_the_environment(tmp_path):
    """set_amx(True) takes effect only where supported; EXPERTCACHE_CPU_ISA=avx512 or avx2 starts with it off."""
    ext = kernels.extension()
    with _setting("strips-amx"):
        assert ext.get_amx() == ext.amx_supported()
        assert kernels.kernel_name(_hand_spec(4, 64, seed=0)[0], "fast").endswith(
            "+strips-amx" if ext.amx_supported() else "+strips"
        )
    for isa, want in [("avx512", False), ("avx2", False), ("", ext.amx_supported())]:
        code = (
            "from expertcache import kernels; print(kernels.extension().get_amx(), "
            "kernels.isa.defaults.amx and kernels.extension().amx_supported())"
        )
        env = {**os.environ, "EXPERTCACHE_CPU_ISA": isa}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == [str(want)] * 2, (
            isa,
            out.stdout,
            out.stderr[-500:],
        )  # the config agrees
