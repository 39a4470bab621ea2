"""The token embedding: where its table lives, decided once for the model and the device plan.

Shapes: V = vocab, H = hidden size, T = tokens.

`on_disk`: under --low-memory on a CPU device, an embedding not tied to lm_head and stored as a plain
float tensor, or as a GGUF file's rows of blocks (decoded after the read), stays in the checkpoint; a
step reads its tokens' rows (loader/rows.py `RowReader`). Tied, lm_head needs the whole table in memory
anyway. build/fill.py builds the embedding from this decision and build/plan.py `dense_bytes` leaves
the table out of the dense term by it.

`held_blocks`: else, on a CPU device, a GGUF table stored in a block type (Q4_0, Q4_K, Q6_K, Q8_0, ...)
is held as the file's blocks, uint8 [V, row bytes] (`BlockTable`), and a step decodes only its tokens'
rows: Qwen3-30B-A3B's 151936 x 2048 table is 175 MB of Q4_0 blocks, 1.24 GB as float32. Tied, lm_head
reads the same blocks through the block kernels where its type has one (the rule build/plan.py
`file_blocks` applies to an lm_head of its own); a tied table in a type without a kernel stays a float
table (lm_head needs it) unless `--lm-head` packs lm_head's own copy. On CUDA the table is dequantized
at load as before. `dense_bytes` counts a table held so at its file bytes.

Every kind gathers with one call, `rows(ids [T]) -> [T, H]` in the held dtype (float32 for blocks):
`Table` (resident), `BlockTable` (resident blocks) or `RowReader` (on disk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..loader.rows import readable
from ..loader.safetensors_index import TensorIndex
from ..quant.ggml import decode
from ..quant.ggml_blocks import BY_NAME
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


def held_blocks(
    cfg: ModelConfig,
    index: TensorIndex,
    device: torch.device,
    low_memory: bool = False,
    lm_head: str | None = None,
) -> str | None:
    """The ggml type of the GGUF blocks the table is held in (`BlockTable`), else None: on disk
    (`on_disk`) or a float table (see the docstring; `lm_head`: the --lm-head format, None when lm_head
    is not requantized)."""
    block_type = getattr(index, "block_type", None)
    if torch.device(device).type != "cpu" or block_type is None or block_type(EMBED) is None:
        return None
    if on_disk(cfg, index, device, low_memory):
        return None
    if tied(cfg, index) and lm_head is None and index.block_method(EMBED) is None:
        return None  # lm_head is the table and no kernel reads these blocks: a float table
    return block_type(EMBED)


class Table:
    """A resident embedding table [V, H]: rows(ids [T]) -> [T, H] in the table's dtype."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table)


class BlockTable:
    """A resident table held as its GGUF file's blocks, uint8 [V, row bytes] (a row of blocks per token):
    rows(ids [T]) -> [T, H] float32, only those rows decoded (quant/ggml.py `decode`)."""

    def __init__(self, blocks: torch.Tensor, type_name: str, hidden_size: int):
        self.blocks, self.type_name, self.hidden_size = blocks, type_name, hidden_size
        self.block_bytes = BY_NAME[type_name].block_bytes

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        picked = self.blocks.index_select(0, ids.reshape(-1))  # [T, row bytes]
        out = decode(self.type_name, picked.view(-1, self.block_bytes))  # [T x blocks a row, block]
        return out.view(*ids.shape, self.hidden_size)
