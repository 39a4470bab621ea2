"""ggml's block formats decoded in vectorised torch: blocks uint8 [N, block_bytes] -> float32 [N, block].

Written from ggml's block definitions (ggml-common.h) and reference dequantisers (ggml-quants.c);
every product is taken in the reference's order, so the float32 values are the reference's.
    Q8_0   d f16 | qs i8[32]                        x = d * q
    Q4_0   d f16 | qs[16]                           x[j] = d * (lo(qs[j]) - 8), x[j+16] = d * (hi(qs[j]) - 8)
    Q5_0   d f16 | qh u32 | qs[16]                  as Q4_0 with bit j of qh above element j's nibble, - 16
    IQ4_NL d f16 | qs[16]                           x = d * KV_IQ4[nibble] (Q4_0's element order)
    IQ4_XS d f16 | scales_h u16 | scales_l[4] | qs[128]   8 sub-blocks of 32: d * (6-bit scale - 32) * KV_IQ4
    MXFP4  e e8m0 | qs[16]                          x = KV_MXFP4[nibble] * 2^(e-128) (Q4_0's order)
    Q4_K   d f16 | dmin f16 | scales[12] | qs[128]  8 sub-blocks of 32 (6-bit scale, 6-bit min):
                                                    x = d*sc * q - dmin*m; chunk c of 32 bytes: low
                                                    nibbles = sub-block 2c, high nibbles = 2c+1
    Q5_K   d | dmin | scales[12] | qh[32] | qs[128] Q4_K plus bit k of qh[l] above sub-block k's element l
    Q6_K   ql[128] | qh[64] | scales i8[16] | d f16 16 groups of 16: x = d*sc * (6-bit q - 32)
    Q4_1 / Q5_1   d f16 | m f16 | (qh u32 |) qs[16]   x = d * q + m
    Q2_K   scales[16] | qs[64] | d | dmin           16 groups of 16: x = d*(sc & 15) * q2 - dmin*(sc >> 4)
    Q3_K   hmask[32] | qs[64] | scales[12] | d      16 groups of 16: x = d*(6-bit sc - 32) * (q2 - 4 if hmask bit clear)
  (Q4_1, Q5_1, Q2_K, Q3_K have no QuantMethod: dense tensors of those types are dequantized at load)

ggml tensor types (ids of ggml.h `enum ggml_type`; the retired 4 and 5 and the repacked 31-33 have
none): a row of n elements (ggml dim 0) of type T is n / T.block consecutive blocks of T.block_bytes.
`METHODS`: the types whose weights stay in their stored bytes (quant/ggml.py's QuantMethods);
`FLOATS`: read as that torch dtype; any other type is dequantised at load, or refused.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KV_IQ4 = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KV_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 x 2 (the scale is halved)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[N, 2] bytes -> float32 [N, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, ..., 16] -> [N, ..., 32] int32: the low nibbles, then the high ones."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1).int()


def _lookup(table: tuple, idx: torch.Tensor) -> torch.Tensor:
    return torch.tensor(table, dtype=torch.float32, device=idx.device)[idx.long()]


def q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, 0:2]) * b[:, 2:34].contiguous().view(torch.int8).float()


def q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, 0:2]) * (_nibbles(b[:, 2:18]) - 8).float()


def q5_0(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 2:6].long()
    qh = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24
    high = (qh[:, None] >> torch.arange(32, device=b.device)) & 1
    return _f16(b[:, 0:2]) * ((_nibbles(b[:, 6:22]) | (high.int() << 4)) - 16).float()


def iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, 0:2]) * _lookup(KV_IQ4, _nibbles(b[:, 2:18]))


def iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    sh = b[:, 2].int() | b[:, 3].int() << 8
    ib = torch.arange(8, device=b.device)
    lo = (b[:, 4:8].int().repeat_interleave(2, dim=1) >> (4 * (ib % 2))) & 0xF
    ls = lo | (((sh[:, None] >> (2 * ib)) & 3) << 4)
    dl = d * (ls - 32).float()  # [N, 8]
    vals = _lookup(KV_IQ4, _nibbles(b[:, 8:136].reshape(n, 8, 16)))  # [N, 8, 32]
    return (dl[:, :, None] * vals).reshape(n, 256)


def mxfp4(b: torch.Tensor) -> torch.Tensor:
    e = b[:, 0:1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)  # 2^(e-128), subnormal below e = 2
    return _lookup(KV_MXFP4, _nibbles(b[:, 1:17])) * bits.view(torch.float32)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of Q4_K / Q5_K -> (scales, mins) int32 [N, 8] (6 bits each)."""
    s = s.int()
    s0, s1, s2 = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((s0 & 63, (s2 & 0xF) | ((s0 >> 6) << 4)), dim=1)
    m = torch.cat((s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)), dim=1)
    return sc, m


