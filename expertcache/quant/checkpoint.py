"""Quantized checkpoints as they ship: which QuantMethod config.json asks for, and dense weights.

Recognised `quantization_config.quant_method` values:
  fp8                 block fp8 (DeepSeek-V3, Qwen3-*-FP8): `weight_block_size` [Bo, Bi], scales
                      `*.weight_scale_inv`
  compressed-tensors  fp8 with per-tensor or per-channel `*.weight_scale` (config_groups.*.weights
                      {type: float, num_bits: 8, strategy: tensor | channel})
  mxfp4               per-expert `*.weight_blocks` / `*.weight_scales` (OCP MX, GPT-OSS encoding)
  expertcache         written by `expertcache quantize`: {"experts": format, "group_size"?, "block_size"?}
Routed experts stay quantized in every tier. Dense weights that are stored as fp8 are
dequantized once at load with their own scale tensor.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError, ConfigError
from ..loader.safetensors_index import TensorIndex
from .method import QuantMethod, make_quant_method


def method_from_config(hf: dict) -> QuantMethod | None:
    q = hf.get("quantization_config")
    if not q:
        return None
    kind = q.get("quant_method")
    try:
        if kind == "fp8":
            return make_quant_method("fp8", block_size=list(q.get("weight_block_size") or [128, 128]))
        if kind == "compressed-tensors":
            groups = list((q.get("config_groups") or {}).values())
            w = (groups[0] if groups else {}).get("weights") or {}
            if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("tensor", "channel"):
                raise ConfigError(f"config.json: compressed-tensors weights {w} are not supported "
                                  "(supported: float 8-bit, strategy tensor or channel)")
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
    raise ConfigError(f"config.json: quantization_config.quant_method={kind!r} is not supported "
                      "(supported: fp8, compressed-tensors, mxfp4, expertcache)")


def load_dense(index: TensorIndex, name: str, shape: tuple[int, ...], method: QuantMethod | None) -> torch.Tensor:
    """A dense weight as float32 (or its stored float dtype); fp8 weights are dequantized with their scale.

    The scale is looked up under the weight's own name (`<base>.weight_scale` or `<base>.weight_scale_inv`),
    and errors name those tensors and their file.
    """
    t = index.info(name, shape)
    if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return index.load(name, shape)
    if method is None or method.name not in ("fp8", "fp8-channel", "fp8-tensor"):
        raise ConfigError(f"tensor {name} is {t.dtype} but config.json has no fp8 quantization_config")
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    stored = {f"{base}.weight": index.load(name, shape)}
    for suffix in ("weight_scale", "weight_scale_inv"):
        if f"{base}.{suffix}" in index:
            # keep the checkpoint's name when the method knows it (block fp8: weight_scale_inv)
            key = suffix if suffix == "weight_scale" or method.aliases.get("weight_scale") == suffix else "weight_scale"
            stored[f"{base}.{key}"] = index.load(f"{base}.{suffix}")
            break
    try:
        return method.dequantize(stored, base)
    except ValueError as e:
        raise CheckpointError(f"{t.file.name}: {e}") from None
