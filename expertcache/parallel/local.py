"""A rank's own experts, all resident: only the experts the placement gives this rank.

Shape legend: S_l experts this rank holds in layer l, E logical experts
    pools[l] {part: [S_l, ...]}   slot_of[l] [E] int64 (-1 = not held here)

`prepare(owned, moves, group)` builds the pools of a new placement on a background thread (experts
already held are copied from the current pools; the others are received from a rank that holds them
now when `moves` are given (the peer tier, over the group's move group: every rank runs the same
move list, so sends and receives pair up), else read from the checkpoint) and `swap()` makes them
current at a step boundary; until then `forward` uses the old pools unchanged (a rank's sends read
them, and no rank swaps before every rank's moves are done).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..experts.compute import moe_ffn
from ..experts.layout import ExpertSource, LayerParts
from ..experts.provider import ExpertProvider


class LocalExperts(ExpertProvider):
    def __init__(
        self,
        source: ExpertSource,
        device: torch.device,
        dtype: torch.dtype,
        owned: dict[int, list[int]],
        progress=None,
        alloc=None,
        load: bool = True,
    ):
        """`alloc(shape, dtype)`: how the first pools are allocated (construction's Ledger; default
        torch.empty on `device`); `load` False: allocated only, `load()` reads this rank's experts."""
        self.source, self.device, self.dtype, self.progress = source, device, dtype, progress
        self.parts = source.compute_parts(dtype, device)
        self.method, self.ffn = source.method, source.ffn
        self.pools, self.slot_of, self.disk_bytes, self.peer_bytes = {}, {}, 0, 0
        self._owned = owned
        if load:
            self.pools, self.slot_of, _, _ = self._build(owned, {}, {})
        else:
            self.pools = {layer: self._empty(layer, len(experts), alloc) for layer, experts in owned.items()}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ep-rearrange")
        self._next: Future | None = None

    def _empty(self, layer: int, n: int, alloc=None) -> dict[str, torch.Tensor]:
        """n slots of `layer`'s parts (a GGUF file's types may differ by layer: LayerParts)."""
        alloc = alloc or (lambda shape, dt: torch.empty(shape, dtype=dt, device=self.device))
        parts = self.source.layer_parts(layer) if isinstance(self.parts, LayerParts) else self.parts
        return {p.name: alloc((n, *p.shape), p.dtype) for p in parts}

    def load(self, progress=None) -> None:
        """This rank's experts read into the pools allocated at construction."""
        self.progress = progress or self.progress
        self.pools, self.slot_of, _, _ = self._build(self._owned, {}, {}, into=self.pools)

    def _build(self, owned, old_pools, old_slot_of, moves=None, group=None, rank=0, into=None):
        E, pools, slot_of, read = self.source.cfg.num_experts, {}, {}, 0
        incoming = {(layer, e): src for src, dst, layer, e in moves or () if dst == rank}
        recvs = []
        for layer, experts in owned.items():
            pool = into[layer] if into is not None else self._empty(layer, len(experts))
            where = torch.full((E,), -1, dtype=torch.int64)
            old = old_slot_of.get(layer)
            for s, e in enumerate(experts):
                if old is not None and old[e] >= 0:
                    for name, t in pool.items():
                        t[s].copy_(old_pools[layer][name][old[e]])
                elif (layer, e) in incoming:
                    recvs.append(((layer, e), [t[s] for t in pool.values()], incoming[layer, e]))
                else:
                    w = self.source.read(layer, e)
                    for name, t in pool.items():
                        t[s].copy_(w[name])
                    read += self.source.expert_nbytes
                    if self.progress:
                        self.progress(self.source.expert_nbytes)
                where[e] = s
            pools[layer], slot_of[layer] = pool, where.to(self.device)
        received = self._move(moves, recvs, old_pools, old_slot_of, group, rank) if moves else 0
        return pools, slot_of, read, received

    def _move(self, moves, recvs, old_pools, old_slot_of, group, rank) -> int:
        """This rank's sends (from the current pools) and receives (into the new ones) of `moves`,
        posted together in move order; -> bytes received."""
        wire = (
            (lambda t: t.reshape(-1).view(torch.uint8))
            if self.device.type == "cpu"
            else (lambda t: t.reshape(-1).view(torch.uint8).cpu())
        )  # the move group is gloo: CPU tensors
        sends = []
        for src, dst, layer, e in moves:
            if src == rank:
                s = int(old_slot_of[layer][e])
                sends += [(wire(t[s].contiguous()), dst) for t in old_pools[layer].values()]
        bufs = [
            (
                views,
                [
                    wire(v)
                    if self.device.type == "cpu"
                    else torch.empty(v.numel() * v.element_size(), dtype=torch.uint8)
                    for v in views
                ],
                src,
            )
            for _, views, src in recvs
        ]
        group.exchange(sends, [(b, src) for _, bs, src in bufs for b in bs], group.move_group)
        for views, bs, _ in bufs:
            if self.device.type != "cpu":
                for v, b in zip(views, bs):
                    v.reshape(-1).view(torch.uint8).copy_(b)
        return len(recvs) * self.source.expert_nbytes

    # -- rearrangement ------------------------------------------------------------------------------
    def prepare(self, owned: dict[int, list[int]], moves=None, group=None) -> None:
        self.progress = None
        self._next = self._pool.submit(
            self._build, owned, self.pools, self.slot_of, moves, group, group.rank if group is not None else 0
        )

    def ready(self) -> bool:
        return self._next is None or self._next.done()

    def swap(self) -> tuple[int, int]:
        """Make the prepared pools current; -> (bytes read from the checkpoint, bytes received from other
        ranks) for them."""
        if self._next is None:
            return 0, 0
        self.pools, self.slot_of, read, received = self._next.result()
        self._next = None
        self.disk_bytes += read
        self.peer_bytes += received
        return read, received

    def forward(self, layer, x, ids, weights):
        slots = self.slot_of[layer][ids]
        if bool((slots < 0).any()):
            raise RuntimeError(
                f"layer {layer}: experts {ids[slots < 0].unique().tolist()} are not held by this rank"
            )
        return moe_ffn(x, slots, weights, self.pools[layer], self.method, ffn=self.ffn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
