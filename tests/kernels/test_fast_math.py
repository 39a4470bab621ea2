"""The fast CPU math (`--cpu-math fast`, csrc/fast_kernels.cpp): bf16 weights against activations rounded
to bf16, int8 weights against activations quantized to int8 per block of 64.

References are float64 sums over activations rounded by torch (tests/kernel_refs.py: x.bfloat16(); per-64
blocks with scale max|x| / 127 and round-half-even), so a kernel may differ from them only by float32
summation.
Every other format but mxfp4 (tests/kernels/test_kernels_mxfp4.py) must give the exact math's result bit for bit.
Skipped on a CPU without AVX-512 BF16/VNNI, where `cpu_math='fast'` is refused (tested with the support check forced off).
"""

from __future__ import annotations

import types

import pytest
import torch
from kernel_refs import BF16ACT, Q8ACT64, assert_moe_close, moe_reference
from test_kernels import FORMATS, MODEL, SEQ, _close, _moe_pool, _packed, _routing

from expertcache import LLM, kernels
from expertcache.errors import ConfigError
from expertcache.kernels.formats import plain_spec, quant_spec

fast_cpu = kernels.backend() == "cpp" and kernels.extension().fast_supported()
needs_fast = pytest.mark.skipif(
    not fast_cpu, reason="the fast CPU math needs the C++ kernels and AVX-512 BF16/VNNI"
)
TOKENS = [1, 2, 3, 4, 5, 6, 7, 16, 64, 300]
SHAPES = [(1, 1), (37, 31), (5, 33), (300, 100), (37, 330), (70, 1031)]  # (N, K): K around 32 and 64


def _linear(x, spec):
    return kernels.extension().linear(x, spec, 0, 1 << 30, 8, kernels.CPU_MATHS["fast"])


@needs_fast
@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_against_float64_of_rounded_activations(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    spec = plain_spec(w.unsqueeze(0))
    for T in TOKENS:
        x = torch.randn(T, k, generator=torch.Generator().manual_seed(T))
        xr = BF16ACT(x)
        _close(_linear(x, spec), xr @ w.double().T, xr.abs() @ w.double().abs().T)


@needs_fast
@pytest.mark.parametrize(
    "group", [64, 128, 192, 256, 1 << 20]
)  # 192: the scale index by division, not a shift
@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_against_float64_of_quantized_activations(n, k, group):
    m, pool, w = _packed("int8", {"group_size": group}, n, k)
    spec = quant_spec(m, pool, "p", n, k)
    for T in TOKENS:
        x = torch.randn(T, k, generator=torch.Generator().manual_seed(T)) * torch.linspace(0.1, 3, k)
        xq = Q8ACT64(x)
        _close(_linear(x, spec), xq @ w[0].T, xq.abs() @ w[0].abs().T)


def _without_fast_kernel(fmt: str, params: dict) -> bool:
    return fmt not in ("bf16", "mxfp4") and not (fmt == "int8" and params["group_size"] % 64 == 0)


@needs_fast
@pytest.mark.parametrize(
    "fmt,params", [f for f in FORMATS + [("int8", {"group_size": 96})] if _without_fast_kernel(*f)], ids=str
)
def test_formats_without_a_fast_kernel_stay_exact(fmt, params):
    """fp16/fp32/fp8/int4, and int8 whose groups do not hold whole blocks of 64, compute exactly (bf16,
    int8 by 64 and mxfp4 have fast kernels: the tests above and tests/kernels/test_kernels_mxfp4.py)."""
    n, k = (37, 352) if fmt == "mxfp4" else (37, 330)
    m, pool, _ = _packed(fmt, params, n, k)
    spec = quant_spec(m, pool, "p", n, k)
    x = torch.randn(7, k)
    assert torch.equal(_linear(x, spec), kernels.extension().linear(x, spec, 0, 1 << 30, 8, 0))


@needs_fast
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_non_finite_activation_spoils_its_own_token_only(fmt):
    m, pool, w = _packed(fmt, {"group_size": 128} if fmt == "int8" else {}, 40, 200)
    spec = quant_spec(m, pool, "p", 40, 200)
    x = torch.randn(5, 200)
    x[1, 3], x[3, 150] = float("nan"), float("inf")
    y = _linear(x, spec)
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[3]).any()
    ok = [0, 2, 4]
    xr = (BF16ACT if fmt == "bf16" else Q8ACT64)(x[ok])
    _close(y[ok], xr @ w[0].T, xr.abs() @ w[0].abs().T)


