"""compressed-tensors `pack-quantized` integer checkpoints (llm-compressor W4A16 / W8A16).

Stored layout of one linear [N out, K in] (b = num_bits, 4 or 8; p = 32/b; G = group_size,
K for strategy "channel"; ng = ceil(K/G)):
    P.weight_packed      int32        [N, K/p]    codes packed along the input dim, each stored as
                                                  the signed value + 2^(b-1)
    P.weight_scale       float        [N, ng]
    P.weight_zero_point  int32        [N/p, ng]   (symmetric false only) signed zero points + 2^(b-1),
                                                  packed along the output dim
    P.weight_shape       int64        [2]         [N, K]
    w[n, k] = (code[n, k] - zero[n, k // G]) * scale[n, k // G], zero 2^(b-1) when symmetric.
Groups are contiguous: 4-bit weights repack into the project's int4 layout, symmetric 8-bit into int8.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .int32_words import codes_per_word, unpack_int32
from .method import Shape, TensorSpec
from .shipped import BadValues, ModuleRules, ShippedInt


class PackQuantized(ShippedInt):
    name = "compressed-tensors"
    primary = "weight_packed"
    zero_name = "weight_zero_point"

    def __init__(self, bits: int = 4, group_size: int = 128, symmetric: bool = True):
        codes_per_word(bits)
        self.bits, self.group, self.symmetric = bits, group_size, bool(symmetric)

    def _check_shape(self, shape, key="weight"):
        s = super()._check_shape(shape, key)
        p = codes_per_word(self.bits)
        if s[1] % p or (not self.symmetric and s[0] % p):
            raise ValueError(
                f"{key}: {self.bits}-bit pack-quantized packs {p} codes per int32 word; "
                f"{list(shape)} does not divide"
            )
        return s

    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        N, K = shape
        p, ng = codes_per_word(self.bits), self._groups(shape)
        out = {
            "weight_packed": TensorSpec((N, K // p), torch.int32),
            "weight_scale": TensorSpec((N, ng), torch.float16),
        }
        if not self.symmetric:
            out["weight_zero_point"] = TensorSpec((N // p, ng), torch.int32)
        out["weight_shape"] = TensorSpec((2,), torch.int64)
        return out

    def _shape_hint(self, shape: Shape) -> str:
        return f" with num_bits {self.bits} and group_size {self.group}; check the checkpoint's config_groups"

    def _shape_of(self, primary: torch.Tensor) -> Shape:
        return (primary.shape[0], primary.shape[1] * codes_per_word(self.bits))

    def _code_bytes(self, parts, shape):
        return (
            parts["weight_packed"].contiguous().view(torch.uint8)
        )  # words along K, lowest bits first: the project's order

    def _zero_scale_group(self, parts, shape):
        if parts["weight_shape"].tolist() != list(shape):
            raise BadValues(
                f"weight_shape is {parts['weight_shape'].tolist()} but the packed tensors hold {list(shape)}"
            )
        ng, device = self._groups(shape), parts["weight_scale"].device
        if self.symmetric:
            zero = torch.full((shape[0], ng), 1 << (self.bits - 1), dtype=torch.int16, device=device)
        else:
            zero = unpack_int32(parts["weight_zero_point"], self.bits, dim=0).to(torch.int16)
        group = torch.arange(shape[1], device=device) // self.group_size(shape[1])
        return zero, parts["weight_scale"].to(torch.float32), group


def pack_quantized_from_config(q: dict) -> PackQuantized:
    """quantization_config {quant_method: compressed-tensors, format: pack-quantized} -> the default
    method, with a rule per config group (its `targets`) and the `ignore` list."""
    methods = []
    for gname, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        where = f"config.json: compressed-tensors config_groups.{gname}.weights"
        if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
            raise ConfigError(f"{where} {w}: pack-quantized supports int 4- or 8-bit weights")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ConfigError(f"{where}: strategy {strategy!r} is not supported (supported: group, channel)")
        if w.get("actorder") not in (None, False, "static"):
            raise ConfigError(f"{where}: actorder {w['actorder']!r} (weight_g_idx) is not supported")
        if group.get("input_activations"):
            raise ConfigError(
                f"{where}: quantized input activations are not supported (weight-only W4A16/W8A16)"
            )
        gs = w.get("group_size") if strategy == "group" else -1
        if not isinstance(gs, int) or (gs < 1 and gs != -1):
            raise ConfigError(f"{where}: group_size must be a positive integer, got {gs!r}")
        method = PackQuantized(bits=w["num_bits"], group_size=gs, symmetric=w.get("symmetric", True))
        methods += [(t, method) for t in group.get("targets") or ["Linear"]]
    if not methods:
        raise ConfigError("config.json: compressed-tensors pack-quantized has no config_groups")
    # a layer-class target ("Linear") matches every module; names and regexes are matched first
    named = [(t, m) for t, m in methods if t != "Linear"]
    default = next((m for t, m in methods if t == "Linear"), None)
    ModuleRules(default, excluded=q.get("ignore") or [], overrides=named)
    return default or named[0][1]  # any of them: each answers method_for for every module
