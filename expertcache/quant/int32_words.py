"""Integer codes packed into int32 words, as GPTQ, AWQ and compressed-tensors ship them.

A word holds 32/b codes of b bits (b = 4 or 8): code i of a word sits at bits [i*b, (i+1)*b), so
the first code is in the lowest bits. AWQ's 4-bit words hold their 8 columns interleaved: the code
at position i is column AWQ_ORDER[i] of the word's 8.

Shapes: words [..., m, ...] with `dim` of length m <-> codes with that dim m * 32/b long.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def codes_per_word(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"packed int32 words hold 4- or 8-bit codes, got bits={bits}")
    return 32 // bits


def unpack_int32(
    words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """int32 words -> uint8 codes, each word's codes laid out along `dim` (first code first; with
    `order`, position i of a word holding element order[i] of its group)."""
    if words.dtype != torch.int32:
        raise ValueError(f"expected int32 words, got {words.dtype}")
    codes_per_word(bits)  # refuses a width that does not divide 32
    w = words.movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=w.device)
    codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., m, per]; the mask drops sign bits
    if order is not None:
        codes = codes[
            ..., torch.argsort(torch.tensor(order, device=w.device))
        ]  # element c sits at position order.index(c)
    return codes.to(torch.uint8).flatten(-2).movedim(-1, dim)
