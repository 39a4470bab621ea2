"""Weight formats the C++ kernels read, by name: stored tensors -> the kernel's weight spec.

A spec is the tuple the extension takes for one projection of a pool of S weights [N, K]:
    (code, data [S, N, ...], scale float32 [S, rows, groups] | None, zero uint8 [S, N, groups] | None, N, K, G, Bo)
(G = columns per scale group, Bo = rows per scale row; see csrc/expert_kernels.cpp for the codes.)
GGUF blocks (`gguf-<type>`) are read as the file stores them: data uint8 [S, N, K / QK * block bytes]
(csrc/ggml_kernels.h), no scale or zero, G = QK.
Plain weights are keyed by dtype, quantized ones by their QuantMethod's registered name; a format
or parameter the kernels cannot read raises Unsupported (the caller then takes the torch path).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..quant.fp8 import FP8_DTYPE


class Unsupported(Exception):
    """The kernels cannot read this weight; the message says why."""


PLAIN_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FP8, INT8, INT4, MXFP4 = 3, 4, 5, 6
# GGUF block types (csrc/ggml_kernels.h): name -> (code, QK weights a block, bytes a block)
GGUF_TYPES = {
    "q8_0": (7, 32, 34),
    "q4_0": (8, 32, 18),
    "q5_0": (9, 32, 22),
    "iq4_nl": (10, 32, 18),
    "mxfp4": (11, 32, 17),
    "q4_k": (12, 256, 144),
    "q5_k": (13, 256, 176),
    "q6_k": (14, 256, 210),
    "iq4_xs": (15, 256, 136),
}
# The per-code tuning the kernels' callers read (kernels/__init__.py SMALL_T, UNIT_ROWS), for the GGUF codes:
# tokens up to which a row is decoded in registers per pass of tokens (beyond: a tile decoded to float32
# once), and rows per unit of work relative to bf16 (the bytes of a bf16 unit). Rows measured faster than
# the tile at every count tried (one thread, 768 x 2048, CPU time, exact math, rows / tiled ms: q4_k T=8
# 0.5 / 1.2, 16 0.9 / 1.6, 32 1.8 / 2.4, 64 3.6 / 3.9; q6_k, q8_0, mxfp4 the same within 0.1 ms): never tiled.
GGUF_SMALL_T = {code: 1 << 30 for code, _, _ in GGUF_TYPES.values()}
GGUF_UNIT_ROWS = {code: 2 * qk / nbytes for code, qk, nbytes in GGUF_TYPES.values()}

Spec = tuple
SPECS: dict[str, Callable[[object, dict[str, torch.Tensor], str, int, int], Spec]] = {}


def register(*names: str):
    def deco(fn):
        for n in names:
            SPECS[n] = fn
        return fn

    return deco


def plain_spec(w: torch.Tensor) -> Spec:
    """w [S, N, K] (rows contiguous) in float32 / bfloat16 / float16."""
    if w.dtype not in PLAIN_CODES:
        raise Unsupported(f"no kernel for {w.dtype} weights")
    if w.stride(-1) != 1:
        raise Unsupported("weight rows are not contiguous")
    S, N, K = w.shape
    return (PLAIN_CODES[w.dtype], w, None, None, N, K, K, 1)


def quant_spec(method, parts: dict[str, torch.Tensor], proj: str, N: int, K: int) -> Spec:
    """Pool parts {"<proj>.<suffix>": [S, ...]} of QuantMethod `method` -> spec of projection `proj`."""
    method = of_parts(method, parts, proj)
    fn = SPECS.get(method.name)
    if fn is None:
        raise Unsupported(f"no kernel for quant format {method.name!r}")
    return fn(method, parts, proj, N, K)


def of_parts(method, parts: dict[str, torch.Tensor], proj: str):
    """The method that stores projection `proj` of `parts`: per-projection formats (GGUF gate/up Q4_K,
    down Q6_K: `projections`), per-layer ones (GGUF types differing between layers: the parts' keys
    name the type, `block_method`), else `method`."""
    pick = getattr(method, "block_method", None)
    if pick is not None:
        return pick(parts, proj)
    subs = getattr(method, "projections", None)
    return subs[proj] if subs is not None and proj in subs else method


def _scale(t: torch.Tensor, S: int) -> torch.Tensor:
    t = t.reshape(S, *((1, 1) if t[0].numel() == 1 else t.shape[1:]))
    return t if t.dtype == torch.float32 and t.stride(-1) == 1 else t.float().contiguous()


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


@register("bf16", "fp16", "fp32")
def _plain(method, parts, proj, N, K):
    return plain_spec(parts[f"{proj}.{method.primary}"])  # "P.weight", or "P.f32" (GGUF types per layer)


@register("fp8")
def _fp8_block(method, parts, proj, N, K):
    w = parts[f"{proj}.weight"]
    bo, bi = method.block
    return (FP8, _codes(w), _scale(parts[f"{proj}.weight_scale"], w.shape[0]), None, N, K, bi, bo)


@register("fp8-channel", "fp8-tensor")
def _fp8_channel(method, parts, proj, N, K):
    w = parts[f"{proj}.weight"]
    s = _scale(parts[f"{proj}.weight_scale"], w.shape[0])
    return (FP8, _codes(w), s, None, N, K, K, 1 if s.shape[1] == N else N)


@register("int8")
def _int8(method, parts, proj, N, K):
    w = parts[f"{proj}.weight"]
    return (INT8, w, _scale(parts[f"{proj}.weight_scale"], w.shape[0]), None, N, K, method.group, 1)


@register("int4")
def _int4(method, parts, proj, N, K):
    if method.group % 2:
        raise Unsupported(f"int4 with an odd group size ({method.group}) splits a byte between groups")
    w = parts[f"{proj}.weight"]
    z = parts[f"{proj}.weight_zero"]
    return (INT4, w, _scale(parts[f"{proj}.weight_scale"], w.shape[0]), z, N, K, method.group, 1)


@register("mxfp4")
def _mxfp4(method, parts, proj, N, K):
    blocks = parts[f"{proj}.weight_blocks"]
    return (MXFP4, blocks, None, parts[f"{proj}.weight_scales"], N, K, 32, 1)


def _gguf(type_name: str):
    code, qk, nbytes = GGUF_TYPES[type_name]

    def spec(method, parts, proj, N, K):
        key = f"{proj}.{method.primary}"  # "P.weight", or "P.<type>" (GGUF types per layer)
        w = parts[key]
        if K % qk:
            raise Unsupported(
                f"{method.name}: {key} has {K} columns, not a multiple of the {qk}-weight block"
            )
        row = K // qk * nbytes
        if w.dtype != torch.uint8 or w.dim() != 3 or tuple(w.shape[1:]) != (N, row):
            raise Unsupported(
                f"{method.name}: {key} must be uint8 [S, {N}, {row}], got {w.dtype} {list(w.shape)}"
            )
        if w.stride(-1) != 1:
            raise Unsupported(f"{method.name}: {key} rows are not contiguous")
        return (code, w, None, None, N, K, qk, 1)

    return spec


for _t in GGUF_TYPES:
    register(f"gguf-{_t}")(_gguf(_t))
