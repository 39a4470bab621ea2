"""The seam between the model and the expert tiers.

An ExpertProvider computes the routed-expert part of one MoE layer:

    forward(layer, x [T, H], ids [T, K] int64, weights [T, K]) -> [T, H]

Contract:
- The result equals sum_k weights[t,k] * FFN_{ids[t,k]}(x[t]) up to float
  rounding, whatever the provider caches, prefetches or computes where.
- `prefetch(layer, ids)` is a hint (predicted experts of a coming layer); it
  never blocks and never changes results.
- `begin_step()` / `end_step()` bracket one forward pass of the whole model; an expert a
  layer uses stays pinned (never evicted) until that layer's forward returns.
- `stats()` returns the counters described in experts/stats.py.
- `kernel_moe_args(layer, H)`: where slot s of a layer's pool always holds expert s (every expert
  resident) and the CPU MoE kernel reads the pool, its arguments (kernels.moe_args), so a caller may
  run the layer's forward inside a larger kernel call; else None (the default).
"""

from __future__ import annotations

import torch

from .. import hostmem, kernels
from .compute import moe_ffn
from .layout import ExpertSource, parts_at


class ExpertProvider:
    wants_prefetch = False  # True: the model computes next-layer lookahead and calls prefetch()

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def end_step(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def kernel_moe_args(self, layer: int, H: int) -> tuple | None:
        return None

    def close(self) -> None:
        pass


class ResidentExperts(ExpertProvider):
    """Every expert loaded once into stacked per-layer pools {part: [E, ...]} (slot = expert id)."""

    def __init__(
        self,
        source: ExpertSource,
        device: torch.device,
        dtype: torch.dtype,
        progress=None,
        parts=None,
        alloc=None,
        load: bool = True,
    ):
        """`alloc(shape, dtype)`: how the pools are allocated (default hostmem.empty on `device`); `load`
        False: allocated only, `load()` reads the experts later."""
        self.source, self.method, self.ffn = source, source.method, source.ffn
        E = source.cfg.num_experts
        parts = parts or source.compute_parts(dtype, device)
        alloc = alloc or (lambda shape, dt: hostmem.empty(shape, dt, device))
        self.pools: dict[int, dict[str, torch.Tensor]] = {
            layer: {p.name: alloc((E, *p.shape), p.dtype) for p in parts_at(parts, i)}
            for i, layer in enumerate(source.layers)
        }
        if load:
            self.load(progress)

    def load(self, progress=None) -> None:
        """Every expert read from disk into its slot (slot = expert id)."""
        source = self.source
        for layer, pool in self.pools.items():
            for j in range(source.cfg.num_experts):
                w = source.read(layer, j)
                if source.check_read(layer, j, w):
                    raise source.nonfinite_error(layer, j)
                for name, t in pool.items():
                    t[j].copy_(w[name])
                if progress:
                    progress(source.expert_nbytes)

    def forward(self, layer, x, ids, weights):
        return moe_ffn(x, ids, weights, self.pools[layer], self.method, ffn=self.ffn)

    def kernel_moe_args(self, layer: int, H: int) -> tuple | None:
        if self.ffn.kernel != "torch":  # the chosen MoE kernel computes every layer, never the CPU block call
            return None
        return kernels.moe_args(self.pools[layer], self.method, H, self.ffn)
