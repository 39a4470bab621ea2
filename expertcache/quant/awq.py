"""AWQ checkpoints as AutoAWQ ships them, GEMM version (`quant_method: awq`, `version: gemm`).

Stored layout of one linear [N out, K in] (4-bit; G = group_size; ng = ceil(K/G)):
    P.qweight  int32    [K, N/8]    codes packed along the OUTPUT dim, each word's 8 columns in
                                    AWQ's interleaved order (position i holds column AWQ_ORDER[i])
    P.qzeros   int32    [ng, N/8]   zero points, packed the same way
    P.scales   float16  [ng, N]
    w[n, k] = (code[k, n] - zero[k // G, n]) * scales[k // G, n]
Groups are contiguous, so every weight repacks exactly into the project's int4 layout.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .int32_words import AWQ_ORDER, unpack_int32
from .method import Shape, TensorSpec
from .shipped import ModuleRules, ShippedInt


class AWQ(ShippedInt):
    name = "awq"
    primary = "qweight"
    bits = 4

    def __init__(self, group_size: int = 128):
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"awq group_size must be a positive int, got {group_size!r}")
        self.group = group_size

    def _check_shape(self, shape, key="weight"):
        s = super()._check_shape(shape, key)
        if s[0] % 8 or s[1] % 2:
            raise ValueError(
                f"{key}: awq packs 8 output columns per int32 word (and the project two input "
                f"columns per byte); {list(shape)} must be a multiple of 8 by a multiple of 2"
            )
        return s

    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        N, K = shape
        ng = self._groups(shape)
        return {
            "qweight": TensorSpec((K, N // 8), torch.int32),
            "qzeros": TensorSpec((ng, N // 8), torch.int32),
            "scales": TensorSpec((ng, N), torch.float16),
        }

    def _shape_hint(self, shape: Shape) -> str:
        return f" with group_size {self.group}; check the checkpoint's quantization_config"

    def _shape_of(self, primary: torch.Tensor) -> Shape:
        return (primary.shape[1] * 8, primary.shape[0])

    def _code_bytes(self, parts, shape):
        N, K = shape
        w = parts["qweight"].contiguous().view(K // 2, 2, N // 8)  # rows 2j, 2j+1 of each column block
        a, b = w[:, 0], w[:, 1]
        # byte q of `even` pairs position 2q of rows 2j (low nibble) and 2j+1: columns (0, 4, 1, 5)[q];
        # of `odd`, position 2q+1: columns (2, 6, 3, 7)[q] -- column = 4 * (q % 2) + 2 * odd + q // 2
        even = (a & 0x0F0F0F0F) | ((b & 0x0F0F0F0F) << 4)
        odd = ((a >> 4) & 0x0F0F0F0F) | (b & _HIGH_NIBBLES.to(b.device))
        by = (
            torch.stack((even, odd), dim=-1).view(torch.uint8).view(K // 2, N // 8, 2, 2, 2)
        )  # [j, c, odd, q//2, q%2]
        return by.permute(1, 4, 2, 3, 0).reshape(N, K // 2)  # [c, q%2, odd, q//2, j] -> [N, K/2]

    def _zero_scale_group(self, parts, shape):
        zero = unpack_int32(parts["qzeros"], 4, dim=1, order=AWQ_ORDER).to(torch.int16).T
        return (
            zero,
            parts["scales"].to(torch.float32).T,
            torch.arange(shape[1], device=zero.device) // self.group,
        )


_HIGH_NIBBLES = torch.tensor(0xF0F0F0F0 - (1 << 32), dtype=torch.int32)


def awq_from_config(q: dict) -> AWQ:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"config.json: awq version {q.get('version')!r} is not supported (supported: gemm)")
    if q.get("bits", q.get("w_bit", 4)) != 4:
        raise ConfigError(
            f"config.json: awq bits={q.get('bits', q.get('w_bit'))} is not supported (supported: 4)"
        )
    if not q.get("zero_point", True):
        raise ConfigError(
            "config.json: awq zero_point false is not supported (AutoAWQ's GEMM checkpoints "
            "carry zero points)"
        )
    try:
        default = AWQ(group_size=q.get("group_size", q.get("q_group_size", 128)))
    except ValueError as e:
        raise ConfigError(f"config.json: quantization_config {q}: {e}") from None
    ModuleRules(default, excluded=q.get("modules_to_not_convert") or [])
    return default
