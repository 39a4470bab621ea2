"""Per-sequence recurrent state of the linear-attention layers, beside the paged KV cache.

A hybrid model's Gated DeltaNet layers keep, per sequence, a conv state [K-1, C] (model dtype)
and a recurrent state [Hv, Dk, Dv] (float32): a fixed size, independent of the context length.
The pool holds `num_slots` of them for every linear-attention layer, allocated up front.

Invariants:
- a slot is free (in `free`) or owned by exactly one sequence (`Sequence.state_slot`);
- a slot handed out by `allocate` is zeroed: it is the state before the first token (`fork`
  hands out a copy of another slot instead: n > 1 samples of one prompt);
- the state of a slot reflects exactly the tokens tokens[:num_computed] of its sequence, so a
  sequence that loses its slot (preemption frees it) restarts from token 0 (recomputation), and
  prefix reuse of KV blocks alone cannot resume it (the engine turns prefix caching off).
"""

from __future__ import annotations

import torch

from ..layers.gated_deltanet import StateBatch

__all__ = ["StateBatch", "StateCache"]
from ..spec.model_config import ModelConfig


class StateCache:
    def __init__(
        self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device, alloc=None
    ):
        """`alloc(shape, dtype)`: how the zeroed states are allocated (construction's ledger; default torch.zeros)."""
        la = cfg.linear_attn
        alloc = alloc or (lambda shape, dt: torch.zeros(shape, dtype=dt, device=device))
        if la is None:
            raise ValueError("StateCache: the model has no linear-attention layers")
        if num_slots < 1:
            raise ValueError("StateCache needs at least one slot")
        self.num_slots = num_slots
        self.layers = {
            i: (
                alloc((num_slots, la.conv_kernel - 1, la.conv_dim), dtype),
                alloc((num_slots, la.num_v_heads, la.k_head_dim, la.v_head_dim), torch.float32),
            )
            for i in range(cfg.num_layers)
            if la.layers[i]
        }
        self.free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_sequence(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Conv + recurrent state of one sequence over all linear-attention layers (0 for a model without)."""
        la = cfg.linear_attn
        if la is None:
            return 0
        per_layer = (
            la.conv_kernel - 1
        ) * la.conv_dim * dtype.itemsize + la.num_v_heads * la.k_head_dim * la.v_head_dim * 4
        return sum(la.layers) * per_layer

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise MemoryError(f"state cache: all {self.num_slots} slots in use")
        slot = self.free.pop()
        for conv, rec in self.layers.values():
            conv[slot].zero_()
            rec[slot].zero_()
        return slot

    def fork(self, slot: int) -> int:
        """A new slot holding a copy of `slot`'s states (a sibling sample of the same prompt)."""
        new = self.allocate()
        for conv, rec in self.layers.values():
            conv[new] = conv[slot]
            rec[new] = rec[slot]
        return new

    def release(self, slot: int) -> None:
        assert slot not in self.free, f"state slot {slot} released twice"
        self.free.append(slot)

    def batch(self, slots: list[int], lengths: list[int], device: torch.device) -> StateBatch:
        return StateBatch(
            torch.tensor(slots, dtype=torch.int64, device=device),
            torch.tensor(lengths, dtype=torch.int64, device=device),
            self.layers,
            tuple(lengths),
        )
