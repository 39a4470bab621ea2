"""GPTQ checkpoints as AutoGPTQ / GPTQModel / optimum ship them (`quant_method: gptq`).

Stored layout of one linear [N out, K in] (b = bits, 4 or 8; p = 32/b codes per int32 word;
G = group_size, K when -1; ng = ceil(K/G)):
    P.qweight  int32    [K/p, N]    codes packed along the input dim: word [r, n] holds k = r*p .. r*p+p-1
    P.qzeros   int32    [ng, N/p]   zero points packed along the output dim
    P.scales   float16  [ng, N]
    P.g_idx    int32    [K]         the group of each input column (act-order: a permutation of groups)
    w[n, k] = (code[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]
`checkpoint_format` "gptq" (v1, the common one) stores every zero point minus one; "gptq_v2"
stores it as is. Symmetric checkpoints have zero 2^(b-1). Without act-order (desc_act false)
g_idx must be k // G, and the weight repacks into the project's int4 / int8 layout; with it,
the tiers keep these tensors and compute dequantizes through g_idx, unless the first expert's
g_idx is k // G anyway (act-order with static groups): then experts repack too
(experts/layout.py, `ShippedInt.tier`).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .int32_words import codes_per_word, unpack_int32
from .method import Shape, TensorSpec
from .shipped import ModuleRules, ShippedInt, check_group_ids

FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> offset added to the stored zero points


class GPTQ(ShippedInt):
    name = "gptq"
    primary = "qweight"

    def __init__(
        self,
        bits: int = 4,
        group_size: int = 128,
        sym: bool = True,
        desc_act: bool = False,
        zero_offset: int = 1,
    ):
        codes_per_word(bits)
        if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
            raise ValueError(f"gptq group_size must be a positive int or -1, got {group_size!r}")
        self.bits, self.group, self.symmetric = bits, group_size, bool(sym)
        self.desc_act, self.zero_offset = bool(desc_act), zero_offset
        self.exact_groups = not self.desc_act

    def _check_shape(self, shape, key="weight"):
        s = super()._check_shape(shape, key)
        p = codes_per_word(self.bits)
        if s[0] % p or s[1] % p:
            raise ValueError(
                f"{key}: gptq {self.bits}-bit packs {p} codes per int32 word; both dims of "
                f"{list(shape)} must be multiples of {p}"
            )
        return s

    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        N, K = shape
        p, ng = codes_per_word(self.bits), self._groups(shape)
        return {
            "qweight": TensorSpec((K // p, N), torch.int32),
            "qzeros": TensorSpec((ng, N // p), torch.int32),
            "scales": TensorSpec((ng, N), torch.float16),
            "g_idx": TensorSpec((K,), torch.int32),
        }

    def _shape_hint(self, shape: Shape) -> str:
        return (
            f" with bits {self.bits} and group_size {self.group}; check the checkpoint's quantization_config"
        )

    def _shape_of(self, primary: torch.Tensor) -> Shape:
        return (primary.shape[1], primary.shape[0] * codes_per_word(self.bits))

    def _code_bytes(self, parts, shape):
        # word [r, n] holds k = r*p .. r*p+p-1 from its lowest bits (little-endian: its bytes in k order, a
        # 4-bit byte's low nibble the even k): the words transposed are the project's bytes
        return parts["qweight"].T.contiguous().view(torch.uint8)

    def _zero_scale_group(self, parts, shape):
        zero = unpack_int32(parts["qzeros"], self.bits, dim=1).to(torch.int16).T + self.zero_offset
        group = check_group_ids(parts["g_idx"], self._groups(shape))
        return zero, parts["scales"].to(torch.float32).T, group


def gptq_from_config(q: dict) -> GPTQ:
    """quantization_config of a GPTQ checkpoint -> its default method, with the per-module rules of
    `modules_to_not_convert` and GPTQModel's `dynamic` ({"-:regex": {}} excludes, {"+:regex" or "regex":
    {bits, group_size, sym, desc_act}} overrides)."""
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in FORMATS:
        raise ConfigError(
            f"config.json: gptq checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)"
        )
    base = dict(
        bits=q.get("bits", 4),
        group_size=q.get("group_size", 128),
        sym=q.get("sym", True),
        desc_act=q.get("desc_act", False),
    )
    for k in ("bits", "group_size"):
        if not isinstance(base[k], int):
            raise ConfigError(f"config.json: quantization_config.{k} must be an integer, got {base[k]!r}")
    if base["bits"] not in (4, 8):
        raise ConfigError(f"config.json: gptq bits={base['bits']} is not supported (supported: 4, 8)")
    excluded = [f"re:{p[2:]}" for p in (q.get("dynamic") or {}) if p.startswith("-:")]
    excluded += list(q.get("modules_to_not_convert") or [])
    overrides = []
    for pattern, params in (q.get("dynamic") or {}).items():
        if pattern.startswith("-:"):
            continue
        unknown = set(params) - set(base)
        if unknown:
            raise ConfigError(
                f"config.json: gptq dynamic {pattern!r} sets {sorted(unknown)}; "
                f"supported per-module fields: {', '.join(base)}"
            )
        overrides.append((f"re:{pattern.removeprefix('+:')}", _make(q, fmt, {**base, **params})))
    default = _make(q, fmt, base)
    ModuleRules(default, excluded, overrides)
    return default


def _make(q: dict, fmt: str, params: dict) -> GPTQ:
    try:
        return GPTQ(**params, zero_offset=FORMATS[fmt])
    except ValueError as e:
        raise ConfigError(f"config.json: quantization_config {q}: {e}") from None
