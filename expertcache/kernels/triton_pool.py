"""A slot pool's parts in the Triton MoE kernels' terms: per projection, codes and scales addressed by strides.

Shape legend: S slots, I moe intermediate, H hidden; parts as experts/layout.py and quant/method.py name
them: plain gate_up [S, 2I, H] / down [S, H, I] ([S, H, 2I] / [S, I, H] when ffn.transposed), quantized
"<gate|up|down>.<suffix>" [S, out, ...] (or "gate_up.<suffix>" when ffn.fused_quant). Gate and up are
views of a fused tensor (halves or interleaved rows), never copies; a scale is indexed by
(row // s_block[0], col // s_block[1]) with stride 0 on a broadcast dimension. GGUF parts (gguf-<type>)
are uint8 [S, out, row bytes], the file's blocks read in place (no scale part); each projection has its
own decoder (`Proj.fmt`), so gate_up and down may differ (gguf-mixed; gguf-layers: the layer's parts
"P.<type>" name them, "P.f32" a dequantized one), gate and up share one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .formats import of_parts
from .triton_moe_jit import (
    FLOAT,
    FP8,
    GGUF_MXFP4,
    INT4,
    INT8,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q4_0,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    Q8_0,
)


class Proj(NamedTuple):
    """One projection's stored tensors in the kernels' terms: codes w [S, ...] with element strides to
    (slot, out row, in column or packed byte); scale (and int4 zero) indexed by (row // s_bn, col // s_bk);
    fmt the tile decoder (the kernels' constexpr FMT)."""

    w: torch.Tensor
    w_strides: tuple[int, int, int]
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    s_strides: tuple[int, int, int] = (0, 0, 0)
    s_block: tuple[int, int] = (1, 1)
    fmt: int = FLOAT


# quant format name -> (FMT, scale suffix, zero suffix); the codes are the method's primary part ("P.weight",
# "P.weight_blocks"; "P.<type>" for GGUF types per layer). GGUF blocks carry their scales: uint8
# [S, out, row bytes], each row its blocks as in the file (quant/ggml.py), decoded in place.
QUANT_FORMATS = {
    "bf16": (FLOAT, None, None),
    "fp16": (FLOAT, None, None),
    "fp32": (FLOAT, None, None),
    "fp8": (FP8, "weight_scale", None),
    "fp8-channel": (FP8, "weight_scale", None),
    "fp8-tensor": (FP8, "weight_scale", None),
    "int8": (INT8, "weight_scale", None),
    "int4": (INT4, "weight_scale", "weight_zero"),
    "mxfp4": (MXFP4, "weight_scales", None),
    "gguf-q8_0": (Q8_0, None, None),
    "gguf-q4_0": (Q4_0, None, None),
    "gguf-q5_0": (Q5_0, None, None),
    "gguf-iq4_nl": (IQ4_NL, None, None),
    "gguf-mxfp4": (GGUF_MXFP4, None, None),
    "gguf-q4_k": (Q4_K, None, None),
    "gguf-q5_k": (Q5_K, None, None),
    "gguf-q6_k": (Q6_K, None, None),
    "gguf-iq4_xs": (IQ4_XS, None, None),
}
PROJS = ("gate", "up", "down", "gate_up")


def _per_projection(method, pool) -> dict[str, object]:
    """{projection: the QuantMethod storing it} for a method whose formats differ by projection
    (gguf-mixed) or by layer (gguf-layers: read from the layer's `pool`, whose parts name the types;
    without a pool nothing to check); else {"": method}."""
    if hasattr(method, "block_method"):
        if pool is None:
            return {}
        return {p: of_parts(method, pool, p) for p in PROJS if any(k.startswith(p + ".") for k in pool)}
    subs = getattr(method, "projections", None)
    return dict(subs) if subs is not None else {"": method}


def supported(method, pool: dict[str, torch.Tensor] | None = None) -> str | None:
    """Why the kernels cannot compute experts stored by `method` (a QuantMethod or None), or None. Formats
    may differ between gate_up and down (gguf-mixed), gate and up share one; gguf-layers is checked on a
    layer's `pool` where given (its tiers hold only types read here: quant/ggml.py tier_type)."""
    if method is None:
        return None
    subs = _per_projection(method, pool)
    for p, m in subs.items():
        if m.name not in QUANT_FORMATS:
            what = f"{method.name!r} part {p}.{m.primary}" if p else f"the {method.name!r} expert format"
            return f"no Triton MoE kernel for {what} (have: {', '.join(QUANT_FORMATS)})"
    if "gate" in subs and "up" in subs and subs["gate"].name != subs["up"].name:
        return (
            f"{method.name}: gate ({subs['gate'].name}) and up ({subs['up'].name}) differ in format; the "
            "Triton MoE kernel reads both with one decoder"
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
    fmt, scale_sfx, zero_sfx = QUANT_FORMATS[method.name]
    code = method.primary
    w = pool[f"{prefix}.{code}"]
    if fmt >= Q8_0 and (w.dtype != torch.uint8 or w.dim() != 3 or w.stride(2) != 1):
        raise ValueError(
            f"{prefix}.{code}: {method.name} blocks must be uint8 [S, out, row bytes] with contiguous rows "
            f"for the Triton kernel, got {w.dtype} {list(w.shape)}"
        )
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
    s_strides = _strides(scale) if scale is not None else (0, 0, 0)
    return Proj(w, _strides(w), scale, zero, s_strides, block, fmt)


def projections(pool: dict[str, torch.Tensor], method, ffn) -> tuple[int, Proj, Proj, Proj]:
    """A pool -> (I, gate, up, down) in the kernels' terms (views, no copies); each Proj names its FMT."""
    g, u, d = _projections(pool, method, ffn)
    if (g.w_strides, g.s_strides, g.fmt) != (u.w_strides, u.s_strides, u.fmt):
        raise ValueError(
            "gate and up expert weights are laid out differently in the slot pool; the Triton kernel "
            "reads both with one set of strides"
        )
    transposed = method is None and ffn is not None and ffn.transposed
    return g.w.shape[2 if transposed else 1], g, u, d


def _projections(pool, method, ffn) -> tuple[Proj, Proj, Proj]:
    interleaved = bool(ffn is not None and ffn.interleaved)
    if method is None:
        gu, dn = pool["gate_up"], pool["down"]
        transposed = bool(ffn is not None and ffn.transposed)
        o, i = (2, 1) if transposed else (1, 2)  # the out and in dimensions
        g, u = (_rows(gu, which, interleaved, dim=o) for which in (0, 1))
        return Proj(g, _strides(g, o, i)), Proj(u, _strides(u, o, i)), Proj(dn, _strides(dn, o, i))
    why = supported(method, pool)
    if why:
        raise ValueError(why)

    def proj(p, which=None):  # the method storing p (gguf-mixed / gguf-layers: per projection)
        return _quant_proj(pool, p, of_parts(method, pool, p), which, interleaved)

    if ffn is not None and ffn.fused_quant:
        g, u = proj("gate_up", 0), proj("gate_up", 1)
    else:
        g, u = proj("gate"), proj("up")
    return g, u, proj("down")


def biases(pool: dict[str, torch.Tensor], ffn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(gate bias [S, I], up bias [S, I], down bias [S, H]) as views, or None: the experts have no biases."""
    gb = pool.get("gate_up_bias")
    if gb is None:
        return None
    interleaved = bool(ffn is not None and ffn.interleaved)
    return _rows(gb, 0, interleaved), _rows(gb, 1, interleaved), pool["down_bias"]
