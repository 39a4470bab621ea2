"""`ParallelRunner`: rank 0's batches mirrored on every rank of the expert-parallel group.

Rank 0 builds each step's batch as the single-process runner does; its `forward` (the runner's
one call into the model) broadcasts
("forward", input_ids, AttnBatch, control) before running it (control: a new placement, the
KV block copies rank 0's scheduler made since the last step, whether to gather stats); ranks 1..N-1 sit in
`serve_worker()`, run the same forward on their own copy of the KV cache (same block ids:
rank 0's scheduler owns the block tables) and skip lm_head. Every STATS_EVERY steps the ranks
send their cache counters to rank 0 in-step; `refresh_stats` (LLM.expert_stats) asks for them now.
"""

from __future__ import annotations

import torch

from ..engine.runner import ModelRunner
from .experts import ExpertParallelExperts
from .group import EPGroup

STATS_EVERY = 16  # steps between per-rank counter gathers


class ParallelRunner(ModelRunner):
    def __init__(self, model, kv, group: EPGroup, experts: ExpertParallelExperts):
        super().__init__(model, kv)
        self.group, self.experts, self.steps = group, experts, 0
        self._refreshed = -1  # the step of the last refresh_stats
        group.ready()  # every rank has loaded its model: from here the steps' timeout applies
        if group.rank == 0:
            kv.copied = []  # copy-on-write block copies (n > 1 samples) are replayed on every rank

    def forward(self, ids, batch, rows, states=None) -> torch.Tensor:
        assert states is None, "hybrid linear-attention models are refused with expert parallelism (llm.py)"
        ctl = self.experts.control()
        self.steps += 1
        ctl["gather"] = self.steps % STATS_EVERY == 1
        ctl["copies"], self.kv.copied = self.kv.copied, []
        self.group.broadcast(("forward", ids.cpu(), _to(batch, "cpu"), ctl))
        return self._mirror(ids, batch, rows, ctl)

    def _mirror(self, ids, batch, rows, ctl):
        if self.group.rank:
            for src, dst in ctl["copies"]:
                self.kv.copy_block(src, dst)
        self.experts.apply(ctl)
        out = self.model.forward(ids, batch, self.kv.tensors, rows)
        if ctl.get("gather"):
            self.experts.gather_stats()
        return out

    def serve_worker(self) -> None:
        """Ranks 1..N-1: mirror rank 0's forwards until it says stop."""
        dev = self.model.device
        no_rows = torch.empty(0, dtype=torch.int64, device=dev)
        while True:
            msg = self.group.broadcast()
            if msg[0] == "stop":
                return
            if msg[0] == "stats":
                self.experts.gather_stats()
                continue
            _, ids, batch, ctl = msg
            self._mirror(ids.to(dev), _to(batch, dev), no_rows, ctl)

    def refresh_stats(self) -> None:
        """Rank 0, on the engine thread between steps: every rank's counters as of now (at most once
        per step; nothing once the group has failed)."""
        if self.group.failed or self._refreshed == self.steps:
            return
        self._refreshed = self.steps
        self.group.broadcast(("stats",))
        self.experts.gather_stats()

    def stop_workers(self) -> None:
        self.group.stopping = True  # before the message: a worker may exit before broadcast returns
        self.group.broadcast(("stop",))


def _to(batch, device):
    return type(batch)(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch))
