"""Numeric formats of expertcache.quant against hand-computed values and
independent references (per-element / per-block loops written here, and
transformers' MXFP4 decoder as the oracle)."""

from __future__ import annotations

import math

import pytest
import torch

from expertcache.quant.fp4 import E2M1_VALUES, decode_e2m1, decode_e8m0, encode_e2m1, encode_e8m0
from expertcache.quant.fp8 import E4M3_MAX, decode_e4m3fn, encode_e4m3fn
from expertcache.quant.fp8_block import dequantize_fp8_block, quantize_fp8_block
from expertcache.quant.fp8_channel import dequantize_fp8_channel, quantize_fp8_channel
from expertcache.quant.int4 import dequantize_int4, quantize_int4
from expertcache.quant.int8 import dequantize_int8, quantize_int8
from expertcache.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from expertcache.quant.nibbles import pack_nibbles, unpack_nibbles


def bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).tolist()


# ---- float8 e4m3fn -----------------------------------------------------------


def e4m3fn_reference(code: int) -> float:
    """Bit-level definition: s eeee mmm, bias 7, e=0 subnormal, S.1111.111 NaN."""
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    if e == 15 and m == 7:
        return math.nan
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def test_e4m3fn_decode_hand_values():
    codes = torch.tensor([0x00, 0x80, 0x7E, 0xFE, 0x08, 0x01, 0x07, 0x38, 0x7F, 0xFF], dtype=torch.uint8)
    got = decode_e4m3fn(codes)
    want = [0.0, -0.0, 448.0, -448.0, 2.0**-6, 2.0**-9, 7 * 2.0**-9, 1.0]
    assert got[:8].tolist() == want
    assert torch.signbit(got[1]) and not torch.signbit(got[0])
    assert torch.isnan(got[8:]).all()
    assert not torch.isinf(decode_e4m3fn(torch.arange(256, dtype=torch.uint8))).any()


def test_e4m3fn_decode_all_codes_match_bit_reference():
    codes = torch.arange(256, dtype=torch.uint8)
    got = decode_e4m3fn(codes)
    want = torch.tensor([e4m3fn_reference(c) for c in range(256)], dtype=torch.float32)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    # both input kinds give the same and `out` is filled in place
    buf = torch.empty(256)
    assert decode_e4m3fn(codes.view(torch.float8_e4m3fn), out=buf) is buf
    torch.testing.assert_close(buf, want, equal_nan=True, rtol=0, atol=0)


def test_e4m3fn_encode_hand_values():
    x = torch.tensor(
        [
            0.0,
            -0.0,
            448.0,
            500.0,
            1e30,
            -1e30,
            math.inf,
            -math.inf,
            2.0**-6,
            2.0**-9,
            2.0**-10,
            3 * 2.0**-10,
            1.0625,
            1.1875,
            0.3,
        ]
    )
    got = bits(encode_e4m3fn(x))
    # 2^-10 is a tie between 0 and 2^-9 -> even (0); 3*2^-10 ties 0x01/0x02 -> 0x02;
    # 1.0625 ties 1.0 (0x38) / 1.125 -> 0x38; 1.1875 ties 1.125 / 1.25 (0x3A) -> 0x3A;
    # 0.3 = 1.2 * 2^-2 -> nearest 1.25 * 2^-2 = e 5, m 2 -> 0x2A.
    assert got == [0x00, 0x80, 0x7E, 0x7E, 0x7E, 0xFE, 0x7E, 0xFE, 0x08, 0x01, 0x00, 0x02, 0x38, 0x3A, 0x2A]
    nan = encode_e4m3fn(torch.tensor([math.nan]))
    assert bits(nan)[0] & 0x7F == 0x7F  # NaN stays NaN


def test_e4m3fn_encode_roundtrips_every_finite_code():
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    assert bits(encode_e4m3fn(decode_e4m3fn(codes))) == codes.tolist()


# ---- e2m1 / e8m0 / nibbles ----------------------------------------------------


def test_e2m1_decode_table():
    assert decode_e2m1(torch.arange(16)).tolist() == [
        0,
        0.5,
        1,
        1.5,
        2,
        3,
        4,
        6,
        -0.0,
        -0.5,
        -1,
        -1.5,
        -2,
        -3,
        -4,
        -6,
    ]
    assert torch.signbit(decode_e2m1(torch.tensor([8])))[0]


