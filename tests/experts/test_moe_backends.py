"""MoE compute backends by registry (experts/backends.py): each kind's capability check decides the choice,
made once per pool and configuration, named by a line; a new kind registers; results equal the torch
code's (a float64 per-pair loop as the reference)."""

from __future__ import annotations

import pytest
import torch

from expertcache import kernels
from expertcache.errors import ConfigError
from expertcache.experts import backends
from expertcache.experts.backends import Kind, MoEOptions, choose_backend, register
from expertcache.experts.compute import SWIGLU, moe_ffn

E, H, I, T, K = 6, 32, 16, 7, 2
needs_cpp = pytest.mark.skipif(kernels.backend() != "cpp", reason=f"C++ kernels not in use ({kernels.why()})")


def _pool(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "gate_up": (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype),
        "down": (torch.randn(E, H, I, generator=g) * 0.2).to(dtype),
    }


def _reference(x, slots, w, pool):
    """out[t] = sum_k w[t,k] * down(silu(gate x) * up x), pair by pair in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(slots.shape[1]):
            s = int(slots[t, k])
            if s < 0:
                continue
            gu = pool["gate_up"][s].double() @ x[t].double()
            h = torch.nn.functional.silu(gu[:I]) * gu[I:]
            out[t] += float(w[t, k]) * (pool["down"][s].double() @ h)
    return out


def _routing(seed=1):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, E, (T, K), generator=g)
    slots[0, 1] = -1  # a skipped pair
    return torch.randn(T, H, generator=g), slots, torch.rand(T, K, generator=g)


@needs_cpp
def test_cpu_float32_pool_goes_to_the_cpp_kernels_and_bf16_activations_to_torch():
    pool = _pool()
    chosen = choose_backend(pool, "cpu", MoEOptions(hidden=H, exclude=frozenset({"triton"})))
    assert chosen.kind.name == "cpp" and chosen.line.startswith("MoE compute: cpp, the C++ CPU kernels")
    bf = choose_backend(
        pool, "cpu", MoEOptions(dtype=torch.bfloat16, hidden=H, exclude=frozenset({"triton"}))
    )
    assert bf.kind.name == "torch" and "not cpp: they compute float32 activations" in bf.line
    x, slots, w = _routing()
    want = _reference(x, slots, w, pool)
    for b in (chosen, bf):
        got = b(x, slots, w, pool, None, SWIGLU, None, False)
        assert torch.allclose(got.double(), want, atol=1e-5), b.kind.name


def test_the_choice_is_made_once_per_pool_and_shared_by_a_configuration(monkeypatch):
    checks = []
    real = backends.KINDS["torch"]
    counted = Kind("torch", real.summary, lambda p, d, o: checks.append(1), real.compute)
    monkeypatch.setitem(backends.KINDS, "torch", counted)
    monkeypatch.setattr(backends, "_CHOSEN", {})
    monkeypatch.setattr(backends, "_SHARED", {})
    x, slots, w = _routing()
    pool, other = _pool(torch.bfloat16), _pool(torch.bfloat16, seed=3)  # bf16 parts: never the C++ kernels'
    x = x.bfloat16()
    for p in (pool, pool, other, pool):
        moe_ffn(x, slots, w, p)
    assert len(checks) == 1  # once for the configuration, its second pool included
    assert backends.backend_for(pool, x, None, SWIGLU) is backends.backend_for(other, x, None, SWIGLU)
    moe_ffn(x.float(), slots, w, _pool(torch.float32, seed=4))  # another configuration: chosen again
    assert len(checks) == 1 + (kernels.backend() != "cpp")


def test_an_explicit_backend_that_cannot_run_is_refused_with_why():
    with pytest.raises(ConfigError, match="MoE backend: one of triton, cpp, torch"):
        choose_backend(_pool(), "cpu", MoEOptions(hidden=H, backend="gpu"))
    if kernels.backend() == "cpp":
        with pytest.raises(ConfigError, match="moe_kernel='cpp': they compute float32 activations"):
            choose_backend(_pool(), "cpu", MoEOptions(dtype=torch.float16, hidden=H, backend="cpp"))


def test_a_registered_kind_is_chosen_where_its_check_passes(monkeypatch):
    """As the GGUF kernels will: a kind registered ahead of cpp, for its own format only."""
    monkeypatch.setattr(backends, "KINDS", dict(backends.KINDS))
    calls = []

    def compute(x, slots, weights, pool, method, ffn, out, host):
        calls.append(x.shape)
        return backends.KINDS["torch"].compute(x, slots, weights, pool, method, ffn, out, host)

    register(
        Kind(
            "half",
            "half-precision test kernel",
            lambda p, d, o: None if p["down"].dtype == torch.float16 else "not float16 parts",
            compute,
        ),
        before="cpp",
    )
    assert list(backends.KINDS) == ["triton", "half", "cpp", "torch"]
    with pytest.raises(ValueError, match="registered already"):
        register(backends.KINDS["half"])
    options = MoEOptions(hidden=H, exclude=frozenset({"triton"}))
    assert choose_backend(_pool(torch.float16), "cpu", options).kind.name == "half"
    assert choose_backend(_pool(), "cpu", options).kind.name in ("cpp", "torch")
    x, slots, w = _routing()
    pool = _pool(torch.float16)
    got = choose_backend(pool, "cpu", options)(x, slots, w, pool, None, SWIGLU, None, False)
    assert calls == [x.shape] and torch.allclose(got.double(), _reference(x, slots, w, pool), atol=1e-3)


def test_the_builders_choice_is_the_lazy_one_and_moe_ffn_takes_it():
    """choose_backend with MoEOptions.for_ffn (what the builder calls once per pool) picks what moe_ffn
    would pick by itself, and moe_ffn(backend=...) computes through it."""
    pool = _pool()
    x, slots, w = _routing()
    built = choose_backend(pool, "cpu", MoEOptions.for_ffn(None, SWIGLU, x.dtype, H))
    assert built.kind is backends.backend_for(pool, x, None, SWIGLU).kind
    calls = []
    spy = backends.Backend(
        Kind("spy", "spy", lambda p, d, o: None, lambda *a: calls.append(1) or built(*a)), "MoE compute: spy"
    )
    got = moe_ffn(x, slots, w, pool, backend=spy)
    assert calls == [1] and torch.allclose(got.double(), _reference(x, slots, w, pool), atol=1e-5)
