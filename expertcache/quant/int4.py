"""int4 weights, asymmetric with integer zero points, group-wise along the input dim.

Shape legend (one weight matrix, group size G, ragged last group allowed, in even):
    weight  uint8   [out, in/2]           codes q in [0, 15], two per byte, low nibble first
    scale   float32 [out, ceil(in/G)]     scale = (max(g, 0) - min(g, 0)) / 15
    zero    uint8   [out, ceil(in/G)]     zero = round(-min(g, 0) / scale), in [0, 15]

dequant: w[o, i] = (q[o, i] - zero[o, i // G]) * scale[o, i // G].
Max abs error <= scale / 2 (the range includes 0, so zero is in [0, 15] and
w/scale + zero lies in [-0.5, 15.5] before rounding and clamping).

Why asymmetric (GPTQ / AWQ style): with only 16 levels a symmetric grid wastes
a level and half its range on groups whose weights are skewed to one sign; an
integer zero point uses all 16 levels over [min, max] and costs one byte per
group. Integer (not float) zeros keep the format what int4 GPU kernels expect.
The range is widened to include 0 so that 0 is exact and the zero point never
needs clamping.
"""

from __future__ import annotations

import torch

from .groups import apply_groups_, expand_groups, grouped_view
from .nibbles import pack_nibbles, unpack_nibbles

INT4_QMAX = 15


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [out, in] -> (weight uint8 [out, in/2], scale float32 [out, ng], zero uint8 [out, ng])."""
    if w.shape[1] % 2:
        raise ValueError(f"int4 packs two values per byte: input dim must be even, got {list(w.shape)}")
    x = w.to(torch.float32)
    g = grouped_view(x, group)  # zero padding does not move min(., 0) / max(., 0)
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    scale = (hi - lo) / INT4_QMAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = torch.round(-lo / safe).clamp_(0, INT4_QMAX)
    n = x.shape[1]
    q = torch.round(x / expand_groups(safe, group, n)).add_(expand_groups(zero, group, n))
    return pack_nibbles(q.clamp_(0, INT4_QMAX)), scale, zero.to(torch.uint8)


def dequantize_int4(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(weight uint8 [out, in/2], scale [out, ng], zero [out, ng]) -> float32 [out, in], into `out` if given."""
    rows, half = weight.shape
    if out is None:
        out = torch.empty(rows, half * 2, dtype=torch.float32, device=weight.device)
    out.copy_(unpack_nibbles(weight))
    return apply_groups_(out, scale, group, zero)