def test_e2m1_encode_hand_values_and_ties():
    x = torch.tensor(
        [
            0.0,
            0.5,
            1,
            1.5,
            2,
            3,
            4,
            6,
            -6,
            0.25,
            0.75,
            1.25,
            1.75,
            2.5,
            3.5,
            5.0,
            0.26,
            5.01,
            7.0,
            100.0,
            math.inf,
            -0.1,
            -5.5,
            -2.9,
        ]
    )
    want = [0, 1, 2, 3, 4, 5, 6, 7, 15, 0, 2, 2, 4, 4, 6, 6, 1, 7, 7, 7, 7, 8, 15, 13]
    assert encode_e2m1(x).tolist() == want


def test_e2m1_encode_matches_nearest_even_reference():
    torch.manual_seed(0)
    grid = torch.tensor(E2M1_VALUES[:8])
    x = torch.cat([torch.randn(4000) * 3, (torch.arange(-28, 29) / 4.0)])  # incl. every tie
    a = x.abs().clamp(max=6.0)
    d = (a[:, None] - grid[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = (d == best) * (torch.arange(8) % 2 == 0) * 1.0 + (d == best) * 0.5  # prefer even codes
    ref = cand.argmax(dim=1) | (torch.signbit(x).long() << 3)
    assert encode_e2m1(x).tolist() == ref.tolist()


def test_e8m0():
    s = torch.tensor([127, 128, 130, 126, 0, 1, 254, 255], dtype=torch.uint8)
    got = decode_e8m0(s)
    assert got[:7].tolist() == [1.0, 2.0, 8.0, 0.5, 2.0**-127, 2.0**-126, 2.0**127]
    assert got[4] > 0 and torch.isnan(got[7])
    assert encode_e8m0(torch.tensor([0, 3, -127, -200, 127, 500])).tolist() == [127, 130, 0, 0, 254, 254]


def test_nibble_order_low_first():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]])
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert unpack_nibbles(packed).tolist() == codes.tolist()


# ---- MXFP4 --------------------------------------------------------------------


def test_mxfp4_decode_matches_transformers_oracle():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    experts, out_f, groups = 3, 24, 5
    blocks = torch.randint(0, 256, (experts, out_f, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (experts, out_f, groups), dtype=torch.uint8, generator=g)  # 0..254
    scales[0, 0, :3] = torch.tensor([0, 127, 254], dtype=torch.uint8)
    oracle = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)  # [E, in, out]
    for e in range(experts):
        mine = dequantize_mxfp4(blocks[e], scales[e])
        torch.testing.assert_close(mine, oracle[e].t(), rtol=0, atol=0, equal_nan=True)


def test_mxfp4_nan_scale_and_out_buffer():
    blocks = torch.full((2, 1, 16), 0x21, dtype=torch.uint8)
    scales = torch.tensor([[255], [128]], dtype=torch.uint8)
    buf = torch.empty(2, 32)
    got = dequantize_mxfp4(blocks, scales, out=buf)
    assert got is buf
    assert torch.isnan(got[0]).all()
    assert got[1].tolist() == [1.0, 2.0] * 16  # codes 1 (0.5), 2 (1.0) times 2


