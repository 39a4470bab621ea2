"""Quantized checkpoints as they ship: which QuantMethod config.json asks for, and dense weights.

Recognised `quantization_config.quant_method` values:
  fp8                 block fp8 (DeepSeek-V3, Qwen3-*-FP8): `weight_block_size` [Bo, Bi], scales
                      `*.weight_scale_inv`
  compressed-tensors  fp8 with per-tensor or per-channel `*.weight_scale` (config_groups.*.weights
                      {type: float, num_bits: 8, strategy: tensor | channel})
  mxfp4               per-expert `*.weight_blocks` / `*.weight_scales` (OCP MX, GPT-OSS encoding)
  expertcache         written by `expertcache quantize`: {"experts": format, "group_size"?, "block_size"?}
  gptq                GPTQ int32-packed 4/8-bit (quant/gptq.py), act-order included
  awq                 AWQ GEMM 4-bit (quant/awq.py)
  compressed-tensors  format pack-quantized: int 4/8-bit, strategy group or channel (quant/compressed.py)
Routed experts stay quantized in every tier (the shipped integer layouts repacked into the
project's int4/int8 layout where exact: quant/shipped.py). Dense weights that are stored
quantized are dequantized once at load: fp8 with its own scale tensor; a shipped integer
module appears in the index as one float tensor `<module>.weight` (`index_quantized_dense`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CheckpointError, ConfigError
from ..loader.safetensors_index import TensorIndex, TensorInfo
from .awq import awq_from_config
from .compressed import pack_quantized_from_config
from .gptq import gptq_from_config
from .method import QuantMethod, make_quant_method
from .shipped import ShippedInt


def method_from_config(hf: dict) -> QuantMethod | None:
    q = hf.get("quantization_config")
    if not q:
        return None
    kind = q.get("quant_method")
    if kind == "gptq":
        return gptq_from_config(q)
    if kind == "awq":
        return awq_from_config(q)
    if kind == "compressed-tensors" and _pack_quantized(q):
        return pack_quantized_from_config(q)
    try:
        if kind == "fp8":
            return make_quant_method("fp8", block_size=list(q.get("weight_block_size") or [128, 128]))
        if kind == "compressed-tensors":
            groups = list((q.get("config_groups") or {}).values())
            w = (groups[0] if groups else {}).get("weights") or {}
            if (
                w.get("type") != "float"
                or w.get("num_bits") != 8
                or w.get("strategy") not in ("tensor", "channel")
            ):
                raise ConfigError(
                    f"config.json: compressed-tensors format {q.get('format')!r} weights {w} are not "
                    "supported (supported: float 8-bit, strategy tensor or channel; format "
                    "pack-quantized int 4/8-bit)"
                )
            return make_quant_method(f"fp8-{w['strategy']}")
        if kind == "mxfp4":
            return make_quant_method("mxfp4")
        if kind == "expertcache":
            params = {k: q[k] for k in ("group_size", "block_size") if k in q}
            return make_quant_method(q["experts"], **params)
    except (ValueError, KeyError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config.json: quantization_config {q}: {e}") from None
    raise ConfigError(
        f"config.json: quantization_config.quant_method={kind!r} is not supported "
        "(supported: fp8, compressed-tensors, mxfp4, expertcache, gptq, awq)"
    )


def _pack_quantized(q: dict) -> bool:
    """compressed-tensors `format` pack-quantized, at the top or (format mixed-precision) in every group."""
    if q.get("format") != "mixed-precision":
        return q.get("format") == "pack-quantized"
    formats = {g.get("format") for g in (q.get("config_groups") or {}).values()}
    if "pack-quantized" in formats and formats != {"pack-quantized"}:
        raise ConfigError(
            f"config.json: compressed-tensors mixes the formats {sorted(map(str, formats))}; "
            "supported: pack-quantized in every group"
        )
    return formats == {"pack-quantized"}


def load_dense(
    index: TensorIndex, name: str, shape: tuple[int, ...], method: QuantMethod | None
) -> torch.Tensor:
    """A dense weight as float32 (or its stored float dtype); fp8 weights are dequantized with their scale.

    The scale is looked up under the weight's own name (`<base>.weight_scale` or `<base>.weight_scale_inv`),
    and errors name those tensors and their file.
    """
    t = index.info(name, shape)
    if isinstance(t, PackedInfo):
        stored = {f"{t.module}.{suffix}": _read(part) for suffix, part in t.parts.items()}
        try:
            return t.method.dequantize(stored, t.module)
        except ValueError as e:
            raise CheckpointError(f"{t.file.name}: {e}") from None
    if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return index.load(name, shape)
    if method is None or method.name not in ("fp8", "fp8-channel", "fp8-tensor"):
        raise ConfigError(f"tensor {name} is {t.dtype} but config.json has no fp8 quantization_config")
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    stored = {f"{base}.weight": index.load(name, shape)}
    for suffix in ("weight_scale", "weight_scale_inv"):
        if f"{base}.{suffix}" in index:
            # keep the checkpoint's name when the method knows it (block fp8: weight_scale_inv)
            key = (
                suffix
                if suffix == "weight_scale" or method.aliases.get("weight_scale") == suffix
                else "weight_scale"
            )
            stored[f"{base}.{key}"] = index.load(f"{base}.{suffix}")
            break
    try:
        return method.dequantize(stored, base)
    except ValueError as e:
        raise CheckpointError(f"{t.file.name}: {e}") from None


def _read(t: TensorInfo) -> torch.Tensor:
    """One stored tensor of a PackedInfo (no longer in the index under its own name)."""
    buf = bytearray(t.nbytes)
    with open(t.file, "rb", buffering=0) as f:
        f.seek(t.offset)
        if f.readinto(buf) != t.nbytes:
            raise CheckpointError(f"{t.file}: short read of tensor {t.name}: file truncated?")
    return (
        torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).reshape(t.shape)
        if t.nbytes
        else torch.empty(t.shape, dtype=t.dtype)
    )


@dataclass(frozen=True)
class PackedInfo(TensorInfo):
    """A dense module stored in a shipped integer layout, seen as its float weight [out, in]: dtype
    float32 (what `load_dense` dequantizes it to, so the engine's dense estimate holds), nbytes the
    stored tensors' bytes."""

    module: str = ""
    method: QuantMethod | None = None
    parts: dict | None = None  # suffix -> TensorInfo of the stored tensor


def index_quantized_dense(index: TensorIndex, method: QuantMethod | None, skip: set[str]) -> None:
    """Every quantized dense module of a shipped integer layout (a `<module>.<primary>` tensor not in
    `skip`, the routed experts' tensors) replaces its stored tensors in `index` by one PackedInfo
    `<module>.weight` (bytes counted once, as stored). A module the config excludes, or one whose
    tensors do not match its layout, is an error naming the tensor."""
    if not isinstance(method, ShippedInt):
        return
    primary = f".{method.primary}"
    for name in [n for n in index.tensors if n.endswith(primary) and n not in skip]:
        module = name[: -len(primary)]
        m = method.method_for(module)
        p = index.info(name)
        if m is None:
            raise CheckpointError(
                f"{p.file.name}: tensor {name} is quantized but config.json's quantization_config "
                f"leaves module {module} unquantized"
            )
        try:
            shape = m.weight_shape(p.shape, module)
            parts = {key.rsplit(".", 1)[1]: index.info(key) for key in m.layout(module, shape)}
            m.check_stored(module, shape, {k: (t.shape, t.dtype) for k, t in parts.items()})
        except ValueError as e:
            raise CheckpointError(f"{p.file.name}: {e}") from None
        index.drop(parts[k].name for k in parts)
        index.tensors[f"{module}.weight"] = PackedInfo(
            f"{module}.weight",
            p.file,
            torch.float32,
            shape,
            p.offset,
            sum(t.nbytes for t in parts.values()),
            module,
            m,
            parts,
        )
