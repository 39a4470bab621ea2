"""MXFP4: blocks of 32 e2m1 values along the input dim sharing one e8m0 scale.

Shape legend (one weight matrix, GPT-OSS checkpoint layout):
    weight  float32 [out, in]            in % 32 == 0
    blocks  uint8   [out, in/32, 16]     two e2m1 codes per byte, low nibble first
    scales  uint8   [out, in/32]         e8m0, value 2^(s-127); 0xFF = NaN

value[o, 32*g + 2*j]     = e2m1(blocks[o, g, j] & 0xF) * 2^(scales[o, g] - 127)
value[o, 32*g + 2*j + 1] = e2m1(blocks[o, g, j] >> 4)  * 2^(scales[o, g] - 127)

Encoding (OCP MX v1.0 section 6.3): shared exponent X = floor(log2(amax)) - 2
(2 = emax of e2m1), clamped to [-127, 127]; elements are x / 2^X rounded to
nearest-even on the e2m1 grid and saturated to +-6. An all-zero block gets
X = -127 (byte 0); a block holding NaN or inf gets the NaN scale 0xFF.
"""

from __future__ import annotations

import torch

from .fp4 import E8M0_NAN, decode_e2m1, decode_e8m0, encode_e2m1, encode_e8m0
from .nibbles import pack_nibbles, unpack_nibbles

MX_BLOCK = 32
"""Elements per MX block (fixed by the spec)."""


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (blocks uint8 [out, in/32, 16], scales uint8 [out, in/32])."""
    if w.dim() != 2 or w.shape[1] % MX_BLOCK:
        raise ValueError(
            f"mxfp4 needs a 2-D weight whose input dim is a multiple of {MX_BLOCK}, got {list(w.shape)}"
        )
    out_f, in_f = w.shape
    x = w.to(torch.float32).reshape(out_f, in_f // MX_BLOCK, MX_BLOCK)
    amax = x.abs().amax(dim=-1)
    # frexp: amax = m * 2^k with m in [0.5, 1) -> floor(log2(amax)) = k - 1, exactly.
    _, k = torch.frexp(amax)
    exp = (k.to(torch.int32) - 1 - 2).clamp(-127, 127)
    exp = torch.where(amax == 0, torch.full_like(exp, -127), exp)
    scales = encode_e8m0(exp)
    bad = ~torch.isfinite(amax)
    scales = torch.where(bad, torch.full_like(scales, E8M0_NAN), scales)
    # x * 2^-X is exact (power of two), then round to the e2m1 grid.
    scaled = x * decode_e8m0(encode_e8m0(-exp)).unsqueeze(-1)
    codes = encode_e2m1(torch.where(bad.unsqueeze(-1), torch.zeros_like(scaled), scaled))
    return pack_nibbles(codes), scales


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(blocks uint8 [out, G, 16], scales uint8 [out, G]) -> float32 [out, 32*G].

    Writes into `out` (float32 [out, 32*G], contiguous) when given. Exact: every
    value is an e2m1 value times a power of two, representable in float32.
    """
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[-1] != MX_BLOCK // 2:
        raise ValueError(
            f"mxfp4 blocks must be uint8 [out, in/32, 16], got {blocks.dtype} {list(blocks.shape)}"
        )
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:2]):
        raise ValueError(
            f"mxfp4 scales must be uint8 {list(blocks.shape[:2])} to match blocks {list(blocks.shape)}, "
            f"got {scales.dtype} {list(scales.shape)}"
        )
    out_f, groups, _ = blocks.shape
    if out is None:
        out = torch.empty(out_f, groups * MX_BLOCK, dtype=torch.float32, device=blocks.device)
    elif out.shape != (out_f, groups * MX_BLOCK) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(
            f"out buffer must be contiguous float32 {[out_f, groups * MX_BLOCK]}, got {out.dtype} {list(out.shape)}"
        )
    view = out.view(out_f, groups, MX_BLOCK)
    # one table lookup per byte decodes both nibbles (low first): [.., 16] bytes -> [.., 16, 2] values
    pairs = torch.index_select(_PAIR_TABLE.to(blocks.device), 0, blocks.reshape(-1).int())
    torch.mul(pairs.view(out_f, groups, MX_BLOCK), decode_e8m0(scales).unsqueeze(-1), out=view)
    return out


_PAIR_TABLE = decode_e2m1(
    unpack_nibbles(torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None])
)  # [256, 2]