def test_mxfp4_encode_hand_blocks():
    row = torch.zeros(4, 32)
    row[0, :8] = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])  # amax 6 -> X = 2 - 2 = 0
    row[1, 0], row[1, 1] = 7.0, -1.0  # amax 7 -> X = 0, 7 saturates to 6
    row[2, 0] = 0.1  # floor(log2 0.1) = -4 -> X = -6; 0.1 * 64 = 6.4 -> 6
    # row 3 all zero -> X = -127 (byte 0)
    blocks, scales = quantize_mxfp4(row)
    assert scales[:, 0].tolist() == [127, 127, 121, 0]
    codes = unpack_nibbles(blocks)
    assert codes[0, 0, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert codes[1, 0, :2].tolist() == [7, 10]
    assert codes[3].eq(0).all()
    back = dequantize_mxfp4(blocks, scales)
    assert back[0].tolist() == row[0].tolist()
    assert back[1, 0] == 6.0 and back[2, 0] == 6 / 64
    bad = row.clone()
    bad[2, 5] = math.nan
    assert quantize_mxfp4(bad)[1][2, 0] == 255


def test_mxfp4_roundtrip_error_bound():
    torch.manual_seed(2)
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None]
    blocks, scales = quantize_mxfp4(w)
    back = dequantize_mxfp4(blocks, scales)
    step = decode_e8m0(scales).repeat_interleave(32, dim=1)  # 2^X per element
    # grid spacing is <= 2 * 2^X on [4, 6]; saturation from < 8 to 6 is < 2 * 2^X
    assert ((back - w).abs() <= 2 * step).all()
    # exactly representable values round-trip
    k = 2.0 ** torch.randint(-5, 5, (8, 2, 1)).float()  # one exponent per block
    exact = decode_e2m1(torch.randint(0, 16, (8, 2, 32))) * k
    exact[:, :, 0] = -6.0 * k[:, :, 0]  # amax of every block is 6 * 2^k
    exact = exact.reshape(8, 64)
    b2, s2 = quantize_mxfp4(exact)
    # X = floor(log2(6 * 2^k)) - 2 = k, so every value is on its block's grid
    assert torch.equal(dequantize_mxfp4(b2, s2), exact)


# ---- block fp8 ----------------------------------------------------------------


