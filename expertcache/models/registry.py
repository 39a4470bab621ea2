"""Maps config.json "architectures" to a model family: `read_config`, `open_index`.

A family (models/family.py) knows two things: how to read its config.json into a ModelConfig and
how its tensors are named; models/families.py loads them all. The forward pass
(models/transformer.py) is shared.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..errors import ConfigError
from ..spec.model_config import ModelConfig
from . import families  # noqa: F401  (registers every family)
from .family import FAMILIES, Family


def open_index(model_dir: str | Path, family: Family):
    """The checkpoint's tensor index under the names the decoder reads (family.tensor_names); a GGUF
    file's tensors under the same names (gguf/index.py)."""
    from ..loader.safetensors_index import TensorIndex

    if Path(model_dir).suffix == ".gguf":
        from .. import gguf

        return gguf.open_index(model_dir, family.names.expert_projs)

    index = TensorIndex(model_dir)
    if family.tensor_names is not None:
        index.rename(family.tensor_names)
    return index


def read_config(model_dir: str | Path) -> tuple[Family, ModelConfig, dict]:
    """Parse model_dir/config.json (+ generation_config.json) into (family, ModelConfig, raw dict)."""
    if Path(model_dir).suffix == ".gguf":  # the config rebuilt from the file's metadata
        from .. import gguf

        arch, hf = gguf.read_config(model_dir)
        family = FAMILIES[hf["architectures"][0]]
        if arch.weight_names:  # how the GGUF index serves the experts (e.g. gate_up not interleaved)
            family = replace(family, names=replace(family.names, **dict(arch.weight_names)))
        return family, _parse_gguf(family, hf, model_dir), hf
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    archs = hf.get("architectures") or []
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    if family is None:
        raise ConfigError(
            f"{path}: unsupported architecture {archs or hf.get('model_type')!r}; "
            f"supported: {sorted(FAMILIES)}"
        )
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        try:
            g = json.loads(gen.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{gen}: invalid JSON ({e})") from None
        if g.get("eos_token_id") is not None:
            hf = {**hf, "eos_token_id": g["eos_token_id"]}
    return family, family.parse(hf), hf


def _parse_gguf(family: Family, hf: dict, path) -> ModelConfig:
    """family.parse on a config rebuilt from GGUF metadata; its errors name the file, not config.json."""
    try:
        return family.parse(hf)
    except ConfigError as e:
        raise ConfigError(str(e).replace("config.json", f"{Path(path).name} (GGUF metadata)", 1)) from None
