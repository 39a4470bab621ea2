"""Pack / unpack 4-bit codes two per byte along the last dimension.

Invariant (OCP MX and GPT-OSS order): element 2j goes to the LOW nibble of
byte j, element 2j+1 to the HIGH nibble. Shapes: codes [..., 2n] <-> bytes [..., n].
"""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes: integer tensor [..., 2n] with values 0..15 -> uint8 [..., n]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {list(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> uint8 codes [..., 2n] with values 0..15."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_nibbles expects uint8 bytes, got {packed.dtype}")
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out
