"""`expertcache quantize`: rewrite a checkpoint with its routed experts quantized.

Output layout (loaded back by quant/checkpoint.py, quant_method "expertcache"):
  config.json        + quantization_config {"quant_method": "expertcache", "experts": FORMAT,
                       "group_size"/"block_size" when the format takes one}
  model-0000i-of-0000n.safetensors + model.safetensors.index.json
      dense tensors unchanged (name, dtype, bytes)
      routed experts per expert j and projection P (hub names: gate_proj/up_proj/down_proj or
      Mixtral w1/w3/w2), whatever the input layout (hub or fused):
          model.layers.{l}.<moe>.experts.{j}.P.<stored suffix>   (see quant/method.py legend)
  every other file of the model directory (tokenizer, generation config) copied.
Experts are read one at a time, so memory stays at about one shard.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..experts.compute import SWIGLU
from ..experts.layout import ExpertSource
from ..loader.safetensors_index import TensorIndex, read_header
from ..loader.writer import write_safetensors
from ..models.registry import read_config
from ..quant.method import make_quant_method

SHARD_BYTES = 2 << 30


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    fmt: str,
    group_size: int | None = None,
    block_size: int | None = None,
    progress: bool = False,
) -> Path:
    src, dst = Path(src), Path(dst)
    family, cfg, hf = read_config(src)
    if hf.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({hf['quantization_config'].get('quant_method')})")
    params = {k: v for k, v in (("group_size", group_size), ("block_size", block_size)) if v is not None}
    method = make_quant_method(fmt, **params)
    index = TensorIndex(src)
    source = ExpertSource(index, cfg, family.names)
    if source.ffn != SWIGLU or source.bias_parts:
        raise ValueError(
            f"{src}: {family.name} experts ({source.ffn.act}, biases or interleaved gate/up rows) "
            "cannot be rewritten by expertcache quantize (GPT-OSS checkpoints ship MXFP4 experts already)"
        )
    dst.mkdir(parents=True, exist_ok=True)
    expert_tensors = {
        n for layer in source.layers for n in _expert_names(index, layer, family.names, cfg.num_experts)
    }
    shards = _Shards(dst)
    for name in sorted(set(index.tensors) - expert_tensors):
        shards.put(name, index.load(name))
    _quantize_experts(source, family.names, cfg, method, shards, progress)
    shards.close()
    hf = dict(hf)
    hf["quantization_config"] = {"quant_method": "expertcache", "experts": fmt, **params}
    (dst / "config.json").write_text(json.dumps(hf, indent=2))
    _copy_other_files(src, dst)
    return dst


def _quantize_experts(source: ExpertSource, names, cfg, method, shards: "_Shards", progress: bool) -> None:
    """Every routed expert, one at a time, packed by `method` under its per-expert hub names."""
    g, u, d = names.expert_projs
    I = cfg.moe_intermediate_size
    for layer in source.layers:
        prefix = source.moe_prefix(layer, names)
        for j in range(cfg.num_experts):
            w = source.read(layer, j)
            weights = {
                f"{g}.weight": w["gate_up"][:I].float(),
                f"{u}.weight": w["gate_up"][I:].float(),
                f"{d}.weight": w["down"].float(),
            }
            for key, t in method.pack(weights).items():
                shards.put(f"{prefix}.experts.{j}.{key}", t)
        if progress:
            print(f"quantized layer {layer}", flush=True)


class _Shards:
    """Tensors written in order into shards of at most SHARD_BYTES (a larger tensor alone in one):
    model-0000i.partial.safetensors while writing, renamed and indexed by close()."""

    def __init__(self, dst: Path):
        self.dst = dst
        self.shards: list[dict[str, torch.Tensor]] = [{}]
        self.size = 0

    def put(self, name: str, t: torch.Tensor) -> None:
        if self.size + t.nbytes > SHARD_BYTES and self.shards[-1]:
            _flush(self.shards, self.dst)
            self.shards.append({})
            self.size = 0
        self.shards[-1][name] = t.contiguous()
        self.size += t.nbytes

    def close(self) -> None:
        _flush(self.shards, self.dst)
        _write_index(self.dst, len(self.shards))


def _copy_other_files(src: Path, dst: Path) -> None:
    """The model directory's other files (tokenizer, generation config), but not the demo's manifest,
    which lists the source files' hashes: it would be wrong for the quantized copy."""
    for f in src.iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name not in ("config.json", "model.safetensors.index.json", "expertcache_demo.json")
        ):
            shutil.copy2(f, dst / f.name)


def _expert_names(index: TensorIndex, layer: int, names, num_experts: int) -> list[str]:
    out = []
    for p in names.moe_prefixes:
        base = f"model.layers.{layer}.{p}.experts"
        out += [n for n in (f"{base}.gate_up_proj", f"{base}.down_proj") if n in index]
        out += [
            f"{base}.{j}.{proj}.weight"
            for j in range(num_experts)
            for proj in names.expert_projs
            if f"{base}.{j}.{proj}.weight" in index
        ]
    return out


def _flush(shards: list[dict], dst: Path) -> None:
    i = len(shards)
    write_safetensors(shards[-1], dst / f"model-{i:05d}.partial.safetensors", metadata={"format": "pt"})


def _write_index(dst: Path, n: int) -> None:
    weight_map, total = {}, 0
    for i in range(1, n + 1):
        tmp = dst / f"model-{i:05d}.partial.safetensors"
        final = dst / f"model-{i:05d}-of-{n:05d}.safetensors"
        tmp.rename(final)
        header, _ = read_header(final)
        for name, h in header.items():
            if name != "__metadata__":
                weight_map[name] = final.name
                total += h["data_offsets"][1] - h["data_offsets"][0]
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
