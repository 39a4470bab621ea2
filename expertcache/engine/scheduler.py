"""Continuous batching with chunked prefill and preemption by recomputation.

Each step picks work under a token budget (max_num_batched_tokens):
1. running sequences first, oldest first: each takes its uncomputed tokens (1 for a
   decode, a chunk for a prefill in progress); if the KV cache cannot hold them, the
   newest running sequence is preempted (blocks freed, recomputed later);
2. then waiting sequences join while the budget, max_num_seqs and free blocks allow;
   a joining sequence first reuses cached prefix blocks.
A long prompt is split into chunks, so running decodes are never stalled by it.
Hybrid models also give each scheduled sequence a slot of the state cache (with its first
blocks); it is freed with the blocks, so a preempted sequence recomputes its state from token 0.
A request with n > 1 joins only when its n samples fit under max_num_seqs; its siblings are
forked by the engine once the prompt is computed and then run like any other sequence.
A sequence that asks for prompt logprobs skips the prefix cache (its prompt is recomputed, so
every prompt token has logits); the prompt tokens that need logits in one step are at most
`max_logits_rows` (the device plan's bound on a step's logits; default: the token budget).
"""

from __future__ import annotations

from collections import deque

from .kv_cache import KVCache
from .sequence import Sequence
from .state_cache import StateCache


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        states: StateCache | None = None,
        max_logits_rows: int | None = None,
    ):
        self.kv, self.max_num_seqs, self.budget = kv, max_num_seqs, max_num_batched_tokens
        self.max_logits_rows = max_logits_rows or max_num_batched_tokens
        self.states = states
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, seq: Sequence, upto: int) -> int:
        return max(0, -(-upto // self.kv.block_size) - len(seq.block_ids))

    def grow(self, seq: Sequence, upto: int) -> bool:
        """Blocks for tokens[:upto], the ones about to be written private (copy-on-write)."""
        need = self._blocks_needed(seq, upto)
        bs = self.kv.block_size
        shared = [
            i
            for i in range(seq.num_computed // bs, min(len(seq.block_ids), -(-upto // bs)))
            if self.kv.is_shared(seq.block_ids[i])
        ]
        if need + len(shared) > self.kv.num_free:
            return False
        if self.states is not None and seq.state_slot is None:
            if not self.states.num_free:
                return False
            seq.state_slot = self.states.allocate()
        for i in shared:
            seq.block_ids[i] = self.kv.copy_on_write(seq.block_ids[i])
        seq.block_ids += self.kv.allocate(need)
        return True

    def free(self, seq: Sequence) -> None:
        self.kv.release(seq.block_ids)
        seq.block_ids = []
        if seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        """-> [(sequence, number of tokens to compute this step)]."""
        batch, budget, logits_rows = [], self.budget, self.max_logits_rows
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            n = min(seq.num_uncomputed, budget)
            if self.needs_logits(seq):
                if logits_rows == 0:
                    continue
                n = min(n, logits_rows)
            while not self.grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                batch.append((seq, n))
                budget -= n
                logits_rows -= n if self.needs_logits(seq) else 0
        while (
            self.waiting
            and budget > 0
            and len(self.running) + 1 + self.waiting[0].pending_forks <= self.max_num_seqs
        ):
            seq = self.waiting[0]
            if not seq.block_ids:
                self.attach_cached_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if self.needs_logits(seq):
                if logits_rows == 0:
                    break
                n = min(n, logits_rows)
            if not self.grow(seq, seq.num_computed + n):
                if not self.running and not batch:
                    # nothing else holds blocks: the request can never fit
                    self.waiting.popleft()
                    self.free(seq)
                    seq.finish_reason = "error: prompt does not fit in the KV cache"
                    batch.append((seq, 0))
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
            logits_rows -= n if self.needs_logits(seq) else 0
        return batch

    def attach_cached_prefix(self, seq: Sequence) -> None:
        """A waiting sequence without blocks takes the prefix-cache blocks that match its prompt (none when
        it asks for prompt logprobs, which need every prompt position computed)."""
        cached = (
            []
            if seq.params.prompt_logprobs is not None
            else self.kv.match_prefix(seq.tokens[: len(seq.tokens) - 1])
        )
        self.kv.acquire(cached)
        seq.block_ids = cached
        seq.num_computed = len(cached) * self.kv.block_size
        if not seq.admitted:  # a preempted sequence coming back is not a new query
            seq.admitted = True
            self.kv.prefix_queries += len(seq.tokens)
            self.kv.prefix_hits += seq.num_computed
            seq.num_cached = seq.num_computed
            seq.high_water = min(seq.num_computed, seq.prompt_len)

    @staticmethod
    def needs_logits(seq: Sequence) -> bool:
        """Every new token of this sequence needs its logits (prompt logprobs, still in the prompt)."""
        return seq.prompt_logprobs is not None and seq.num_computed < seq.prompt_len

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)
