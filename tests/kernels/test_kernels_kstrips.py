"""The K-quants' prefill strips (csrc/ggml_kstrips.cpp: q4_k, q5_k, q6_k from get_strip_tokens() tokens of a
weight, 32 rows decoded once per 2 superblocks, rows in the lanes) against the `gguf` package's dequantiser.

- Weights: tests/gguf_files.py random_blocks (random codes, 6-bit scales and mins, q6_k's int8 scales, random
  fp16 d / dmin), so a scale or a min applied to the wrong sub-block, row or superblock moves the output by
  about its own size, far past the float32 rounding the comparison allows.
- Oracle: the float64 product of gguf's dequantised weights with the activations quantised as the fast math
  defines (int8 per 256, scale max|x| / 127, nearest even), to the fast math's tolerance (test_kernels._close).
- Shapes: rows not a multiple of the 32-row strip (5, 37, 70), K of 1, 3 and 5 superblocks (a last K chunk of
  one), token counts across the 4-token register blocks (4, 5, 7, 13, 64) and a unit of 48 rows (a strip
  and 16 rows); the row kernels alone (strips off) on the same cases; the fused MoE call (q4_k gate / up,
  q6_k down as Q4_K_M stores them) at prefill token counts.
- AMX (q4_k and q5_k: calls of 48 tokens or more, passes of 16 while 12 remain, where the CPU has it, each superblock's sum as one integer
  from the scales split in two): against the dequantiser and within float32 rounding (1e-6 of the product's
  magnitude) of the VNNI strips, at token counts that split into AMX passes and a VNNI rest (48, 50, 61, 64, 77).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import random_blocks
from kernel_refs import assert_moe_close, moe_reference
from test_kernels import _close, _routing
from test_kernels_ggml import FAST, K_STRIP_TYPES, Q8ACT256, SMALL_T, _moe, _x, needs_cpp, spec_of

from expertcache import kernels

gguf = pytest.importorskip("gguf")


def _weights(t: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (uint8 [1, n, row bytes] from random_blocks, float64 [n, k] from gguf's dequantiser)."""
    data = random_blocks(t.upper(), n, k, seed=seed)
    w = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[t.upper()]).astype(np.float64)
    return torch.from_numpy(data)[None], torch.from_numpy(w)


@pytest.fixture
def strips_from(request):
    """Strips from request.param tokens (0: never), restored afterwards."""
    if not FAST:
        pytest.skip("the fast CPU math needs AVX-512 BF16/VNNI")
    ext = kernels.extension()
    saved = ext.get_strip_tokens()
    ext.set_strip_tokens(request.param)
    yield request.param
    ext.set_strip_tokens(saved)


@needs_cpp
@pytest.mark.parametrize("strips_from", [4, 0], indirect=True)
@pytest.mark.parametrize("t", K_STRIP_TYPES)
def test_linear_kstrips_against_the_gguf_dequantiser(t, strips_from):
    ext = kernels.extension()
    for n, k in [(37, 768), (70, 1280), (5, 256)]:
        data, w = _weights(t, n, k, seed=n + k)
        spec = spec_of(t, data, k)
        assert ext.kernel_of(spec, 1).endswith("+strips") == (strips_from > 0)
        for T in (4, 5, 7, 13, 64):
            x = _x(T, k, T + 1)
            xr = Q8ACT256(x)
            y = ext.linear(x, spec, 0, SMALL_T, 48, kernels.CPU_MATHS["fast"])
            _close(y, xr @ w.T, xr.abs() @ w.abs().T)


@needs_cpp
@pytest.mark.parametrize("strips_from", [4], indirect=True)
def test_a_non_finite_activation_spoils_its_own_token_only(strips_from):
    ext = kernels.extension()
    for t in K_STRIP_TYPES:
        data, w = _weights(t, 40, 512, seed=3)
        spec = spec_of(t, data, 512)
        x = _x(6, 512, 2)
        x[1, 5], x[4, 511] = float("nan"), float("inf")
        y = ext.linear(x, spec, 0, SMALL_T, 48, kernels.CPU_MATHS["fast"])
        assert not torch.isfinite(y[[1, 4]]).any(), t
        xr = Q8ACT256(x[[0, 2, 3, 5]])
        _close(y[[0, 2, 3, 5]], xr @ w.T, xr.abs() @ w.abs().T)


@needs_cpp
@pytest.mark.parametrize("strips_from", [4], indirect=True)
def test_fused_moe_q4_k_m_against_the_gguf_dequantiser(strips_from):
    """Q4_K_M's experts (q4_k gate / up, q6_k down) through the fused call, tokens per expert past the strips'."""
    S, A, H, I = 4, 2, 512, 768
    parts = {}
    for name, t, n, k in [("gate", "q4_k", I, H), ("up", "q4_k", I, H), ("down", "q6_k", H, I)]:
        slots = [_weights(t, n, k, seed=10 * s + len(parts)) for s in range(S)]
        data = torch.cat([d for d, _ in slots])
        parts[name] = (spec_of(t, data, k), torch.stack([w for _, w in slots]))
    (gs, gw), (us, uw), (ds, dw) = parts["gate"], parts["up"], parts["down"]
    for T in (9, 24):
        x = _x(T, H, T) * 0.5
        slots, weights = _routing(T, A, S, seed=T)
        out = _moe(x, slots, weights, (gs, us, ds), "silu", (None, None, None), "fast", SMALL_T)
        ref, slack = moe_reference(
            x, slots, weights, gw, uw, dw, rnd=Q8ACT256, act="silu", biases=(None, None, None)
        )
        assert_moe_close(out, ref, slack, f"q4_k_m strips T={T}")


NO_AMX = "needs a CPU with AMX-TILE/INT8 whose OS grants the tile state"  # .ci/check_skips.py allows it


@needs_cpp
@pytest.mark.parametrize("strips_from", [4], indirect=True)
@pytest.mark.parametrize("t", ["q4_k", "q5_k"])
def test_kstrips_on_amx_agree_with_the_vnni_strips(t, strips_from):
    ext = kernels.extension()
    if not ext.amx_supported():
        pytest.skip(NO_AMX)
    saved = ext.get_amx()
    try:
        for n, k in [(37, 768), (70, 1280)]:
            data, w = _weights(t, n, k, seed=n + k)
            spec = spec_of(t, data, k)
            for T in (48, 50, 61, 64, 77):
                x = _x(T, k, T + 3)
                got = {}
                for on in (True, False):
                    ext.set_amx(on)
                    got[on] = ext.linear(x, spec, 0, SMALL_T, 48, kernels.CPU_MATHS["fast"])
                xr = Q8ACT256(x)
                scale = xr.abs() @ w.abs().T
                _close(got[True], xr @ w.T, scale)
                # the same integer sums, only the float rounding after them differs
                assert ((got[True] - got[False]).abs() <= 1e-6 * scale).all(), (t, n, k, T)
    finally:
        ext.set_amx(saved)
