"""Multi-token-prediction (MTP / "nextn") layers: stored after the decoder's last layer
(`model.layers.{num_hidden_layers + k}.*`, DeepSeek-V3, GLM-4.5, GLM-4.7-Flash) and used only for
speculative decoding, which the engine does not do. They never change generated tokens, so they are
dropped from the tensor index (never read, not counted in any budget or plan) with a printed note.
"""

from __future__ import annotations

import re
import sys

from ..loader.safetensors_index import TensorIndex
from ..units import fmt_bytes
from .model_config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def drop_mtp_layers(index: TensorIndex, cfg: ModelConfig, hf: dict, quiet: bool = False) -> list[int]:
    """Remove the tensors of layers >= cfg.num_layers from `index`; returns those layer numbers."""
    extra: dict[int, list[str]] = {}
    for name in index.tensors:
        m = _LAYER.match(name)
        if m and int(m[1]) >= cfg.num_layers:
            extra.setdefault(int(m[1]), []).append(name)
    if not extra:
        return []
    names = [n for ns in extra.values() for n in ns]
    nbytes = sum(index.info(n).nbytes for n in names)
    index.drop(names)
    layers = sorted(extra)
    if not quiet:
        declared = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers"))
        what = (f"{len(layers)} multi-token-prediction layer(s)" if declared else
                f"{len(layers)} layer(s) beyond num_hidden_layers={cfg.num_layers}")
        print(f"note: ignoring {what} in the checkpoint: model.layers.{{{','.join(map(str, layers))}}}.* "
              f"({len(names)} tensors, {fmt_bytes(nbytes)}); generation does not use them, they are not read",
              file=sys.stderr)
    return layers