def _k_quant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: q int32 [N, 8, 32] codes -> values [N, 256]."""
    sc, m = _k_scales(b[:, 4:16])
    d = _f16(b[:, 0:2]) * sc.float()
    dm = _f16(b[:, 2:4]) * m.float()
    return (d[:, :, None] * q.float() - dm[:, :, None]).reshape(b.shape[0], 256)


def _k_codes(qs: torch.Tensor) -> torch.Tensor:
    """[N, 128] -> [N, 8, 32]: chunk c's low nibbles are sub-block 2c, its high nibbles 2c+1."""
    qs = qs.reshape(qs.shape[0], 4, 1, 32)
    return torch.cat((qs & 0xF, qs >> 4), dim=2).reshape(qs.shape[0], 8, 32).int()


def q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_quant(b, _k_codes(b[:, 16:144]))


def q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48].int()
    high = (qh[:, None, :] >> torch.arange(8, device=b.device)[None, :, None]) & 1  # [N, 8, 32]
    return _k_quant(b, _k_codes(b[:, 48:176]) | (high << 4))


def q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half, ql[0:32] | ql[32:64], l]
    nib = torch.cat((ql & 0xF, ql >> 4), dim=2).int()  # [N, 2, 4, 32]: k = 0..3
    qh = b[:, 128:192].reshape(n, 2, 1, 32).int()
    high = (qh >> (2 * torch.arange(4, device=b.device))[None, None, :, None]) & 3
    q = ((nib | (high << 4)) - 32).reshape(n, 16, 16).float()
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210]) * sc  # [N, 16]
    return (d[:, :, None] * q).reshape(n, 256)


def q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, 0:2]) * _nibbles(b[:, 4:20]).float() + _f16(b[:, 2:4])


def q5_1(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 4:8].long()
    qh = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24
    high = (qh[:, None] >> torch.arange(32, device=b.device)) & 1
    return _f16(b[:, 0:2]) * (_nibbles(b[:, 8:24]) | (high.int() << 4)).float() + _f16(b[:, 2:4])


def q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = b[:, 0:16].int()
    dl = _f16(b[:, 80:82]) * (sc & 0xF).float()  # [N, 16]: one scale and min per 16 elements
    ml = _f16(b[:, 82:84]) * (sc >> 4).float()
    qs = b[:, 16:80].reshape(n, 2, 1, 32).int()
    q = ((qs >> (2 * torch.arange(4, device=b.device))[None, None, :, None]) & 3).reshape(n, 16, 16).float()
    return (dl[:, :, None] * q - ml[:, :, None]).reshape(n, 256)


def q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    s = b[:, 96:108].int()
    low = (s[:, None, 0:8] >> (4 * torch.arange(2, device=b.device))[None, :, None]).reshape(n, 16) & 0xF
    high = (s[:, None, 8:12] >> (2 * torch.arange(4, device=b.device))[None, :, None]).reshape(n, 16) & 3
    dl = _f16(b[:, 108:110]) * ((low | (high << 4)) - 32).float()  # [N, 16]
    qs = b[:, 32:96].reshape(n, 2, 1, 32).int()
    ql = ((qs >> (2 * torch.arange(4, device=b.device))[None, None, :, None]) & 3).reshape(n, 16, 16)
    hm = b[:, 0:32].reshape(n, 1, 1, 32).int()
    qh = (((hm >> torch.arange(8, device=b.device)[None, None, :, None]) & 1) ^ 1).reshape(n, 16, 16)
    return (dl[:, :, None] * (ql - (qh << 2)).float()).reshape(n, 256)