@needs_fast
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_grouped_moe_against_float64_of_rounded_activations(fmt):
    S, H, I, K = 5, 130, 70, 3
    method, pool, gate, up, down = _moe_pool(fmt, {"group_size": 64} if fmt == "int8" else {}, S, H, I)
    rnd = BF16ACT if fmt == "bf16" else Q8ACT64
    for T in (1, 4, 7, 64):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
        slots, weights = _routing(T, K, S, seed=T)
        out = torch.zeros(T, H)
        with kernels.cpu_math("fast"):
            assert kernels.moe(x, slots, weights, pool, method, out)
        ref, slack = moe_reference(x, slots, weights, gate, up, down, rnd)
        assert_moe_close(out, ref, slack, f"T={T}")


@pytest.fixture(scope="module")
def bf16_model(checkpoint):
    return checkpoint("qwen3_moe", **MODEL)


@needs_fast
def test_whole_model_fast_math_is_close_to_exact_and_named_in_the_plan(bf16_model):
    exact, fast = LLM(str(bf16_model)), LLM(str(bf16_model), cpu_math="fast")
    assert any(line.startswith("cpu math: fast") for line in fast.plan_lines)
    assert not any(line.startswith("cpu math") for line in exact.plan_lines)
    a, b = exact.logits(SEQ), fast.logits(SEQ)
    assert not torch.equal(a, b)  # the activations were rounded
    assert (a - b).abs().max() <= 2e-2 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_fast_math_is_refused_where_the_cpu_lacks_it(bf16_model, monkeypatch):
    if kernels.backend() == "cpp":  # the extension as on a CPU without AVX-512 BF16/VNNI
        monkeypatch.setattr(kernels, "extension", lambda: types.SimpleNamespace(fast_supported=lambda: False))
        match = "cpu_math='fast': this CPU lacks AVX-512 F/BW/VL/BF16/VNNI; use cpu_math='exact'"
    else:
        match = "cpu_math='fast': the C++ kernels are not in use"
    with pytest.raises(ConfigError, match=match):
        LLM(str(bf16_model), cpu_math="fast")


def test_an_unknown_cpu_math_is_refused(bf16_model):
    with pytest.raises(ConfigError, match="cpu_math: one of exact, fast, got 'turbo'"):
        LLM(str(bf16_model), cpu_math="turbo")


def test_the_fast_math_code_is_refused_by_the_extension_where_unsupported():
    if kernels.backend() != "cpp" or fast_cpu:
        pytest.skip("needs the C++ kernels on a CPU without AVX-512 BF16/VNNI")
    w = torch.randn(4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="fast CPU math needs AVX-512"):
        _linear(torch.randn(1, 8), plain_spec(w.unsqueeze(0)))


def test_cli_passes_cpu_math():
    import argparse

    from expertcache.cli_common import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--cpu-math", "fast"]))["cpu_math"] == "fast"
    assert engine_kwargs(p.parse_args([]))["cpu_math"] == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--cpu-math", "turbo"])


def test_the_default_math_is_fast_where_the_cpu_has_it(monkeypatch):
    """Unset (a user's process), auto resolves to fast on a CPU with AVX-512 BF16/VNNI and the kernels,
    else to exact; $EXPERTCACHE_CPU_MATH overrides it (the suite runs with exact)."""
    from expertcache.config import EngineConfig

    monkeypatch.delenv("EXPERTCACHE_CPU_MATH", raising=False)
    want = "fast" if kernels.cpu_math_unavailable("fast") is None else "exact"
    assert EngineConfig.from_kwargs().kernels.cpu_math == want
    assert EngineConfig.from_kwargs(cpu_math="exact").kernels.cpu_math == "exact"
    monkeypatch.setenv("EXPERTCACHE_CPU_MATH", "exact")
    assert EngineConfig.from_kwargs().kernels.cpu_math == "exact"
    monkeypatch.setenv("EXPERTCACHE_CPU_MATH", "turbo")
    with pytest.raises(ConfigError, match="cpu_math: one of exact, fast, got 'turbo'"):
        EngineConfig.from_kwargs()
