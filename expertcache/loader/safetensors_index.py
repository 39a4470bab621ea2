"""Tensor index of a checkpoint, read from safetensors headers only.

A safetensors file is: u64 little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}}, then the data; offsets are
relative to the end of the header. `TensorIndex` maps every tensor name of a
model directory (single file or shards listed by model.safetensors.index.json)
to its file and absolute byte range, so the expert tiers can read one expert
with one pread and `plan` can size a model without touching its weights.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import hostmem
from ..errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in `file`
    nbytes: int


def read_header(path: Path) -> tuple[dict, int]:
    """Return (header dict, absolute offset of the data section) of one file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100 << 20:
                raise CheckpointError(
                    f"{path}: truncated or corrupt safetensors header (length {n}, file {size} bytes)"
                )
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"missing safetensors file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    return header, 8 + n


def shard_name(index: Path, name: str) -> str:
    """A shard file named by model.safetensors.index.json: a relative path inside the checkpoint
    directory (no absolute path, no `..`), so an index cannot make the engine read a file elsewhere.
    (Not resolved through symlinks: a hub-cache snapshot's shards are links into its blobs/.)"""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or "\0" in name:
        raise CheckpointError(
            f"{index}: shard file {name!r} is outside the checkpoint directory "
            "(shard names must be relative paths inside it)"
        )
    return name


class TensorIndex:
    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        for path in self._files():
            header, data_start = read_header(path)
            size = path.stat().st_size
            self.metadata.update(header.pop("__metadata__", None) or {})
            for name, h in header.items():
                if h["dtype"] not in DTYPES:
                    raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {h['dtype']}")
                begin, end = h["data_offsets"]
                dtype, shape = DTYPES[h["dtype"]], tuple(h["shape"])
                if end - begin != math.prod(shape) * dtype.itemsize:
                    raise CheckpointError(
                        f"{path}: tensor {name} byte range does not match shape {list(shape)}"
                    )
                if data_start + end > size:
                    raise CheckpointError(
                        f"{path}: truncated safetensors file (tensor {name} ends at byte "
                        f"{data_start + end}, file has {size})"
                    )
                self.tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, end - begin)

    def _files(self) -> list[Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: invalid shard index ({e!r})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map must be an object of tensor name -> shard file")
            bad = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
            if bad is not None:
                raise CheckpointError(
                    f"{index}: weight_map[{bad!r}] is {weight_map[bad]!r}, not a shard file name"
                )
            return [self.model_dir / shard_name(index, f) for f in sorted(set(weight_map.values()))]
        single = self.model_dir / "model.safetensors"
        if single.exists():
            return [single]
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.model_dir}: no model.safetensors or model.safetensors.index.json")
        return files

    def rename(self, fn) -> None:
        """Index the tensors under fn(checkpoint name) (None: leave the tensor out); a family whose
        checkpoints nest the decoder (e.g. `model.language_model.*`) maps them to `model.*`."""
        renamed = {}
        for name, t in self.tensors.items():
            new = fn(name)
            if new is not None:
                renamed[new] = t if new == name else replace(t, name=new)
        self.tensors = renamed

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.model_dir}: missing tensor {name}")
        if shape is not None and tuple(shape) != t.shape:
            raise CheckpointError(
                f"{t.file.name}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}"
            )
        return t

    def load(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor (its stored dtype) into a new CPU tensor."""
        t = self.info(name, shape)
        if not t.nbytes:
            return torch.empty(t.shape, dtype=t.dtype)
        buf = hostmem.empty((t.nbytes,))  # a large weight on huge pages: streamed faster per token
        with open(t.file, "rb", buffering=0) as f:
            f.seek(t.offset)
            f.readinto(buf.numpy())
        return buf.view(t.dtype).reshape(t.shape)

    def drop(self, names) -> None:
        """Forget tensors the model never reads (they are then absent: `in`, info, nbytes)."""
        for n in names:
            del self.tensors[n]

    def nbytes(self, prefix: str = "") -> int:
        return sum(t.nbytes for n, t in self.tensors.items() if n.startswith(prefix))
