"""float8 with a per-tensor or per-channel scale (compressed-tensors style).

Shape legend (one weight matrix):
    weight  float8_e4m3fn [out, in]
    scale   float32 []  or [1]     strategy "tensor"
            float32 [out, 1]       strategy "channel" (one scale per output row)

dequant: w = float(weight) * scale (broadcast). Encoding: scale = amax / 448
over the tensor or the row (0 when all zero), values saturated to +-448.
"""

from __future__ import annotations

import torch

from .fp8 import E4M3_MAX, decode_e4m3fn, encode_e4m3fn

STRATEGIES = ("tensor", "channel")


def channel_scale_shapes(shape: tuple[int, int], strategy: str) -> tuple[tuple[int, ...], ...]:
    """Accepted scale shapes for a weight of `shape`; the first is what we write."""
    if strategy == "tensor":
        return ((1,), ())
    if strategy == "channel":
        return ((shape[0], 1),)
    raise ValueError(f"unknown fp8 scale strategy {strategy!r}; choose one of {STRATEGIES}")


def quantize_fp8_channel(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (weight float8_e4m3fn [out, in], scale float32 [1] or [out, 1])."""
    channel_scale_shapes(tuple(w.shape), strategy)  # validates the strategy
    x = w.to(torch.float32)
    a = x.abs()
    amax = a.amax(dim=1, keepdim=True) if strategy == "channel" else a.amax().reshape(1)
    scale = amax / E4M3_MAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return encode_e4m3fn(x / safe), scale


def dequantize_fp8_channel(
    weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(weight e4m3fn [out, in], scale [] / [1] / [out, 1]) -> float32 [out, in], into `out` if given."""
    if out is None:
        out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    decode_e4m3fn(weight, out)  # table lookup on CPU: several times faster than torch's fp8 cast
    return out.mul_(scale.to(torch.float32))
