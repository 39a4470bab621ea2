"""Integer checkpoints as other tools ship them (GPTQ, AWQ, compressed-tensors pack-quantized):
the common part of their QuantMethods, the repack into the project's own int4/int8 layout, and
which modules a checkpoint quantized with which parameters.

Every shipped layout unpacks to the same form (legend: N out, K in, ng groups, G group size):
    codes  uint8   [N, K]     unsigned codes 0 .. 2^b - 1
    zero   int16   [N, ng]    integer zero points (the format's offsets applied)
    scale  float32 [N, ng]
    group  int64   [K]        the group of every input column (GPTQ act-order: any order)
    w[n, k] = (codes[n, k] - zero[n, group[k]]) * scale[n, group[k]]
`dequantize` computes exactly that. Where the groups are the contiguous runs of G columns the
weight repacks exactly into the project's layouts (quant/int4.py, quant/int8.py; see `tier` and
`repack`): 4-bit codes with their zero points as int4, symmetric 8-bit codes as int8. The tiers
then hold that layout (experts/layout.py repacks each expert as it is read), computed by the
int4 / int8 kernels; otherwise they hold the shipped tensors and compute dequantizes them.
"""

from __future__ import annotations

import re
import sys
from typing import ClassVar

import torch

from .groups import num_groups
from .method import QuantMethod, Shape, proj_name
from .methods import Int4, Int8
from .nibbles import unpack_nibbles

if sys.byteorder != "little":  # int32 words are read as their bytes
    raise ImportError(
        "expertcache.quant.shipped reads int32-packed checkpoints on little-endian machines only"
    )


