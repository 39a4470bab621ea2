"""One request's state inside the engine."""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from .params import SamplingParams

_ids = itertools.count()


class Sequence:
    """tokens = prompt + generated; KV is computed for tokens[:num_computed].

    A request with n > 1 is a group: sample 0 is admitted alone and, once its prompt is computed,
    forks n - 1 siblings that share its KV blocks (`fork`); all carry the group's request_id and
    their own `index`, params (seed + index) and grammar matcher.
    """

    def __init__(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, index: int = 0
    ):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.index = index
        self.pending_forks = params.n - 1 if index == 0 else 0
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
        self.matcher = params.structured.matcher() if params.structured is not None else None
        self.cumulative_logprob = 0.0
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = None  # filled during prefill when params.prompt_logprobs is set
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.prompt_len

    def fork(self, index: int) -> "Sequence":
        """Sample `index` of this group, at the same point (prompt computed), sharing nothing yet:
        the caller shares the KV blocks (ref counts) and schedules it."""
        p = self.params
        seed = None if p.seed is None else (p.seed + index) % 2**63
        child = Sequence(self.tokens[: self.prompt_len], replace(p, n=1, seed=seed), self.request_id, index)
        child.num_computed, child.num_cached, child.high_water = (
            self.num_computed,
            self.num_cached,
            self.prompt_len,
        )
        child.admitted = True
        child.prompt_logprobs = self.prompt_logprobs
        return child

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def phase(self) -> str:
        return "prefill" if self.num_computed < self.prompt_len else "decode"
