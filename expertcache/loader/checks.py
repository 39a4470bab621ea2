"""Checks that a checkpoint's tensors are what its config.json says, before they are trusted.

- `check_layer_count`: config.json's num_hidden_layers equals the layers the tensors hold
  (extra layers are an error, not silently ignored; missing ones fail on their first tensor).
- `check_dense`: a dense weight is floating point (integer codes only exist as the documented
  parts of a quantized expert layout, checked by experts/layout.py) and, unless turned off,
  holds no NaN or inf. The tensor was read anyway; the scan is one pass over it.
- `nonfinite_parts`: which floating tensors of a dict hold NaN/inf (the per-expert check).
"""

from __future__ import annotations

import re

import torch

from ..errors import CheckpointError, ConfigError
from .safetensors_index import TensorIndex

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SKIP_HINT = "--no-check-finite (check_finite=False) loads it anyway"


def check_layer_count(index: TensorIndex, num_layers: int) -> None:
    found = {int(m.group(1)) for name in index.tensors if (m := LAYER.match(name))}
    if found and max(found) >= num_layers:
        raise ConfigError(
            f"config.json: num_hidden_layers={num_layers}, but {index.model_dir} holds tensors for "
            f"{max(found) + 1} layers (model.layers.0 .. model.layers.{max(found)}); "
            "a config that drops layers would silently run another model"
        )


FINITE_CHUNK = (
    1 << 22
)  # elements scanned at a time: isfinite's temporaries stay a few MiB, not the tensor's size


def is_finite(t: torch.Tensor) -> bool:
    """t holds no NaN or inf. Scanned in chunks: torch.isfinite of a whole lm_head (311 MB in bf16) made
    ~600 MB of temporaries, which broke `--low-memory` under a 1.5 GiB memory limit."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    flat = t.reshape(-1)
    fp8 = t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    for i in range(0, flat.numel(), FINITE_CHUNK):
        part = flat[i : i + FINITE_CHUNK]
        if fp8:
            part = part.to(torch.float16)  # exact; isfinite has no float8 kernel
        if not bool(torch.isfinite(part).all()):
            return False
    return True


def check_dense(index: TensorIndex, name: str, t: torch.Tensor, check_finite: bool = True) -> None:
    """t is the dense weight `name` as loaded (dequantized when stored as fp8)."""
    info = index.info(name)
    if not info.dtype.is_floating_point:
        raise CheckpointError(
            f"{info.file.name}: tensor {name} is stored as {str(info.dtype).replace('torch.', '')}; "
            "dense weights must be floating point (bf16, f16, f32 or fp8 with a scale)"
        )
    if check_finite and not is_finite(t):
        raise CheckpointError(
            f"{info.file.name}: tensor {name} holds non-finite values (NaN or inf); {SKIP_HINT}"
        )


def nonfinite_parts(parts: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in parts.items() if not is_finite(t)]
