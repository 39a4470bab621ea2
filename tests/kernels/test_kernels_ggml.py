"""The GGUF block kernels (csrc/ggml_kernels.cpp) against the `gguf` package's dequantiser.

- Weights: rows of GGUF blocks made by `gguf.quants.quantize` where it has a quantiser (q8_0, q4_0, q5_0,
  mxfp4), else random bytes with finite random fp16 scales written over the blocks' scale fields (q4_k,
  q5_k, q6_k, iq4_nl, iq4_xs); the oracle is `gguf.quants.dequantize`, then a float64 matmul.
- Exact math, on the AVX-512 kernels and on the AVX2 fallback (set_avx512(False)): the dense linear for
  1..17 tokens (one row pass, chunks of tokens) and 40 (the tiled path), row counts that are not a
  multiple of anything, a slot of a pool; the fused MoE call with SwiGLU and with GPT-OSS's clamped SwiGLU
  and biases, several experts, repeated and skipped pairs, a slot not taken, q4_k gate/up beside a q6_k
  down as Q4_K_M stores them.
- Fast math (every type): against the float64 sum over the activations quantised
  as the kernels define (int8 per 32 for the 32-weight blocks, per 256 for the K-quants; scale max|x| / 127, nearest even), so the
  kernels may differ only by float32 rounding.
- kernel_of names each kernel; a bad block shape is refused naming the tensor.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from kernel_refs import F32ACT, Q8ACT32, ActRounding, _q8, assert_moe_close, moe_reference
from test_kernels import _close, _routing

from expertcache import kernels
from expertcache.kernels.formats import GGUF_SMALL_T, GGUF_TYPES, GGUF_UNIT_ROWS, Unsupported, quant_spec

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize

needs_cpp = pytest.mark.skipif(kernels.backend() != "cpp", reason=f"C++ kernels unavailable: {kernels.why()}")
AVX512 = kernels.backend() == "cpp" and kernels.extension().avx512_supported()
FAST = kernels.backend() == "cpp" and kernels.extension().fast_supported()
TYPES = list(GGUF_TYPES)
FAST_TYPES = TYPES
STRIP_TYPES = ["q4_0", "iq4_nl", "mxfp4"]  # the fast kernels with strips for many tokens
K_STRIP_TYPES = ["q4_k", "q5_k", "q6_k"]  # theirs in csrc/ggml_kstrips.cpp (test_kernels_kstrips.py)
QUANTISED = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q5_0": "Q5_0", "mxfp4": "MXFP4"}  # types gguf can quantise
TOKENS = [1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 40]
SMALL_T = 16  # the linear tests' row-pass limit: T = 40 takes the tiled path
Q8ACT256 = ActRounding("q8act256", lambda x: torch.mul(*_q8(x, 256)), lambda h: _q8(h[None], 256)[1][0])
# byte offsets of each type's fp16 scales within a block (random blocks get finite ones written there)
FP16_FIELDS = {"q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208], "iq4_nl": [0], "iq4_xs": [0]}


def qtype(t: str):
    return gguf.GGMLQuantizationType[t.upper()]


def blocks(t: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """n rows of k weights of GGUF type t -> (uint8 [n, k / QK * bytes], float64 [n, k] from gguf's dequantiser)."""
    rng = np.random.default_rng(seed)
    _, qk, nbytes = GGUF_TYPES[t]
    if t in QUANTISED:
        data = quantize(
            (rng.standard_normal((n, k)) * rng.uniform(0.1, 2, (n, 1))).astype(np.float32), qtype(t)
        )
    else:
        data = rng.integers(0, 256, (n, k // qk, nbytes), dtype=np.uint8)
        for i, off in enumerate(FP16_FIELDS[t]):  # d: either sign; dmin: positive
            scale = rng.uniform(2e-3, 2e-2, (n, k // qk)) * (
                rng.choice([-1, 1], (n, k // qk)) if i == 0 else 1
            )
            data[:, :, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, k // qk, 2)
        data = data.reshape(n, -1)
    w = torch.from_numpy(dequantize(data, qtype(t)).astype(np.float64))
    return data, w


def method(t: str):
    """The stand-in QuantMethod of the kernels' registry: its name (and the pool part it keys on)."""
    return types.SimpleNamespace(name=f"gguf-{t}", primary="weight")


def pool(t: str, n: int, k: int, slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (uint8 [S, n, row bytes], float64 [S, n, k])."""
    parts = [blocks(t, n, k, seed + s) for s in range(slots)]
    return torch.from_numpy(np.stack([d for d, _ in parts])), torch.stack([w for _, w in parts])


def spec_of(t: str, data: torch.Tensor, k: int) -> tuple:
    return quant_spec(method(t), {"p.weight": data}, "p", data.shape[1], k)


def shapes(t: str) -> list[tuple[int, int]]:
    qk = GGUF_TYPES[t][1]
    return [(1, qk), (7, 3 * qk), (37, 8 * qk)] if qk == 256 else [(1, 32), (7, 96), (37, 352), (10, 2880)]


@pytest.fixture
def isa(request):
    """The kernels' ISA for a test (request.param: avx512 / avx2), restored afterwards."""
    if request.param == "avx512" and not AVX512:
        pytest.skip("this CPU lacks AVX-512 F/BW/VL")
    ext = kernels.extension()
    saved = ext.get_avx512()
    ext.set_avx512(request.param == "avx512")
    yield request.param
    ext.set_avx512(saved)


def _linear(x, spec, math="exact", slot=0, small_t=SMALL_T):
    return kernels.extension().linear(x, spec, slot, small_t, 8, kernels.CPU_MATHS[math])


def _x(T: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(T, k, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.2, 2, k)


@needs_cpp
@pytest.mark.parametrize("isa", ["avx512", "avx2"], indirect=True)
@pytest.mark.parametrize("t", TYPES)
def test_linear_exact_against_the_gguf_dequantiser(t, isa):
    for n, k in shapes(t):
        data, w = pool(t, n, k, 1, seed=n + k)
        spec = spec_of(t, data, k)
        for T in TOKENS:
            x = _x(T, k, T)
            _close(_linear(x, spec), x.double() @ w[0].T, x.double().abs() @ w[0].abs().T)


@needs_cpp
@pytest.mark.parametrize("isa", ["avx512", "avx2"], indirect=True)
@pytest.mark.parametrize("t", ["q4_k", "q8_0", "mxfp4"])
def test_linear_reads_the_slot_asked_for(t, isa):
    k = GGUF_TYPES[t][1] * 2
    data, w = pool(t, 9, k, 3, seed=5)
    spec = spec_of(t, data, k)
    x = _x(3, k, 1)
    for s in range(3):
        _close(_linear(x, spec, slot=s), x.double() @ w[s].T, x.double().abs() @ w[s].abs().T)


def _moe_case(gt: str, dt: str, S: int, H: int, I: int, seed: int, biases: bool):
    """Pool specs (gate/up of type gt, down of dt) and their float64 weights, with biases or None."""
    g, gw = pool(gt, I, H, S, seed)
    u, uw = pool(gt, I, H, S, seed + 100)
    d, dw = pool(dt, H, I, S, seed + 200)
    specs = (
        quant_spec(method(gt), {"gate.weight": g}, "gate", I, H),
        quant_spec(method(gt), {"up.weight": u}, "up", I, H),
        quant_spec(method(dt), {"down.weight": d}, "down", H, I),
    )
    gen = torch.Generator().manual_seed(seed)
    bias = tuple(torch.randn(S, n, generator=gen) * 0.1 for n in (I, I, H)) if biases else (None, None, None)
    return specs, (gw, uw, dw), bias, {"gate.weight": g, "up.weight": u, "down.weight": d}


def _moe(x, slots, weights, specs, act, bias, math, small_t):
    code = specs[0][0]
    alpha, limit = (1.702, 7.0) if act == "clamped_swiglu" else (1.0, float("inf"))
    return kernels.extension().moe(
        x,
        slots,
        weights,
        *specs,
        kernels.ACTIVATIONS[act],
        alpha,
        limit,
        *bias,
        None,
        small_t,
        max(1, int(256 * GGUF_UNIT_ROWS[code])),
        kernels.CPU_MATHS[math],
    )


MOE_CASES = [
    ("q4_k", "q6_k"),
    ("q5_k", "q5_k"),
    ("iq4_xs", "q4_k"),
    ("q8_0", "q8_0"),
    ("q4_0", "q5_0"),
    ("iq4_nl", "iq4_nl"),
    ("mxfp4", "mxfp4"),
]


@needs_cpp
@pytest.mark.parametrize("isa", ["avx512", "avx2"], indirect=True)
@pytest.mark.parametrize("act", ["silu", "clamped_swiglu"])
@pytest.mark.parametrize("gt,dt", MOE_CASES)
def test_fused_moe_exact_against_float64(gt, dt, act, isa):
    """S = 5 experts (slot 4 never taken), top 3 with a repeated and a skipped pair; T = 1..17 and 40."""
    S, A = 5, 3
    H, I = (256, 512) if GGUF_TYPES[gt][1] == 256 or GGUF_TYPES[dt][1] == 256 else (64, 96)
    specs, (gw, uw, dw), bias, _ = _moe_case(gt, dt, S, H, I, seed=3, biases=act == "clamped_swiglu")
    for T in (1, 2, 3, 5, 8, 17, 40):
        x = _x(T, H, T) * 0.5
        slots, weights = _routing(T, A, S, seed=T)
        out = _moe(x, slots, weights, specs, act, bias, "exact", SMALL_T)
        ref, slack = moe_reference(x, slots, weights, gw, uw, dw, act=act, biases=bias)
        assert_moe_close(out, ref, slack, f"{gt}/{dt} {act} T={T}")


@needs_cpp
def test_the_python_moe_entry_reads_a_gguf_pool(monkeypatch):
    """kernels.moe over a pool {"gate.weight", "up.weight", "down.weight"} of one GGUF method (with the
    codes' tuning registered beside the other formats', as formats.GGUF_SMALL_T / GGUF_UNIT_ROWS give it)."""
    monkeypatch.setattr(kernels, "SMALL_T", {**kernels.SMALL_T, **GGUF_SMALL_T})
    monkeypatch.setattr(
        kernels,
        "_UNIT_ROWS_OF",
        {**kernels._UNIT_ROWS_OF, **{c: max(1, int(256 * r)) for c, r in GGUF_UNIT_ROWS.items()}},
    )
    S, H, I = 4, 256, 256
    _, (gw, uw, dw), _, parts = _moe_case("q4_k", "q4_k", S, H, I, seed=9, biases=False)
    x = _x(3, H, 2) * 0.5
    slots, weights = _routing(3, 2, S, seed=1)
    out = torch.zeros(3, H)
    assert kernels.moe(x, slots, weights, parts, method("q4_k"), out)
    ref, slack = moe_reference(x, slots, weights, gw, uw, dw)
    assert_moe_close(out, ref, slack, "kernels.moe q4_k")


def _skip_no_fast():
    if not FAST:
        pytest.skip("the fast CPU math needs AVX-512 BF16/VNNI")


def _act_rounding(t: str) -> ActRounding:
    return Q8ACT32 if GGUF_TYPES[t][1] == 32 else Q8ACT256


@needs_cpp
@pytest.mark.parametrize("t", FAST_TYPES)
def test_linear_fast_against_float64_of_quantised_activations(t):
    _skip_no_fast()
    rnd = _act_rounding(t)
    for n, k in shapes(t):
        data, w = pool(t, n, k, 1, seed=n + k)
        spec = spec_of(t, data, k)
        for T in TOKENS:
            x = _x(T, k, T)
            xr = rnd(x)
            _close(_linear(x, spec, "fast"), xr @ w[0].T, xr.abs() @ w[0].abs().T)


@needs_cpp
@pytest.mark.parametrize("strip_from", [0, 1, 4])
@pytest.mark.parametrize("t", STRIP_TYPES)
def test_linear_fast_strips_against_float64_of_quantised_activations(t, strip_from):
    """The 4-bit types' strips (32 rows decoded once, rows in the lanes) from strip_from tokens, and the row
    kernels alone (0: never strips): rows not a multiple of 32, a row of 2880 (blocks not a multiple of 4),
    token counts across the strips' register blocks, units of rows that end inside a strip."""
    _skip_no_fast()
    ext = kernels.extension()
    saved = ext.get_strip_tokens()
    ext.set_strip_tokens(strip_from)
    try:
        for n, k in [(33, 128), (70, 2880), (5, 352)]:
            data, w = pool(t, n, k, 1, seed=n + k + 1)
            spec = spec_of(t, data, k)
            for T in (1, 4, 7, 12, 64):
                x = _x(T, k, T + 3)
                xr = Q8ACT32(x)
                # units of 48 rows: a strip and 16 rows
                y = ext.linear(x, spec, 0, SMALL_T, 48, kernels.CPU_MATHS["fast"])
                _close(y, xr @ w[0].T, xr.abs() @ w[0].abs().T)
    finally:
        ext.set_strip_tokens(saved)


@needs_cpp
@pytest.mark.parametrize("act", ["silu", "clamped_swiglu"])
@pytest.mark.parametrize(
    "gt,dt",
    [
        ("q4_k", "q6_k"),
        ("q6_k", "q4_k"),
        ("q8_0", "q8_0"),
        ("mxfp4", "mxfp4"),
        ("q4_0", "iq4_nl"),
        ("q5_k", "q6_k"),
        ("q5_0", "q8_0"),
        ("iq4_xs", "q4_k"),
    ],
)
def test_fused_moe_fast_against_float64_of_quantised_activations(gt, dt, act):
    _skip_no_fast()
    S, A = 5, 3
    H, I = (256, 512) if GGUF_TYPES[gt][1] == 256 else (96, 160)
    specs, (gw, uw, dw), bias, _ = _moe_case(gt, dt, S, H, I, seed=4, biases=act == "clamped_swiglu")
    for T in (1, 2, 3, 5, 8, 17):
        x = _x(T, H, T) * 0.5
        slots, weights = _routing(T, A, S, seed=T)
        out = _moe(x, slots, weights, specs, act, bias, "fast", SMALL_T)
        ref, slack = moe_reference(x, slots, weights, gw, uw, dw, rnd=_act_rounding(gt), act=act, biases=bias)
        assert_moe_close(out, ref, slack, f"{gt}/{dt} fast {act} T={T}")


def _offset_activations(T: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """Activations whose int8 codes have large code sums: a common offset of either sign, and blocks of 32
    equal values (codes all +-127) of random sign and size, also at 1e30 (mxfp4's smallest scales)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(T, k, generator=g) * 0.1
    sign = torch.randint(0, 2, (T, k // 32, 1), generator=g) * 2 - 1
    size = torch.rand(T, k // 32, 1, generator=g) * 4 + 0.1
    flat = (sign * size).expand(T, k // 32, 32).reshape(T, k)
    return {"plus": 3 + noise, "minus": -3 + noise, "flat": flat, "flat_1e30": flat * 1e30}


@needs_cpp
@pytest.mark.parametrize("t", ["q4_0", "q5_0", "iq4_nl", "mxfp4"])
def test_fast_4bit_blocks_take_off_the_weights_offset_by_the_code_sums(t):
    """The 32-weight 4-bit kernels read the weights as value + 128 and take the 128 off by the activations'
    code sums: activations whose sums are large (an offset of either sign, blocks of equal codes), through
    the row kernels (1, 2, 3 tokens: rows a pass; 5: a row at a time) and the strips (12), 37 rows (not a
    multiple of 4) of 11 blocks (a last group of 3); mxfp4 also with e8m0 scales 0..3 (subnormal halves)."""
    _skip_no_fast()
    ext = kernels.extension()
    n, k = 37, 352
    data, w = pool(t, n, k, 1, seed=21)
    if t == "mxfp4":  # rows 0..11: every block's scale 2^-128 .. 2^-125
        blk = data.numpy().reshape(n, k // 32, 17)
        blk[:12, :, 0] = np.random.default_rng(5).integers(0, 4, (12, k // 32))
        w = torch.from_numpy(dequantize(blk.reshape(n, -1), qtype(t)).astype(np.float64))[None]
    spec = spec_of(t, data, k)
    saved = ext.get_strip_tokens()
    ext.set_strip_tokens(8)
    try:
        for T in (1, 2, 3, 5, 12):
            for name, x in _offset_activations(T, k, seed=T).items():
                xr = Q8ACT32(x)
                y = _linear(x, spec, "fast")
                rows = slice(0, 12) if name == "flat_1e30" else slice(12, n)  # outputs of normal size
                ref, bound = xr @ w[0].T, xr.abs() @ w[0].abs().T
                try:
                    _close(y[:, rows], ref[:, rows], bound[:, rows])
                except AssertionError as e:
                    raise AssertionError(f"{t} T={T} {name}: {e}") from None
    finally:
        ext.set_strip_tokens(saved)


@needs_cpp
def test_a_non_finite_activation_spoils_its_own_token_only():
    _skip_no_fast()
    for t in FAST_TYPES:
        n, k = shapes(t)[1]
        data, w = pool(t, n, k, 1, seed=8)
        spec = spec_of(t, data, k)
        x = _x(4, k, 1)
        x[1, 5], x[2, k - 1] = float("nan"), float("inf")
        for math in ("exact", "fast"):
            y = _linear(x, spec, math)
            assert not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any(), (t, math)
            xr = (F32ACT if math == "exact" else _act_rounding(t))(x[[0, 3]])
            _close(y[[0, 3]], xr @ w[0].T, xr.abs() @ w[0].abs().T)


@needs_cpp
def test_kernel_of_names_each_kernel():
    ext = kernels.extension()
    saved = ext.get_avx512()
    try:
        for t in TYPES:
            data, _ = pool(t, 2, GGUF_TYPES[t][1], 1, seed=0)
            spec = spec_of(t, data, GGUF_TYPES[t][1])
            ext.set_avx512(True)
            assert ext.kernel_of(spec, 0) == (f"avx512-{t}-f32act" if AVX512 else f"avx2-{t}-f32act")
            if FAST:
                act = ("q8_kact" if GGUF_TYPES[t][1] == 256 else "q8_0act") if t in FAST_TYPES else None
                act += "+strips" if t in STRIP_TYPES + K_STRIP_TYPES and ext.get_strip_tokens() else ""
                assert ext.kernel_of(spec, 1) == (f"avx512vnni-{t}-{act}" if act else f"avx512-{t}-f32act")
            ext.set_avx512(False)
            assert ext.kernel_of(spec, 0) == f"avx2-{t}-f32act"
            if FAST:
                assert ext.kernel_of(spec, 1) == f"avx2-{t}-f32act"  # the fallback stays exact in fast math
    finally:
        ext.set_avx512(saved)


@needs_cpp
def test_bad_block_shapes_are_refused_by_name():
    data, _ = pool("q4_k", 3, 512, 1, seed=0)
    with pytest.raises(Unsupported, match=r"gguf-q4_k: p.weight must be uint8 \[S, 3, 288\]"):
        spec_of("q4_k", data[:, :, :200], 512)
    with pytest.raises(Unsupported, match="not a multiple of the 256-weight block"):
        quant_spec(method("q4_k"), {"p.weight": data}, "p", 3, 500)
    bad = (GGUF_TYPES["q6_k"][0], data, None, None, 3, 512, 256, 1)  # q4_k bytes named q6_k: 288 != 420
    with pytest.raises(RuntimeError, match=r"q6_k data must be uint8 \[S, N, 420\]"):
        _linear(torch.randn(1, 512), bad)
