"""Turns a scheduled batch into tensors, runs the model, returns last-token logits."""

from __future__ import annotations

import torch

from ..layers.attention import AttnBatch
from ..models.transformer import MoETransformer
from .cuda_graphs import DecodeGraphs
from .kv_cache import KVCache
from .sequence import Sequence
from .state_cache import StateBatch, StateCache
from .warm_up import warm_up_moe


def build_batch(work: list[tuple[Sequence, int]], block_size: int, device: torch.device):
    """-> (input_ids [T], AttnBatch, rows of the last new token of each sequence [B]). Built as Python
    lists, one tensor each at the end (a tensor per sequence costs more than the lists at batch 8)."""
    ids, pos, slots, seq_of, row_of, tables, qpos, last = [], [], [], [], [], [], [], []
    max_q = max(n for _, n in work)
    max_blocks = max(len(s.block_ids) for s, _ in work)
    for b, (seq, n) in enumerate(work):
        start, blocks = seq.num_computed, seq.block_ids
        p = range(start, start + n)
        ids += seq.tokens[start : start + n]
        pos += p
        slots += [blocks[i // block_size] * block_size + i % block_size for i in p]
        seq_of += [b] * n
        row_of += range(n)
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        qpos.append([*p, *[0] * (max_q - n)])
        last.append(len(ids) - 1)

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    spans = tuple(
        (seq.num_computed, n) for seq, n in work
    )  # the torch attention's per-sequence view, no read
    batch = AttnBatch(t(pos), t(slots), t(tables), t(seq_of), t(row_of), max_q, t(qpos), spans)
    return t(ids), batch, t(last)


class ModelRunner:
    def __init__(
        self,
        model: MoETransformer,
        kv: KVCache,
        states: StateCache | None = None,
        cuda_graphs: bool = False,
        max_num_seqs: int = 16,
    ):
        """cuda_graphs: decode steps through DecodeGraphs (engine/cuda_graphs.py: a CUDA device only, where
        config.py refuses it on the CPU). On CUDA the Triton MoE kernels are compiled here (warm_up.py)."""
        self.model, self.kv, self.states = model, kv, states
        self.graphs = DecodeGraphs(model, kv, max_num_seqs) if cuda_graphs else None
        self.warm_calls = warm_up_moe(model)  # 0 on the CPU

    def forward(
        self, ids: torch.Tensor, batch: AttnBatch, rows: torch.Tensor | None, states: StateBatch | None = None
    ) -> torch.Tensor:
        """The one call into the model (expert-parallel rank 0 overrides it to mirror the batch)."""
        return self.model.forward(ids, batch, self.kv.tensors, rows, states)

    def _states(self, work: list[tuple[Sequence, int]]) -> StateBatch | None:
        """The batch's linear-attention state slots (hybrid models), in work order."""
        if self.states is None:
            return None
        return self.states.batch([s.state_slot for s, _ in work], [n for _, n in work], self.model.device)

    def run(self, work: list[tuple[Sequence, int]], all_logits: bool = False) -> torch.Tensor:
        """Compute KV for the scheduled tokens; -> logits [B, V] (last new token of each sequence),
        or [T, V] for every new token when all_logits."""
        ids, batch, last = build_batch(work, self.kv.block_size, self.model.device)
        return self.forward(ids, batch, None if all_logits else last, self._states(work))

    def run_rows(
        self, work: list[tuple[Sequence, int]], full: list[bool]
    ) -> tuple[torch.Tensor, list[range]]:
        """Like run, with every new token's logits for the sequences b where full[b] (prompt logprobs)
        and only the last one for the others; -> logits [R, V] and each sequence's rows (its last row
        is the next-token distribution)."""
        if self.graphs is not None and not any(full) and self.graphs.takes(work):
            return self.graphs.run(work), [range(b, b + 1) for b in range(len(work))]
        ids, batch, last = build_batch(work, self.kv.block_size, self.model.device)
        states = self._states(work)
        if not any(full):
            return self.forward(ids, batch, last, states), [range(b, b + 1) for b in range(len(work))]
        rows, spans = [], []
        for b, (_, n) in enumerate(work):
            end = int(last[b]) + 1
            start = end - n if full[b] else end - 1
            spans.append(range(len(rows), len(rows) + end - start))
            rows += range(start, end)
        index = torch.tensor(rows, dtype=torch.int64, device=self.model.device)
        return self.forward(ids, batch, index, states), spans
