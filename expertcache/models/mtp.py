"""Multi-token-prediction (MTP / "nextn") layers: stored after the decoder's last layer
(`model.layers.{num_hidden_layers + k}.*` for k < num_nextn_predict_layers, DeepSeek-V3, GLM-4.5,
GLM-4.7-Flash) and used only for speculative decoding, which the engine does not do. They never
change generated tokens, so they are dropped from the tensor index (never read, not counted in any
budget or plan) with a printed note. Layers beyond those the config declares stay in the index
(loader/checks.check_layer_count refuses them).
"""

from __future__ import annotations

import re
import sys

from ..loader.safetensors_index import TensorIndex
from ..spec.model_config import ModelConfig
from ..units import fmt_bytes

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def drop_mtp_layers(index: TensorIndex, cfg: ModelConfig, hf: dict) -> list[int]:
    """Remove the tensors of the declared MTP layers from `index`; returns those layer numbers."""
    declared = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
    mtp = range(cfg.num_layers, cfg.num_layers + int(declared))
    extra: dict[int, list[str]] = {}
    for name in index.tensors:
        m = _LAYER.match(name)
        if m and int(m[1]) in mtp:
            extra.setdefault(int(m[1]), []).append(name)
    if not extra:
        return []
    names = [n for ns in extra.values() for n in ns]
    nbytes = sum(index.info(n).nbytes for n in names)
    index.drop(names)
    layers = sorted(extra)
    print(
        f"note: ignoring {len(layers)} multi-token-prediction layer(s) in the checkpoint: "
        f"model.layers.{{{','.join(map(str, layers))}}}.* ({len(names)} tensors, {fmt_bytes(nbytes)}); "
        "generation does not use them, they are not read",
        file=sys.stderr,
    )
    return layers
