"""Prefill on the bf16 matmul (kernels/prefill_gemm.py, experts/prefill.py): under `--cpu-math fast`, dense
bf16 projections and experts of many tokens go to torch's bf16 matmul from a measured crossover.

References are float64 sums over the roundings the path makes (activations to bf16, the intermediate
activation to bf16, each projection's output to bf16), so the path may differ from them only where a
float32 sum sits at a bf16 rounding edge: by one bf16 ulp of an output (2^-7 relative) or, in an expert,
one ulp of an intermediate value carried through the down projection. The crossover's search and its
cache are tested with stand-in timings. Skipped without AVX-512 BF16/VNNI (fast math is refused there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_kernels import _moe_pool, _packed, _routing

from expertcache import LLM, kernels
from expertcache.experts.compute import SWIGLU, ExpertFFN, moe_ffn
from expertcache.kernels import prefill_gemm
from expertcache.kernels.formats import plain_spec

fast_cpu = kernels.backend() == "cpp" and kernels.extension().fast_supported()
needs_fast = pytest.mark.skipif(
    not fast_cpu, reason="the fast CPU math needs the C++ kernels and AVX-512 BF16/VNNI"
)
ULP = 2.0**-7  # one bf16 ulp, relative (8 significant bits)


def r16(x: torch.Tensor) -> torch.Tensor:
    """float64 values of x rounded to bf16 (nearest even)."""
    return x.float().bfloat16().double()


def _kernel_linear(x, w):
    return kernels.extension().linear(x, plain_spec(w.unsqueeze(0)), 0, 1 << 30, 8, kernels.CPU_MATHS["fast"])


@needs_fast
@pytest.mark.parametrize("n,k", [(37, 330), (70, 1031), (300, 100)])
def test_dense_bf16_matmul_against_float64_of_rounded_values(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    for T in (16, 64, 300):
        x = torch.randn(T, k, generator=torch.Generator().manual_seed(T))
        before = prefill_gemm.CALLS["dense"]
        with kernels.cpu_math("fast"), prefill_gemm.fixed_crossover(16):
            y = kernels.dense_linear(x, w)
        assert prefill_gemm.CALLS["dense"] == before + 1
        ref = r16(r16(x) @ w.double().T)  # the float64 sum of the rounded activations, rounded to bf16
        err = (y.double() - ref).abs()
        assert (err <= ULP * ref.abs()).all(), f"T={T}: max error {err.max():.3g}"
        assert (err == 0).float().mean() >= 0.95  # a float32 sum crosses a rounding edge rarely


@needs_fast
def test_dense_below_the_crossover_off_or_exact_stays_on_the_kernel():
    w = torch.randn(70, 1031, generator=torch.Generator().manual_seed(1)).bfloat16()
    x = torch.randn(64, 1031, generator=torch.Generator().manual_seed(2))
    kernel = _kernel_linear(x, w)
    assert not torch.equal(kernel, kernel.bfloat16().float())  # the kernel's outputs are not rounded
    with prefill_gemm.fixed_crossover(128), kernels.cpu_math("fast"):  # 64 tokens: below it
        assert torch.equal(kernels.dense_linear(x, w), kernel)
    with prefill_gemm.fixed_crossover(16), kernels.cpu_math("fast"):
        prefill_gemm.enable(False)
        try:
            assert torch.equal(kernels.dense_linear(x, w), kernel)
        finally:
            prefill_gemm.enable(True)
        assert torch.equal(kernels.dense_linear(x[:15], w), kernel[:15])  # below MIN_T whatever the table
    with prefill_gemm.fixed_crossover(16), kernels.cpu_math("exact"):
        y = kernels.dense_linear(x, w)
    assert (y.double() - x.double() @ w.double().T).abs().max() <= 1e-4  # float32 activations, unrounded


def _rounded_expert_reference(x, slots, weights, gate, up, down):
    """float64 MoE with the path's roundings -> (out, slack): slack bounds one ulp of each pair's output
    and of each intermediate value carried through down."""
    T, H = x.shape
    out, slack = torch.zeros(T, H, dtype=torch.float64), torch.zeros(T, H, dtype=torch.float64)
    xr = r16(x)
    for t in range(T):
        for j in range(slots.shape[1]):
            s = int(slots[t, j])
            if s < 0:
                continue
            g, u = r16(gate[s] @ xr[t]), r16(up[s] @ xr[t])
            h = r16(torch.nn.functional.silu(g) * u)
            y = r16(down[s] @ h)
            wt = float(weights[t, j])
            out[t] += wt * y
            slack[t] += abs(wt) * (ULP * y.abs() + 2 * ULP * (down[s].abs() @ h.abs()))
    return out, slack


@needs_fast
@pytest.mark.parametrize("T", [16, 64, 300])
def test_experts_of_many_tokens_on_the_matmul_the_rest_on_the_kernel(T):
    S, H, I, K = 5, 130, 70, 3
    _, pool, gate, up, down = _moe_pool("bf16", {}, S, H, I)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    slots, weights = _routing(T, K, S, seed=T)  # skipped pairs, a repeated slot, slot S-1 empty
    slots[1:, 0] = 0  # slot 0 takes (almost) every token: on the matmul; the others may be few
    before = prefill_gemm.CALLS["expert"]
    with kernels.cpu_math("fast"), prefill_gemm.fixed_crossover(16):
        out = moe_ffn(x, slots, weights, pool, None, ffn=SWIGLU)
    counts = torch.bincount(slots[slots >= 0], minlength=S)
    assert prefill_gemm.CALLS["expert"] - before == int((counts >= 16).sum()) >= 1
    ref, slack = _rounded_expert_reference(x, slots, weights, gate, up, down)
    err = (out.double() - ref).abs()
    tol = 1e-5 * ref.abs().max()
    assert (err <= slack + tol).all(), f"max error {err.max():.3g}"
    with kernels.cpu_math("fast"), prefill_gemm.fixed_crossover(16):
        prefill_gemm.enable(False)
        try:
            kernel = moe_ffn(x, slots, weights, pool, None, ffn=SWIGLU)
        finally:
            prefill_gemm.enable(True)
    assert not torch.equal(kernel, out)  # the switch puts every expert back on the kernel


@needs_fast
def test_a_pool_the_kernels_do_not_read_sends_its_big_experts_to_the_matmul_and_the_rest_to_torch():
    S, H, I, K, T = 4, 96, 40, 2, 64
    _, pool, gate, up, down = _moe_pool("bf16", {}, S, H, I)
    pool = {
        "gate_up": pool["gate_up"].transpose(1, 2).contiguous(),
        "down": pool["down"].transpose(1, 2).contiguous(),
    }
    ffn = ExpertFFN(
        transposed=True
    )  # plain weights stored [in, out], as GPT-OSS's bf16 checkpoints: no kernel
    assert kernels.moe_args(pool, None, H, ffn) is None
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    slots, weights = _routing(T, K, S, seed=5)
    slots[:, 0] = 0  # slot 0: every token; slot 1: 56 tokens; slot 2: 8 (on the torch code)
    slots[: T - 8, 1] = 1
    slots[T - 8 :, 1] = 2
    before = prefill_gemm.CALLS["expert"]
    with kernels.cpu_math("fast"), prefill_gemm.fixed_crossover(16):
        out = moe_ffn(x, slots, weights, pool, None, ffn=ffn)
    assert prefill_gemm.CALLS["expert"] == before + 2  # slots 0 and 1; slot 2's 8 tokens on the torch code
    on_matmul = slots.clone()
    on_matmul[slots == 2] = -1
    ref, slack = _rounded_expert_reference(x, on_matmul, weights, gate, up, down)
    rest = torch.where(slots == 2, slots, torch.full_like(slots, -1))
    for t, j in (rest >= 0).nonzero().tolist():  # the torch code: float32 activations, unrounded
        h = torch.nn.functional.silu(gate[2] @ x[t].double()) * (up[2] @ x[t].double())
        ref[t] += float(weights[t, j]) * (down[2] @ h)
    err = (out.double() - ref).abs()
    assert (err <= slack + 1e-5 * ref.abs().max()).all(), f"max error {err.max():.3g}"


@needs_fast
def test_a_gpt_oss_mxfp4_expert_on_the_matmul_equals_its_dequantized_bf16_math():
    S, H, I, T = 3, 64, 32, 40
    method, pool, gate, up, down = _moe_pool("mxfp4", {}, S, H, I)  # e2m1 x e8m0: exact in bf16
    ffn = ExpertFFN(act="clamped_swiglu", alpha=1.702, limit=7.0)
    pool = {**pool, "gate_up_bias": torch.randn(S, 2 * I), "down_bias": torch.randn(S, H)}
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    slots = torch.zeros(T, 1, dtype=torch.long)
    weights = torch.ones(T, 1)
    before = prefill_gemm.CALLS["expert"]
    with kernels.cpu_math("fast"), prefill_gemm.fixed_crossover(16):
        out = moe_ffn(x, slots, weights, pool, method, ffn=ffn)
    assert prefill_gemm.CALLS["expert"] == before + 1
    xr = r16(x)
    g = r16(xr @ gate[0].T) + pool["gate_up_bias"][0, :I].double()
    u = r16(xr @ up[0].T) + pool["gate_up_bias"][0, I:].double()
    g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    h = r16((u + 1) * g * torch.sigmoid(1.702 * g))
    ref = r16(h @ down[0].T) + pool["down_bias"][0].double()
    slack = ULP * ref.abs() + 2 * ULP * (h.abs() @ down[0].abs().T) + 1e-5 * ref.abs().max()
    assert ((out.double() - ref).abs() <= slack).all()


@needs_fast
def test_gpt_oss_fused_interleaved_mxfp4_experts_on_the_matmul():
    S, H, I, T = 2, 64, 32, 24
    method, gu_parts, gu = _packed("mxfp4", {}, 2 * I, H, S, seed=7)  # gate_up rows alternate gate, up
    _, dn_parts, down = _packed("mxfp4", {}, H, I, S, seed=8)
    pool = {
        **{k.replace("p.", "gate_up.", 1): t for k, t in gu_parts.items()},
        **{k.replace("p.", "down.", 1): t for k, t in dn_parts.items()},
        "gate_up_bias": torch.randn(S, 2 * I),
        "down_bias": torch.randn(S, H),
    }
    ffn = ExpertFFN(act="clamped_swiglu", interleaved=True, fused_quant=True, alpha=1.702, limit=7.0)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(9))
    slots = torch.ones(T, 1, dtype=torch.long)  # every token to slot 1
    weights = torch.rand(T, 1, generator=torch.Generator().manual_seed(10))
    before = prefill_gemm.CALLS["expert"]
    with kernels.cpu_math("fast"), prefill_gemm.fixed_crossover(16):
        out = moe_ffn(x, slots, weights, pool, method, ffn=ffn)
    assert prefill_gemm.CALLS["expert"] == before + 1
    b = pool["gate_up_bias"][1].double()
    xr = r16(x)
    gate_up = r16(xr @ gu[1].T) + b
    g, u = gate_up[:, 0::2].clamp(max=7.0), gate_up[:, 1::2].clamp(-7.0, 7.0)
    h = r16((u + 1) * g * torch.sigmoid(1.702 * g))
    y = r16(h @ down[1].T) + pool["down_bias"][1].double()
    ref = weights.double() * y
    slack = (
        weights.double() * (ULP * y.abs() + 2 * ULP * (h.abs() @ down[1].abs().T)) + 1e-5 * ref.abs().max()
    )
    assert ((out.double() - ref).abs() <= slack).all()


def test_the_environment_switch_turns_the_path_off():
    code = "from expertcache.kernels import prefill_gemm; print(prefill_gemm.enabled())"
    for value, expect in (("0", "False"), ("1", "True")):
        env = {**os.environ, prefill_gemm.ENV: value}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expect


def test_the_crossover_search_stops_where_the_matmul_stops_winning(monkeypatch):
    measured = []
    monkeypatch.setattr(prefill_gemm, "_best", lambda fn, t: fn(t))
    kernel = lambda t: measured.append(t) or t  # noqa: E731 - stand-in times: the kernel linear in T
    assert prefill_gemm.measure(kernel, lambda t: 40.0)[0] == 64  # 40 < 64, not < 32
    assert measured == [512, 256, 128, 64, 32]
    assert prefill_gemm.measure(kernel, lambda t: 1e9)[0] == prefill_gemm.NEVER
    assert prefill_gemm.measure(kernel, lambda t: 0.0)[0] == prefill_gemm.PROBE_T[0]


def test_the_crossover_is_measured_once_per_machine_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("EXPERTCACHE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prefill_gemm, "_loaded", [""])
    monkeypatch.setattr(prefill_gemm, "_table", {})
    runs = []
    monkeypatch.setattr(prefill_gemm, "measure", lambda k, g: runs.append(1) or (128, {}))
    probe = lambda: (None, None)  # noqa: E731
    assert prefill_gemm.crossover("dense", "bf16", 70, 1031, probe) == 128
    assert prefill_gemm.crossover("dense", "bf16", 70, 1031, probe) == 128
    assert len(runs) == 1
    saved = json.loads((tmp_path / "prefill_gemm.json").read_text())
    assert saved == {prefill_gemm.hardware_key(): {"dense|bf16|70x1031": 128}}
    prefill_gemm._loaded[0] = ""  # a new process: read from the file
    prefill_gemm._table.clear()
    assert prefill_gemm.crossover("dense", "bf16", 70, 1031, probe) == 128 and len(runs) == 1
    (tmp_path / "prefill_gemm.json").write_text("{damaged")
    prefill_gemm._loaded[0] = ""
    assert (
        prefill_gemm.crossover("dense", "bf16", 70, 1031, probe) == 128 and len(runs) == 2
    )  # measured again


SEQ = [(i * 37 + 11) % 300 + 3 for i in range(96)]


@needs_fast
def test_whole_model_prefill_on_the_matmul_is_within_bf16_of_the_kernel_path(checkpoint):
    path = checkpoint(
        "qwen3_moe",
        dtype=torch.bfloat16,
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_hidden_layers=2,
        num_experts_per_tok=2,
    )
    llm = LLM(str(path), cpu_math="fast")
    exact = LLM(str(path)).logits(SEQ)
    prefill_gemm.enable(False)
    try:
        kernel = llm.logits(SEQ)
    finally:
        prefill_gemm.enable(True)
    before = dict(prefill_gemm.CALLS)
    with prefill_gemm.fixed_crossover(16):
        matmul = llm.logits(SEQ)
    assert prefill_gemm.CALLS["dense"] > before["dense"] and prefill_gemm.CALLS["expert"] > before["expert"]
    assert not torch.equal(matmul, kernel)  # the outputs were rounded
    for fast in (kernel, matmul):  # both fast paths as close to the exact math
        assert (fast - exact).abs().max() <= 2e-2 * exact.abs().max()
    assert (matmul.argmax(-1) == kernel.argmax(-1)).float().mean() >= 0.9


@needs_fast
@pytest.mark.parametrize("n,t", [(5, 1), (300, 17), (257, 64), (1024, 3)])
def test_the_pool_matmul_equals_torch_bitwise(n, t):
    """Within a forward on 2 threads the bf16 matmul runs as single-threaded blocks of W's rows on the
    kernels' threads (csrc/pool_gemm.cpp): the same oneDNN products as torch's own matmul, row block by
    row block, so the outputs are bitwise equal; the result has contiguous rows (the attention reads it)."""
    g = torch.Generator().manual_seed(n + t)
    w = (torch.randn(n, 96, generator=g) * 0.1).bfloat16()
    x = torch.randn(2, t, 96, generator=g)
    want = torch.nn.functional.linear(x.bfloat16(), w).float()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with kernels.cpu_threads("cpu"):
            assert prefill_gemm._threads[0] == 2  # the pool path is the one taken
            got = prefill_gemm.bf16_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert got.is_contiguous() and got.shape == (2, t, n)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="linear_bf16: x"):
        kernels.extension().linear_bf16(x[0].bfloat16(), w[:, :95])


@needs_fast
@pytest.mark.parametrize("interleaved", [False, True])
def test_the_experts_on_the_kernels_threads_equal_bf16_expert_one_at_a_time(interleaved):
    """pool_experts (csrc/pool_gemm.cpp experts_bf16: every expert a unit of the kernels' threads) against
    bf16_expert called expert by expert: the same roundings, so equal up to the float32 order in which a
    token's pairs are added. Skipped pairs, a slot repeated within a token, an empty slot, a slot not taken
    (its pairs stay out) and an output that already holds values."""
    from expertcache.experts.prefill import bf16_expert, pool_experts

    S, H, I, K, T = 6, 130, 70, 3, 40
    _, pool, _, _, _ = _moe_pool("bf16", {}, S, H, I)
    ffn = ExpertFFN(interleaved=interleaved)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g)
    slots, weights = _routing(T, K, S, seed=4)
    take = torch.tensor([True, True, False, True, True, True])
    base = torch.randn(T, H, generator=g)
    out = base.clone()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with kernels.cpu_threads("cpu"):
            pool_experts(x, slots, weights, pool, take, ffn, out)
    finally:
        torch.set_num_threads(threads)
    want = base.double()
    for s in range(S):
        tok, k = (slots == s).nonzero(as_tuple=True)
        if take[s] and tok.numel():
            y = bf16_expert(x[tok], {n: t[s] for n, t in pool.items()}, None, ffn)
            want.index_add_(0, tok, (y * weights[tok, k, None]).double())
    assert (slots == 2).any()  # the slot not taken was routed
    err = (out.double() - want).abs()
    assert (err <= 1e-6 * want.abs().max()).all(), f"max error {err.max():.3g}"
    with pytest.raises(RuntimeError, match="experts_bf16: down"):
        pool_experts(
            x, slots, weights, {"gate_up": pool["gate_up"], "down": pool["down"][:, :, 1:]}, take, ffn, out
        )
