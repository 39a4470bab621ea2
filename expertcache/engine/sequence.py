"""One request's state inside the engine."""

from __future__ import annotations

import itertools

import torch

from .params import SamplingParams

_ids = itertools.count()


class Sequence:
    """tokens = prompt + generated; KV is computed for tokens[:num_computed]."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt_len = len(prompt_ids)
        self.tokens = list(prompt_ids)
        self.params = params
        self.block_ids: list[int] = []
        self.state_slot: int | None = None  # linear-attention state (engine/state_cache.py), hybrid models
        self.num_computed = 0
        self.num_cached = 0  # prompt tokens served by the prefix cache (first admission)
        self.high_water = 0  # prompt tokens ever computed or served from cache (counters)
        self.admitted = False
        self.finish_reason: str | None = None
        self.text = ""
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def phase(self) -> str:
        return "prefill" if self.num_computed < self.prompt_len else "decode"
