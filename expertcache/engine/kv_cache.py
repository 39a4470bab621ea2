"""Paged KV cache: fixed-size blocks, per-sequence block tables, prefix reuse by hash chain.

Invariants:
- a block is either free (ref_count 0, in `free`) or referenced by >= 1 sequence;
- a *full* block may carry a hash of (previous block's hash, its tokens); equal hash and
  tokens means equal KV content, so a new sequence whose prompt starts with the same
  full blocks reuses them instead of recomputing (SGLang/vLLM prefix caching);
- a freed block keeps its hash until it is handed out again, so a later request can still
  hit it (LRU order of reuse: the free list is a deque, freed blocks go to the back);
- a block referenced by more than one sequence (a prefix hit, or the samples of an n > 1
  request) is never written: a sequence about to write into one first takes a private copy
  (`copy_on_write`), so siblings share their prompt's blocks up to the first divergent one.
"""

from __future__ import annotations

import math
from collections import deque

import torch

DEFAULT_MAX_MODEL_LEN = 4096  # the context cap when max_model_len is not given
AUTO_KV_BYTES = 1 << 30  # --kv-cache-memory auto: at most this much, unless one sequence needs more


def default_max_model_len(max_position_embeddings: int) -> int:
    return min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def auto_kv_blocks(max_model_len: int, max_num_seqs: int, bytes_per_block: int, block_size: int) -> int:
    """Blocks of --kv-cache-memory auto: max_num_seqs full-length sequences, capped at AUTO_KV_BYTES but
    never fewer than one full-length sequence (used by LLM and by `expertcache plan`)."""
    min_blocks = math.ceil(max_model_len / block_size)
    return min(min_blocks * max_num_seqs, max(min_blocks, AUTO_KV_BYTES // bytes_per_block))


class Block:
    __slots__ = ("id", "ref_count", "hash", "tokens")

    def __init__(self, i: int):
        self.id, self.ref_count, self.hash, self.tokens = i, 0, None, None


class KVCache:
    """token_shapes: per layer and token, the shape of each tensor the attention stores (ModelConfig.
    kv_token_shapes: ((g, D), (g, D)) for keys and values, ((R + P,),) for an MLA latent). Layer l's
    tensors are `tensors[l]`, each [num_blocks, block_size, *shape]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        token_shapes: tuple[tuple[int, ...], ...],
        dtype: torch.dtype,
        device: torch.device,
        prefix_caching: bool = True,
        alloc=None,
    ):
        """`alloc(shape, dtype)`: how the zeroed blocks are allocated (construction's ledger; default torch.zeros)."""
        if num_blocks < 1:
            raise ValueError("KV cache needs at least one block")
        alloc = alloc or (lambda shape, dt: torch.zeros(shape, dtype=dt, device=device))
        self.tensors = [
            tuple(alloc((num_blocks, block_size, *s), dtype) for s in token_shapes) for _ in range(num_layers)
        ]
        self.block_size, self.num_blocks, self.prefix_caching = block_size, num_blocks, prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))
        self.by_hash: dict[int, int] = {}
        self.prefix_queries = self.prefix_hits = 0  # in tokens
        self.copied: list[tuple[int, int]] | None = None  # (src, dst) block copies, when someone mirrors them

    @staticmethod
    def bytes_per_block(num_layers, block_size, token_shapes: tuple[tuple[int, ...], ...], dtype) -> int:
        return num_layers * block_size * sum(math.prod(s) for s in token_shapes) * dtype.itemsize

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def _take(self) -> int:
        b = self.blocks[self.free.popleft()]
        if b.hash is not None and self.by_hash.get(b.hash) == b.id:
            del self.by_hash[b.hash]
        b.hash, b.tokens, b.ref_count = None, None, 1
        return b.id

    def _chain(self, prev: int | None, tokens: tuple[int, ...]) -> int:
        return hash((prev, tokens))

    def match_prefix(self, tokens: list[int]) -> list[int]:
        """Blocks already holding the longest run of full blocks of `tokens` (not yet referenced)."""
        if not self.prefix_caching:
            return []
        out, prev, bs = [], None, self.block_size
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = self._chain(prev, chunk)
            bid = self.by_hash.get(h)
            if bid is None or self.blocks[bid].tokens != chunk:
                break
            out.append(bid)
            prev = h
        return out

    def acquire(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_count == 0:
                self.free.remove(bid)
            b.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"KV cache: need {n} blocks, {len(self.free)} free")
        return [self._take() for _ in range(n)]

    def is_shared(self, bid: int) -> bool:
        return self.blocks[bid].ref_count > 1

    def copy_on_write(self, bid: int) -> int:
        """A private copy of shared block `bid` (its KV in every layer); the caller's reference
        moves from `bid` to the copy. Needs one free block."""
        new = self.allocate(1)[0]
        self.copy_block(bid, new)
        if self.copied is not None:
            self.copied.append((bid, new))
        self.release([bid])
        return new

    def copy_block(self, src: int, dst: int) -> None:
        for layer in self.tensors:
            for t in layer:
                t[dst].copy_(t[src])

    def release(self, block_ids: list[int]) -> None:
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            b.ref_count -= 1
            assert b.ref_count >= 0, f"block {bid} released twice"
            if b.ref_count == 0:
                self.free.append(bid)

    def forget(self, block_ids: list[int]) -> None:
        """Drop the prefix hashes of blocks only this sequence holds (their content is not to be
        reused, e.g. a failed sequence's non-finite KV); shared blocks keep theirs."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_count == 1 and b.hash is not None:
                if self.by_hash.get(b.hash) == bid:
                    del self.by_hash[b.hash]
                b.hash, b.tokens = None, None

    def seal(self, block_ids: list[int], tokens: list[int]) -> None:
        """Register hashes for the full blocks of a sequence (tokens whose KV is computed)."""
        if not self.prefix_caching:
            return
        prev, bs = None, self.block_size
        for i in range(min(len(tokens) // bs, len(block_ids))):
            b = self.blocks[block_ids[i]]
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            if b.hash is None:
                b.hash, b.tokens = self._chain(prev, chunk), chunk
                self.by_hash.setdefault(b.hash, b.id)
            prev = b.hash