class ShippedInt(QuantMethod):
    """Base of the shipped integer layouts; subclasses define `_layout`, `_shape_of`, `_code_bytes` and
    `_zero_scale_group` (the unpacked form of the module legend, split in the codes and the rest)."""

    bits: int
    group: int  # columns per group; -1: one group per row
    symmetric: bool = True  # zero points all 2^(b-1)
    exact_groups: bool = True  # groups are contiguous runs of G columns (GPTQ: only without act-order)
    zero_name: ClassVar[str] = "qzeros"  # the stored zero points' suffix (errors)
    rules: "ModuleRules | None" = None  # set by the config parser: other modules' parameters

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise ValueError(
            f"{self.name} checkpoints are read as shipped, not written; "
            "`expertcache quantize` writes the int4 / int8 formats"
        )

    def _code_bytes(self, parts: dict[str, torch.Tensor], shape: Shape) -> torch.Tensor:
        """The codes as the project stores them: uint8 [N, K/2] two per byte, low nibble first along K
        (4-bit), or uint8 [N, K] (8-bit); unsigned."""
        raise NotImplementedError

    def _zero_scale_group(self, parts: dict[str, torch.Tensor], shape: Shape):
        """-> (zero int16 [N, ng], scale float32 [N, ng], group int64 [K])."""
        raise NotImplementedError

    def _unpacked(self, parts: dict[str, torch.Tensor], shape: Shape):
        """-> (codes uint8 [N, K], zero int16 [N, ng], scale float32 [N, ng], group int64 [K])."""
        zero, scale, group = self._zero_scale_group(parts, shape)
        codes = self._code_bytes(parts, shape)
        return (unpack_nibbles(codes) if self.bits == 4 else codes), zero, scale, group

    def group_size(self, k: int) -> int:
        return k if self.group == -1 else self.group

    def _groups(self, shape: Shape) -> int:
        return num_groups(shape[1], self.group_size(shape[1]))

    def _dequant(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        codes, zero, scale, group = self._unpacked(parts, tuple(out.shape))
        return out.copy_((codes.to(torch.int16) - zero[:, group]).to(torch.float32) * scale[:, group])

    def dequantize(self, stored, name, out=None):
        try:
            return super().dequantize(stored, name, out)
        except BadValues as e:  # a value check of _unpacked: name the tensor
            raise ValueError(f"{proj_name(name)}.{e}") from None

    def weight_shape(self, primary_shape: tuple[int, ...], module: str) -> Shape:
        """[out, in] of module `module` from its primary tensor's shape (ValueError naming it)."""
        return self._check_shape(
            self._shape_of_checked(torch.empty(primary_shape, device="meta"), module), module
        )

    def check_stored(
        self, module: str, shape: Shape, stored: dict[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> None:
        """ValueError naming the first of `stored` {suffix: (shape, dtype)} that does not fit a weight of `shape`."""
        for suffix, spec in self._layout(shape).items():
            got_shape, dtype = stored[suffix]
            if not self._accepts(suffix, spec, torch.empty(got_shape, dtype=dtype, device="meta"), shape):
                raise ValueError(
                    f"tensor {module}.{suffix} is {dtype} {list(got_shape)}, but {self.name} needs "
                    f"{spec.dtype} {list(spec.shape)} for a weight of shape {list(shape)}"
                    f"{self._shape_hint(shape)}"
                )

    def method_for(self, module: str) -> "ShippedInt | None":
        """The method of checkpoint module `module` (e.g. model.layers.0.self_attn.q_proj): None when
        the checkpoint left it unquantized."""
        return self if self.rules is None else self.rules.method_for(module)

    # ---- the project's layout --------------------------------------------------------------
    def tier(self, max_in: int, in_order: bool | None = None) -> QuantMethod | None:
        """The project method an expert of this layout repacks into exactly (experts' input dims up to
        `max_in`), or None: the tiers keep the shipped tensors. `in_order`: whether the groups were
        found contiguous (act-order checkpoints quantized with static groups are), default: the config's word."""
        if not (self.exact_groups if in_order is None else in_order):
            return None
        g = self.group if self.group != -1 else max_in + max_in % 2  # one group per row: G >= every K
        if self.bits == 4:
            return Int4(group_size=g)
        if self.bits == 8 and self.symmetric:
            return Int8(group_size=g)
        return None

    def repack(
        self, stored: dict[str, torch.Tensor], name: str, tier: QuantMethod
    ) -> dict[str, torch.Tensor]:
        """Projection `name`'s shipped tensors -> the stored tensors of `tier` (this method's `tier()`),
        {suffix: tensor}, exactly the same weight. Raises ValueError naming a tensor whose values
        do not fit the layout (groups out of order, a symmetric zero point that is not 2^(b-1))."""
        p = proj_name(name)
        parts, shape = self._gather(stored, p)
        try:
            zero, scale, group = self._zero_scale_group(parts, shape)
        except BadValues as e:
            raise ValueError(f"{p}.{e}") from None
        K = shape[1]
        if not torch.equal(group, torch.arange(K, device=group.device) // tier.group):
            raise ValueError(
                f"{p}.g_idx does not put column k in group k // {self.group_size(K)} although the "
                "config says desc_act false (or the first expert's groups were in that order)"
            )
        codes = self._code_bytes(parts, shape)
        if isinstance(tier, Int4):
            return {"weight": codes, "weight_scale": scale, "weight_zero": zero.to(torch.uint8)}
        mid = 1 << (self.bits - 1)
        if not bool((zero == mid).all()):
            raise ValueError(f"{p}.{self.zero_name}: symmetric {self.bits}-bit zero points must all be {mid}")
        return {"weight": (codes ^ mid).view(torch.int8), "weight_scale": scale}  # u - 128 as int8


class BadValues(ValueError):
    """A stored tensor's values do not fit its layout; the message starts with the tensor's suffix."""


def check_group_ids(group: torch.Tensor, ng: int, what: str = "g_idx") -> torch.Tensor:
    g = group.to(torch.int64)
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= ng):
        raise BadValues(f"{what} holds group ids outside [0, {ng})")
    return g


class ModuleRules:
    """Which modules a checkpoint quantized and with what: `excluded` modules stay unquantized,
    `overrides` [(pattern, method)] replace the default for the modules whose name matches (first
    match wins); patterns are regular expressions (re.match) or plain names (the module or its
    last components)."""

    def __init__(self, default: ShippedInt | None, excluded=(), overrides=()):
        """default None: a module no override matches is unquantized."""
        self.default, self.excluded, self.overrides = default, list(excluded), list(overrides)
        for m in [default] + [m for _, m in self.overrides]:
            if m is not None:
                m.rules = self  # every method answers method_for for the whole checkpoint

    @staticmethod
    def matches(pattern: str, module: str) -> bool:
        if pattern.startswith("re:"):
            return re.match(pattern[3:], module) is not None
        return module == pattern or module.endswith("." + pattern)

    def method_for(self, module: str) -> ShippedInt | None:
        if any(self.matches(p, module) for p in self.excluded):
            return None
        return next((m for p, m in self.overrides if self.matches(p, module)), self.default)
