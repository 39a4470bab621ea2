"""Element and scale formats of MXFP4 (OCP Microscaling spec v1.0).

e2m1 (fp4) code, 4 bits: s ee m, bias 1. Magnitudes by code & 7:
    0 -> 0, 1 -> 0.5 (subnormal), 2 -> 1, 3 -> 1.5, 4 -> 2, 5 -> 3, 6 -> 4, 7 -> 6
code | 8 is the negative of the same magnitude (8 is -0). No inf, no NaN.

e8m0 scale, 8 bits: unsigned biased exponent, value 2^(e-127) for e in 0..254;
0xFF is NaN. There is no zero: byte 0 means 2^-127 (a float32 subnormal).
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_VALUES: tuple[float, ...] = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
"""Value of each e2m1 code 0..15."""

# Rounding |x| to the magnitude grid: code = number of thresholds passed. Each
# midpoint is passed on a tie iff the upper neighbour has the even code
# (round-half-to-even on the code, i.e. on the mantissa bit).
_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)  # ties go to the lower (even) code: 0, 2, 4, 6
_TIE_UP = (0.75, 1.75, 3.5)  # ties go to the upper (even) code: 2, 4, 6
E8M0_NAN = 0xFF
E8M0_BIAS = 127


_E2M1_TABLES: dict[torch.device, torch.Tensor] = {}


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes 0..15 (any shape, unpacked) -> float32 values (the table is built once per device)."""
    lut = _E2M1_TABLES.get(codes.device)
    if lut is None:
        lut = _E2M1_TABLES[codes.device] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 e2m1 codes 0..15, same shape, unpacked.

    Round to nearest, ties to even; magnitudes above 6 (and inf) saturate to 6.
    The sign is kept, so small negatives become -0 (code 8). NaN input has no
    e2m1 encoding: callers (mxfp4) mark such blocks through the NaN scale.
    """
    a = x.to(torch.float32).abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _TIE_DOWN:
        code += a > t
    for t in _TIE_UP:
        code += a >= t
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> float32 2^(e-127), exact; 0xFF -> NaN.

    Built from float32 bit patterns, not exp2: e in 1..254 is the normal
    float32 with that exponent field; e == 0 is the subnormal 2^-127.
    """
    if scales.dtype != torch.uint8:
        raise ValueError(f"e8m0 scales must be uint8, got {scales.dtype}")
    e = scales.to(torch.int32)
    bits = e << 23
    bits = torch.where(e == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(e == E8M0_NAN, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def encode_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Unbiased integer exponents -> uint8 e8m0 bytes, clamped to [-127, 127]
    (127 is the largest finite scale; 0xFF stays reserved for NaN)."""
    return (exponent.to(torch.int32).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
