"""The registered quant formats (stored layout legend: see `method.py`).

Each class only maps its stored suffixes to a codec module; validation,
naming and buffers are handled once in `QuantMethod`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .fp8 import FP8_DTYPE
from .fp8_block import as_block_size, block_scale_shape, dequantize_fp8_block, quantize_fp8_block
from .fp8_channel import channel_scale_shapes, dequantize_fp8_channel, quantize_fp8_channel
from .groups import num_groups
from .int4 import dequantize_int4, quantize_int4
from .int8 import dequantize_int8, quantize_int8
from .method import QuantMethod, Shape, TensorSpec, is_float_dtype, register
from .mxfp4 import MX_BLOCK, dequantize_mxfp4, quantize_mxfp4


class _Plain(QuantMethod):
    dtype: ClassVar[torch.dtype]

    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec(shape, self.dtype)}

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": w.to(self.dtype)}

    def _dequant(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        return out.copy_(parts["weight"])


@register("bf16")
class BF16(_Plain):
    dtype = torch.bfloat16


@register("fp16")
class FP16(_Plain):
    dtype = torch.float16


@register("fp32")
class FP32(_Plain):
    dtype = torch.float32


class _FP8Weight(QuantMethod):
    def _accepts(self, suffix: str, spec: TensorSpec, t: torch.Tensor, shape: Shape) -> bool:
        if suffix == "weight" and t.dtype == torch.uint8:  # raw fp8 bytes
            return tuple(t.shape) == spec.shape
        return super()._accepts(suffix, spec, t, shape)


@register("fp8")
class FP8Block(_FP8Weight):
    """Block-scaled fp8; `block_size` is an int or [rows, cols] (config `weight_block_size`)."""

    params = ("block_size",)
    aliases = {"weight_scale": "weight_scale_inv"}

    def __init__(self, block_size: int | tuple[int, int] | list[int] = 128) -> None:
        self.block = as_block_size(block_size)

    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        return {
            "weight": TensorSpec(shape, FP8_DTYPE),
            "weight_scale": TensorSpec(block_scale_shape(shape, self.block), torch.float32),
        }

    def _shape_hint(self, shape: Shape) -> str:
        return f" with block size {list(self.block)}; check weight_block_size in the checkpoint config"

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = quantize_fp8_block(w, self.block)
        return {"weight": q, "weight_scale": s}

    def _dequant(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8_block(parts["weight"], parts["weight_scale"], self.block, out=out)


class _FP8Channel(_FP8Weight):
    strategy: ClassVar[str]

    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        scale_shape = channel_scale_shapes(shape, self.strategy)[0]
        return {
            "weight": TensorSpec(shape, FP8_DTYPE),
            "weight_scale": TensorSpec(scale_shape, torch.float32),
        }

    def _accepts(self, suffix: str, spec: TensorSpec, t: torch.Tensor, shape: Shape) -> bool:
        if suffix == "weight_scale":
            return tuple(t.shape) in channel_scale_shapes(shape, self.strategy) and is_float_dtype(t.dtype)
        return super()._accepts(suffix, spec, t, shape)

    def _shape_hint(self, shape: Shape) -> str:
        return f" (per-{self.strategy} scale)"

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = quantize_fp8_channel(w, self.strategy)
        return {"weight": q, "weight_scale": s}

    def _dequant(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8_channel(parts["weight"], parts["weight_scale"], out=out)


@register("fp8-channel")
class FP8Channel(_FP8Channel):
    strategy = "channel"


@register("fp8-tensor")
class FP8Tensor(_FP8Channel):
    strategy = "tensor"


class _Grouped(QuantMethod):
    params = ("group_size",)

    def __init__(self, group_size: int = 128) -> None:
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"{self.name} group_size must be a positive int, got {group_size!r}")
        self.group = group_size

    def _shape_hint(self, shape: Shape) -> str:
        return f" with group size {self.group} (ceil({shape[1]}/{self.group}) groups per row)"


@register("int8")
class Int8(_Grouped):
    """Symmetric int8, float32 group scales (see quant.int8 for why)."""

    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        g = (shape[0], num_groups(shape[1], self.group))
        return {"weight": TensorSpec(shape, torch.int8), "weight_scale": TensorSpec(g, torch.float32)}

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = quantize_int8(w, self.group)
        return {"weight": q, "weight_scale": s}

    def _dequant(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        return dequantize_int8(parts["weight"], parts["weight_scale"], self.group, out=out)


@register("int4")
class Int4(_Grouped):
    """Asymmetric int4 with uint8 zero points (see quant.int4 for why)."""

    def _check_shape(self, shape: tuple[int, ...], key: str = "weight") -> Shape:
        s = super()._check_shape(shape, key)
        if s[1] % 2:
            raise ValueError(
                f"{key}: int4 packs two values per byte, input dim must be even, got {list(shape)}"
            )
        return s

    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        g = (shape[0], num_groups(shape[1], self.group))
        return {
            "weight": TensorSpec((shape[0], shape[1] // 2), torch.uint8),
            "weight_scale": TensorSpec(g, torch.float32),
            "weight_zero": TensorSpec(g, torch.uint8),
        }

    def _shape_of(self, primary: torch.Tensor) -> Shape:
        return (primary.shape[0], primary.shape[1] * 2)

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s, z = quantize_int4(w, self.group)
        return {"weight": q, "weight_scale": s, "weight_zero": z}

    def _dequant(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        return dequantize_int4(
            parts["weight"], parts["weight_scale"], parts["weight_zero"], self.group, out=out
        )


@register("mxfp4")
class MXFP4(QuantMethod):
    """OCP MXFP4 in GPT-OSS layout (blocks of 32 sharing an e8m0 scale)."""

    primary = "weight_blocks"
    primary_ndim = 3

    def _check_shape(self, shape: tuple[int, ...], key: str = "weight") -> Shape:
        s = super()._check_shape(shape, key)
        if s[1] % MX_BLOCK:
            raise ValueError(
                f"{key}: mxfp4 needs the input dim to be a multiple of {MX_BLOCK}, got {list(shape)}"
            )
        return s

    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        g = shape[1] // MX_BLOCK
        return {
            "weight_blocks": TensorSpec((shape[0], g, MX_BLOCK // 2), torch.uint8),
            "weight_scales": TensorSpec((shape[0], g), torch.uint8),
        }

    def _shape_of(self, primary: torch.Tensor) -> Shape:
        return (primary.shape[0], primary.shape[1] * MX_BLOCK)

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        blocks, scales = quantize_mxfp4(w)
        return {"weight_blocks": blocks, "weight_scales": scales}

    def _dequant(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        return dequantize_mxfp4(parts["weight_blocks"], parts["weight_scales"], out=out)
