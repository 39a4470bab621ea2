"""A slot pool's parts in the Triton MoE kernels' terms: per projection, codes and scales addressed by strides.

Shape legend: S slots, I moe intermediate, H hidden; parts as experts/layout.py and quant/method.py name
them: plain gate_up [S, 2I, H] / down [S, H, I] ([S, H, 2I] / [S, I, H] when ffn.transposed), quantized
"<gate|up|down>.<suffix>" [S, out, ...] (or "gate_up.<suffix>" when ffn.fused_quant). Gate and up are
views of a fused tensor (halves or interleaved rows), never copies; a scale is indexed by
(row // s_block[0], col // s_block[1]) with stride 0 on a broadcast dimension.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .triton_moe_jit import FLOAT, FP8, INT4, INT8, MXFP4


class Proj(NamedTuple):
    """One projection's stored tensors in the kernels' terms: codes w [S, ...] with element strides to
    (slot, out row, in column or packed byte); scale (and int4 zero) indexed by (row // s_bn, col // s_bk)."""

    w: torch.Tensor
    w_strides: tuple[int, int, int]
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    s_strides: tuple[int, int, int] = (0, 0, 0)
    s_block: tuple[int, int] = (1, 1)


# quant format name -> (FMT, code suffix, scale suffix, zero suffix)
QUANT_FORMATS = {
    "bf16": (FLOAT, "weight", None, None),
    "fp16": (FLOAT, "weight", None, None),
    "fp32": (FLOAT, "weight", None, None),
    "fp8": (FP8, "weight", "weight_scale", None),
    "fp8-channel": (FP8, "weight", "weight_scale", None),
    "fp8-tensor": (FP8, "weight", "weight_scale", None),
    "int8": (INT8, "weight", "weight_scale", None),
    "int4": (INT4, "weight", "weight_scale", "weight_zero"),
    "mxfp4": (MXFP4, "weight_blocks", "weight_scales", None),
}


def supported(method) -> str | None:
    """Why the kernels cannot compute experts stored by `method` (a QuantMethod or None), or None."""
    if method is not None and method.name not in QUANT_FORMATS:
        return (
            f"no Triton MoE kernel for the {method.name!r} expert format (have: {', '.join(QUANT_FORMATS)})"
        )
    return None


def _scale_block(method) -> tuple[int, int]:
    name = method.name
    if name == "fp8":
        return tuple(method.block)
    if name in ("int8", "int4"):
        return 1, method.group
    return (1, 32) if name == "mxfp4" else (1, 1)


def _strides(t: torch.Tensor, out_dim: int = 1, in_dim: int = 2) -> tuple[int, int, int]:
    """(slot, out, in) element strides; a missing or size-1 dimension reads stride 0 (broadcast)."""

    def at(d):
        return t.stride(d) if t.dim() > d and t.shape[d] > 1 else 0

    return t.stride(0), at(out_dim), at(in_dim)


def _rows(t: torch.Tensor, which: int, interleaved: bool, dim: int = 1) -> torch.Tensor:
    """Gate (which 0) or up (1) rows of a fused gate_up tensor along `dim`: halves or alternate rows (a view)."""
    n = t.shape[dim]
    rows = slice(which, None, 2) if interleaved else slice(which * n // 2, (which + 1) * n // 2)
    return t[(slice(None),) * dim + (rows,)]


def _quant_proj(pool, prefix: str, method, which: int | None, interleaved: bool) -> Proj:
    fmt, code, scale_sfx, zero_sfx = QUANT_FORMATS[method.name]
    w = pool[f"{prefix}.{code}"]
    if w.dtype == torch.float8_e4m3fn:
        w = w.view(torch.uint8)
    if fmt == MXFP4:  # [S, out, in/32, 16] -> bytes along the row
        if w.stride(2) != 16 * w.stride(3):
            raise ValueError(
                f"{prefix}.{code}: mxfp4 blocks must be contiguous within a row for the Triton kernel"
            )
        w = w.as_strided(w.shape[:2] + (w.shape[2] * 16,), (w.stride(0), w.stride(1), w.stride(3)))
    scale = pool.get(f"{prefix}.{scale_sfx}") if scale_sfx else None
    zero = pool.get(f"{prefix}.{zero_sfx}") if zero_sfx else None
    if scale is not None and scale.dim() == 1:
        scale = scale.unsqueeze(1)  # per-tensor [S] -> [S, 1]
    block = _scale_block(method)
    if which is not None:  # a fused gate_up part: this projection's rows
        if block[0] > 1 and (interleaved or (w.shape[1] // 2) % block[0]):
            raise ValueError(
                f"{prefix}.{code}: block-scaled gate_up rows cannot be split into gate and up for the "
                f"Triton kernel (block rows {block[0]})"
            )
        w = _rows(w, which, interleaved)
        if scale is not None and scale.dim() > 2 and scale.shape[1] > 1:
            scale = _rows(scale, which, interleaved)
        if zero is not None:
            zero = _rows(zero, which, interleaved)
    if scale is not None and zero is not None and _strides(zero) != _strides(scale):
        raise ValueError(f"{prefix}.{zero_sfx}: zero points must be laid out like {prefix}.{scale_sfx}")
    return Proj(w, _strides(w), scale, zero, _strides(scale) if scale is not None else (0, 0, 0), block)


def projections(pool: dict[str, torch.Tensor], method, ffn) -> tuple[int, int, Proj, Proj, Proj]:
    """A pool -> (FMT, I, gate, up, down) in the kernels' terms (views, no copies)."""
    fmt, g, u, d = _projections(pool, method, ffn)
    if (g.w_strides, g.s_strides) != (u.w_strides, u.s_strides):
        raise ValueError(
            "gate and up expert weights are laid out differently in the slot pool; the Triton kernel "
            "reads both with one set of strides"
        )
    transposed = method is None and ffn is not None and ffn.transposed
    return fmt, g.w.shape[2 if transposed else 1], g, u, d


def _projections(pool, method, ffn) -> tuple[int, Proj, Proj, Proj]:
    interleaved = bool(ffn is not None and ffn.interleaved)
    if method is None:
        gu, dn = pool["gate_up"], pool["down"]
        transposed = bool(ffn is not None and ffn.transposed)
        o, i = (2, 1) if transposed else (1, 2)  # the out and in dimensions
        g, u = (_rows(gu, which, interleaved, dim=o) for which in (0, 1))
        return FLOAT, Proj(g, _strides(g, o, i)), Proj(u, _strides(u, o, i)), Proj(dn, _strides(dn, o, i))
    why = supported(method)
    if why:
        raise ValueError(why)
    fmt = QUANT_FORMATS[method.name][0]
    if ffn is not None and ffn.fused_quant:
        g, u = (_quant_proj(pool, "gate_up", method, which, interleaved) for which in (0, 1))
    else:
        g, u = (_quant_proj(pool, p, method, None, False) for p in ("gate", "up"))
    return fmt, g, u, _quant_proj(pool, "down", method, None, False)


def biases(pool: dict[str, torch.Tensor], ffn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(gate bias [S, I], up bias [S, I], down bias [S, H]) as views, or None: the experts have no biases."""
    gb = pool.get("gate_up_bias")
    if gb is None:
        return None
    interleaved = bool(ffn is not None and ffn.interleaved)
    return _rows(gb, 0, interleaved), _rows(gb, 1, interleaved), pool["down_bias"]