def block_fp8_reference(weight: torch.Tensor, scale: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    out = torch.empty(weight.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = weight[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]
            out[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = blk.float() * scale[i, j]
    return out


def block_fp8_encode_reference(w: torch.Tensor, bo: int, bi: int) -> tuple[torch.Tensor, torch.Tensor]:
    nbo, nbi = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(nbo, nbi)
    for i in range(nbo):
        for j in range(nbi):
            blk = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]
            s[i, j] = blk.abs().max() / 448.0
            q[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = (
                (blk / s[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
            )
    return q, s


@pytest.mark.parametrize(
    "shape,block", [((300, 200), (128, 128)), ((130, 257), (64, 128)), ((256, 256), (128, 128))]
)
def test_block_fp8_dequant_ragged_vs_loop(shape, block):
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    nbo, nbi = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    scale = torch.rand(nbo, nbi, generator=g) * 1e-2 + 1e-4
    want = block_fp8_reference(weight, scale, *block)
    torch.testing.assert_close(dequantize_fp8_block(weight, scale, block), want, rtol=0, atol=0)
    buf = torch.empty(shape)
    assert dequantize_fp8_block(weight.view(torch.uint8), scale, block, out=buf) is buf
    torch.testing.assert_close(buf, want, rtol=0, atol=0)


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((130, 257), (64, 128))])
def test_block_fp8_encode_vs_loop_and_error_bound(shape, block):
    torch.manual_seed(4)
    w = torch.randn(shape) * 0.05
    w[:64, :64] = 0.0  # an all-zero block (scale 0) in the first block row
    q, s = quantize_fp8_block(w, block)
    q_ref, s_ref = block_fp8_encode_reference(w, *block)
    assert s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    nz = s_ref.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]] > 0
    assert torch.equal(q.view(torch.uint8)[nz], q_ref.view(torch.uint8)[nz])
    back = dequantize_fp8_block(q, s, block)
    full = s.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    # e4m3: relative half-ulp 2^-4 for normals, absolute 2^-10 * scale for subnormals
    assert ((back - w).abs() <= w.abs() * 2**-4 + full * 2**-10 + 1e-12).all()
    assert back[:64, :64].eq(0).all()


# ---- compressed-tensors fp8 -----------------------------------------------------


@pytest.mark.parametrize("strategy,scale_shape", [("tensor", (1,)), ("channel", (40, 1))])
def test_fp8_channel_roundtrip(strategy, scale_shape):
    torch.manual_seed(5)
    w = torch.randn(40, 96) * torch.logspace(-2, 0, 40)[:, None]
    q, s = quantize_fp8_channel(w, strategy)
    assert tuple(s.shape) == scale_shape and q.dtype == torch.float8_e4m3fn
    assert torch.isclose(
        q.float().abs().amax(dim=1 if strategy == "channel" else None), torch.tensor(E4M3_MAX)
    ).all()
    back = dequantize_fp8_channel(q, s)
    torch.testing.assert_close(back, q.float() * s, rtol=0, atol=0)
    assert ((back - w).abs() <= w.abs() * 2**-4 + s * 2**-10).all()
    scalar = dequantize_fp8_channel(q, s.reshape(()) if strategy == "tensor" else s)
    torch.testing.assert_close(scalar, back, rtol=0, atol=0)


# ---- int8 / int4 ----------------------------------------------------------------


def test_int8_hand_values():
    w = torch.tensor([[127.0, -63.5, 0.0, 1.2, 2.0, -4.0]])
    q, s = quantize_int8(w, group=4)  # groups [0:4], [4:6] (ragged)
    assert s.tolist() == [[1.0, (torch.tensor(4.0) / 127).item()]]
    assert q.tolist() == [[127, -64, 0, 1, 64, -127]]  # -63.5 ties to even
    torch.testing.assert_close(
        dequantize_int8(q, s, 4), torch.tensor([[127.0, -64, 0, 1, 64 * s[0, 1].item(), -4]])
    )


@pytest.mark.parametrize("shape,group", [((32, 300), 128), ((16, 256), 128), ((8, 64), 32)])
def test_int8_roundtrip_bound_and_loop_reference(shape, group):
    torch.manual_seed(6)
    w = torch.randn(shape) * 0.02
    q, s = quantize_int8(w, group)
    assert q.dtype == torch.int8 and s.shape == (shape[0], -(-shape[1] // group))
    back = dequantize_int8(q, s, group)
    full = s.repeat_interleave(group, 1)[:, : shape[1]]
    assert ((back - w).abs() <= full / 2 * (1 + 1e-5)).all()
    for j in range(s.shape[1]):
        cols = slice(j * group, (j + 1) * group)
        torch.testing.assert_close(s[:, j], w[:, cols].abs().amax(dim=1) / 127)
        torch.testing.assert_close(back[:, cols], q[:, cols].float() * s[:, j : j + 1], rtol=0, atol=0)


def test_int4_hand_values():
    w = torch.tensor([[-1.0, 0.0, 2.0, 0.6, 3.0, 1.5]])
    q, s, z = quantize_int4(w, group=4)
    # group 0: range [-1, 2], scale 0.2, zero 5, q = [0, 5, 15, 8]
    # group 1 (ragged, 2 values): range [0, 3], scale 0.2, zero 0, q = [15, 8 (7.5 -> 8)]
    torch.testing.assert_close(s, torch.tensor([[0.2, 0.2]]))
    assert z.tolist() == [[5, 0]] and z.dtype == torch.uint8
    assert unpack_nibbles(q).tolist() == [[0, 5, 15, 8, 15, 8]]
    assert q.tolist() == [[0x50, 0x8F, 0x8F]]
    torch.testing.assert_close(dequantize_int4(q, s, z, 4), torch.tensor([[-1.0, 0.0, 2.0, 0.6, 3.0, 1.6]]))


@pytest.mark.parametrize("shape,group", [((32, 300), 128), ((16, 256), 64), ((8, 66), 32)])
def test_int4_roundtrip_bound(shape, group):
    torch.manual_seed(7)
    w = torch.randn(shape) * 0.02 + 0.01  # skewed groups
    w[0, :group] = w[0, :group].abs()  # a one-sign group
    w[1, :group] = 0.0  # an all-zero group
    q, s, z = quantize_int4(w, group)
    back = dequantize_int4(q, s, z, group)
    full = s.repeat_interleave(group, 1)[:, : shape[1]]
    assert ((back - w).abs() <= full / 2 * (1 + 1e-5) + 1e-7).all()
    assert back[1, :group].eq(0).all()
    assert int(z.max()) <= 15 and int(unpack_nibbles(q).max()) <= 15


def test_int4_rejects_odd_input_dim():
    with pytest.raises(ValueError, match="even"):
        quantize_int4(torch.zeros(2, 5), 4)
