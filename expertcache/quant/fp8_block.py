"""Block-scaled float8, as DeepSeek-V3 / Qwen3-FP8 checkpoints ship it.

Shape legend (one weight matrix, block size (Bo, Bi), usually (128, 128) from
the config's `weight_block_size`):
    weight  float8_e4m3fn [out, in]
    scale   float32       [ceil(out/Bo), ceil(in/Bi)]   (checkpoint name: weight_scale_inv)

dequant: w[o, i] = float(weight[o, i]) * scale[o // Bo, i // Bi]. Ragged edge
blocks (dims not multiples of the block) are partial blocks with their own scale.
Despite the checkpoint name `weight_scale_inv`, the stored value is the
multiplier (amax / 448), not its reciprocal.

Encoding: scale = amax(|block|) / 448 (0 for an all-zero block), values
w / scale saturated to +-448 and rounded to nearest-even e4m3fn.
"""

from __future__ import annotations

import torch

from .fp8 import E4M3_MAX, decode_e4m3fn, encode_e4m3fn
from .groups import apply_groups_, num_groups

BlockSize = tuple[int, int]


def as_block_size(block: int | tuple[int, int] | list[int]) -> BlockSize:
    """Normalise 128 or [128, 128] (config `weight_block_size`) to (Bo, Bi)."""
    b = (int(block), int(block)) if isinstance(block, int) else tuple(int(v) for v in block)
    if len(b) != 2 or min(b) < 1:
        raise ValueError(f"fp8 block size must be a positive int or [rows, cols], got {block!r}")
    return b  # type: ignore[return-value]


def block_scale_shape(shape: tuple[int, int], block: BlockSize) -> tuple[int, int]:
    """[ceil(out/Bo), ceil(in/Bi)] for a weight of `shape`."""
    return num_groups(shape[0], block[0]), num_groups(shape[1], block[1])


def quantize_fp8_block(w: torch.Tensor, block: BlockSize) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (weight float8_e4m3fn [out, in], scale float32 [ceil(out/Bo), ceil(in/Bi)])."""
    out_f, in_f = w.shape
    bo, bi = block
    nbo, nbi = block_scale_shape((out_f, in_f), block)
    x = w.to(torch.float32)
    # Zero padding to whole blocks does not change any block's amax.
    padded = torch.nn.functional.pad(x.abs(), (0, nbi * bi - in_f, 0, nbo * bo - out_f))
    amax = padded.view(nbo, bo, nbi, bi).amax(dim=(1, 3))
    scale = amax / E4M3_MAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    full = safe.repeat_interleave(bo, dim=0)[:out_f].repeat_interleave(bi, dim=1)[:, :in_f]
    return encode_e4m3fn(x / full), scale


def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, block: BlockSize, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(weight e4m3fn [out, in], scale [ceil(out/Bo), ceil(in/Bi)]) -> float32 [out, in].

    Shapes must already agree (the quant method validates and names tensors);
    writes into `out` (float32 [out, in]) when given.
    """
    out_f, in_f = weight.shape
    if out is None:
        out = torch.empty(out_f, in_f, dtype=torch.float32, device=weight.device)
    decode_e4m3fn(weight, out)  # table lookup on CPU: several times faster than torch's fp8 cast
    # Row blocks -> per-row scales [out, nbi] (small), then column groups in place.
    row_scale = scale.to(torch.float32).repeat_interleave(block[0], dim=0)[:out_f]
    return apply_groups_(out, row_scale, block[1])
