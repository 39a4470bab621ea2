"""A model family and the table of them: `Family` (how a config.json reads into a ModelConfig and how
the family's tensors are named), `FAMILIES` (config.json architecture -> family) and `register`.

Each family module registers itself here on import; models/families.py imports them all and
models/registry.py (read_config) imports that, so the family modules never import the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..spec.model_config import ModelConfig
from ..spec.weights import WeightNames  # noqa: F401  (families import it from here)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    parse: Callable[[dict], ModelConfig]
    names: WeightNames
    # checkpoint tensor name -> the name the decoder reads (None: not used, e.g. a vision tower);
    # None = names as stored
    tensor_names: Callable[[str], str | None] | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for arch in family.architectures:
        FAMILIES[arch] = family
    return family
