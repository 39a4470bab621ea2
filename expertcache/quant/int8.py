"""int8 weights, symmetric, group-wise along the input dim (round to nearest).

Shape legend (one weight matrix, group size G, ragged last group allowed):
    weight  int8    [out, in]             q in [-127, 127] (-128 unused)
    scale   float32 [out, ceil(in/G)]     scale = amax(|group|) / 127

dequant: w[o, i] = q[o, i] * scale[o, i // G]. Max abs error <= scale / 2.

Why symmetric: with 255 levels the grid is already fine, so a zero point buys
little accuracy, while symmetric keeps the dequantised matmul a plain
x @ (q * s)^T with no zero term; it is also what int8 weight-only formats
(compressed-tensors W8A16, vLLM) use. Scales are float32 rather than fp16 so
that stored scale == encoding scale exactly and the error bound holds without
fp16 rounding or underflow caveats; the overhead is 4 bytes per G weights.
"""

from __future__ import annotations

import torch

from .groups import apply_groups_, expand_groups, grouped_view

INT8_QMAX = 127


def quantize_int8(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (weight int8 [out, in], scale float32 [out, ceil(in/G)])."""
    x = w.to(torch.float32)
    scale = grouped_view(x.abs(), group).amax(dim=-1) / INT8_QMAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(x / expand_groups(safe, group, x.shape[1])).clamp_(-INT8_QMAX, INT8_QMAX)
    return q.to(torch.int8), scale


def dequantize_int8(
    weight: torch.Tensor, scale: torch.Tensor, group: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(weight int8 [out, in], scale [out, ceil(in/G)]) -> float32 [out, in], into `out` if given."""
    if out is None:
        out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    out.copy_(weight)
    return apply_groups_(out, scale, group)
