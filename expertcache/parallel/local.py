"""A rank's own experts, all resident: only the experts the placement gives this rank.

Shape legend: S_l experts this rank holds in layer l, E logical experts
    pools[l] {part: [S_l, ...]}   slot_of[l] [E] int64 (-1 = not held here)

`prepare(owned)` builds the pools of a new placement on a background thread (experts already
held are copied from the current pools, the others read from the checkpoint) and `swap()`
makes them current at a step boundary; until then `forward` uses the old pools unchanged.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..experts.compute import moe_ffn
from ..experts.layout import ExpertSource
from ..experts.provider import ExpertProvider


class LocalExperts(ExpertProvider):
    def __init__(self, source: ExpertSource, device: torch.device, dtype: torch.dtype, owned: dict[int, list[int]],
                 progress=None):
        self.source, self.device, self.dtype, self.progress = source, device, dtype, progress
        self.parts = source.compute_parts(dtype, device)
        self.method, self.ffn = source.method, source.ffn
        self.pools, self.slot_of, self.disk_bytes = {}, {}, 0
        self.pools, self.slot_of, _ = self._build(owned, {}, {})
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ep-rearrange")
        self._next: Future | None = None

    def _build(self, owned, old_pools, old_slot_of):
        E, pools, slot_of, read = self.source.cfg.num_experts, {}, {}, 0
        for layer, experts in owned.items():
            pool = {p.name: torch.empty((len(experts), *p.shape), dtype=p.dtype, device=self.device)
                    for p in self.parts}
            where = torch.full((E,), -1, dtype=torch.int64)
            old = old_slot_of.get(layer)
            for s, e in enumerate(experts):
                if old is not None and old[e] >= 0:
                    for name, t in pool.items():
                        t[s].copy_(old_pools[layer][name][old[e]])
                else:
                    w = self.source.read(layer, e)
                    for name, t in pool.items():
                        t[s].copy_(w[name])
                    read += self.source.expert_nbytes
                    if self.progress:
                        self.progress(self.source.expert_nbytes)
                where[e] = s
            pools[layer], slot_of[layer] = pool, where.to(self.device)
        return pools, slot_of, read

    # -- rearrangement ------------------------------------------------------------------------------
    def prepare(self, owned: dict[int, list[int]]) -> None:
        self.progress = None
        self._next = self._pool.submit(self._build, owned, self.pools, self.slot_of)

    def ready(self) -> bool:
        return self._next is None or self._next.done()

    def swap(self) -> int:
        """Make the prepared pools current; -> bytes read from the checkpoint for them."""
        if self._next is None:
            return 0
        self.pools, self.slot_of, read = self._next.result()
        self._next = None
        self.disk_bytes += read
        return read

    def forward(self, layer, x, ids, weights):
        slots = self.slot_of[layer][ids]
        if bool((slots < 0).any()):
            raise RuntimeError(f"layer {layer}: experts {ids[slots < 0].unique().tolist()} are not held by this rank")
        return moe_ffn(x, slots, weights, self.pools[layer], self.method, ffn=self.ffn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
