"""The token embedding: where its table lives, decided once for the model and the device plan.

Shapes: V = vocab, H = hidden size, T = tokens.

`on_disk`: under --low-memory on a CPU device, an embedding not tied to lm_head and stored as a plain
float tensor stays in the checkpoint; a step reads its tokens' rows (loader/rows.py `RowReader`). Tied,
lm_head needs the whole table in memory anyway. models/transformer.py builds the embedding from this
decision and build/plan.py `dense_bytes` leaves the table out of the dense term by it.

Both kinds gather with one call, `rows(ids [T]) -> [T, H]` in the held dtype: `Table` (resident) or
`RowReader` (on disk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..loader.rows import readable
from ..loader.safetensors_index import TensorIndex
from ..spec.model_config import ModelConfig

EMBED = "model.embed_tokens.weight"


def tied(cfg: ModelConfig, index: TensorIndex) -> bool:
    """lm_head is the embedding table (tie_word_embeddings and no lm_head.weight of its own)."""
    return cfg.tie_word_embeddings and "lm_head.weight" not in index


def on_disk(cfg: ModelConfig, index: TensorIndex, device: torch.device, low_memory: bool) -> bool:
    """The embedding's rows are read from the checkpoint per step instead of held (see the docstring)."""
    return (
        low_memory
        and torch.device(device).type == "cpu"
        and not tied(cfg, index)
        and EMBED in index
        and readable(index.info(EMBED))
    )


class Table:
    """A resident embedding table [V, H]: rows(ids [T]) -> [T, H] in the table's dtype."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table)