def q3_k_as_q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks [N, 110] -> Q6_K blocks [N, 210] of the same values, exactly: both are 16 groups of 16
    consecutive elements, x = (d * sc) * q; Q3_K's 6-bit sc - 32 is Q6_K's int8 sc, its q in -4..3 is
    Q6_K's 6-bit code - 32, d the same f16 (so ggml's products, and their float32 roundings, are equal)."""
    n = b.shape[0]
    s = b[:, 96:108].int()
    low = (s[:, None, 0:8] >> (4 * torch.arange(2, device=b.device))[None, :, None]).reshape(n, 16) & 0xF
    high = (s[:, None, 8:12] >> (2 * torch.arange(4, device=b.device))[None, :, None]).reshape(n, 16) & 3
    sc = (low | (high << 4)) - 32  # [N, 16]
    qs = b[:, 32:96].reshape(n, 2, 1, 32).int()
    ql = ((qs >> (2 * torch.arange(4, device=b.device))[None, None, :, None]) & 3).reshape(n, 16, 16)
    hm = b[:, 0:32].reshape(n, 1, 1, 32).int()
    qh = (((hm >> torch.arange(8, device=b.device)[None, None, :, None]) & 1) ^ 1).reshape(n, 16, 16)
    q = (ql - (qh << 2) + 32).reshape(n, 2, 4, 32)  # Q6_K codes [N, half, k, l]: element 128 half + 32 k + l
    nib, hi = q & 0xF, q >> 4
    out = torch.empty((n, 210), dtype=torch.uint8, device=b.device)
    out[:, 0:128] = (nib[:, :, 0:2] | (nib[:, :, 2:4] << 4)).reshape(n, 128).to(torch.uint8)
    out[:, 128:192] = (
        (hi[:, :, 0] | hi[:, :, 1] << 2 | hi[:, :, 2] << 4 | hi[:, :, 3] << 6).reshape(n, 64).to(torch.uint8)
    )
    out[:, 192:208] = sc.to(torch.int8).view(torch.uint8)
    out[:, 208:210] = b[:, 108:110]
    return out


DECODERS = {
    "Q4_1": q4_1,
    "Q5_1": q5_1,
    "Q2_K": q2_k,
    "Q3_K": q3_k,
    "Q8_0": q8_0,
    "Q4_0": q4_0,
    "Q5_0": q5_0,
    "IQ4_NL": iq4_nl,
    "IQ4_XS": iq4_xs,
    "MXFP4": mxfp4,
    "Q4_K": q4_k,
    "Q5_K": q5_k,
    "Q6_K": q6_k,
}


class GGMLType(NamedTuple):
    name: str
    id: int
    block: int  # elements per block
    block_bytes: int

    def row_bytes(self, n: int) -> int:
        return n // self.block * self.block_bytes


_TABLE = [
    ("F32", 0, 1, 4),
    ("F16", 1, 1, 2),
    ("Q4_0", 2, 32, 18),
    ("Q4_1", 3, 32, 20),
    ("Q5_0", 6, 32, 22),
    ("Q5_1", 7, 32, 24),
    ("Q8_0", 8, 32, 34),
    ("Q8_1", 9, 32, 36),
    ("Q2_K", 10, 256, 84),
    ("Q3_K", 11, 256, 110),
    ("Q4_K", 12, 256, 144),
    ("Q5_K", 13, 256, 176),
    ("Q6_K", 14, 256, 210),
    ("Q8_K", 15, 256, 292),
    ("IQ2_XXS", 16, 256, 66),
    ("IQ2_XS", 17, 256, 74),
    ("IQ3_XXS", 18, 256, 98),
    ("IQ1_S", 19, 256, 50),
    ("IQ4_NL", 20, 32, 18),
    ("IQ3_S", 21, 256, 110),
    ("IQ2_S", 22, 256, 82),
    ("IQ4_XS", 23, 256, 136),
    ("I8", 24, 1, 1),
    ("I16", 25, 1, 2),
    ("I32", 26, 1, 4),
    ("I64", 27, 1, 8),
    ("F64", 28, 1, 8),
    ("IQ1_M", 29, 256, 56),
    ("BF16", 30, 1, 2),
    ("TQ1_0", 34, 256, 54),
    ("TQ2_0", 35, 256, 66),
    ("MXFP4", 39, 32, 17),
    ("NVFP4", 40, 64, 36),
    ("Q1_0", 41, 128, 18),
]
TYPES: dict[int, GGMLType] = {i: GGMLType(n, i, b, bb) for n, i, b, bb in _TABLE}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES.values()}

FLOATS: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}
# the types read in their stored bytes by a QuantMethod (quant/ggml.py registers "gguf-<name lower>")
METHODS = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")


def method_name(type_name: str) -> str | None:
    """The QuantMethod of a ggml type (None: no method; float, dequantised at load or refused)."""
    return f"gguf-{type_name.lower()}" if type_name in METHODS else None
