"""Attention of the new tokens over the paged KV cache on the CPU (csrc/attention.cpp): one call per
layer does the new tokens' per-head q/k RMSNorm and rotary, writes their k/v into the cache and
attends over the cache through the block table (no gathered copy of the context).

Shape legend:
    T new tokens   h heads   g kv heads   D head_dim   R rotary dims
    q [T, h, D], k / v [T, g, D] float32 (each head's D values contiguous), or [T, h * D] / [T, g * D]
    (column slices of the qkv projection; h and g are then read from the cache's shape), or k = v =
    None and q the fused qkv projection [T, (h + 2 g) * D] itself (the kernel splits it: no views made)
    k_cache / v_cache [num_blocks, block_size, g, D] float32 or bfloat16   cos / sin [T, 1, R] (or [T, R])
    q_norm / k_norm [D] float32 (per-head RMSNorm weights)   sinks [h] float32
    -> [T, h * D] float32

`attend` returns None when the kernel does not apply (not the CPU, not float32, a cache dtype it does
not read, the extension missing, a sequence with more than MAX_Q new tokens: SDPA's batched matmuls
win there); the caller then computes with torch. It decides before anything is written.
"""

from __future__ import annotations

import torch

from .build import extension

# New tokens of one sequence above which the caller's SDPA is used. Measured on the yardstick's shapes
# (16 q / 4 kv heads, D 64, fp32 cache, 2 threads; attention after the projections, kernel vs torch):
# the kernel is faster everywhere measured: decode 6-7x (74 to 2000 keys), 16 new tokens after 500
# keys 2.7x, 64 after 500 1.7x, 512 from empty 3.1x, 256 after 2000 1.2x, 1024 after 3000 1.3x,
# 2048 from empty 2.8x. 2048 is the scheduler's default token budget per step; above it, unmeasured.
MAX_Q = 2048
CACHE_DTYPES = (torch.float32, torch.bfloat16)


def takes(batch, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this step's batch and cache (its limits beside q's dtype and device)."""
    return batch.max_q <= MAX_Q and k_cache.dtype in CACHE_DTYPES


def attend(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """-> out [T, h * D], with the new k/v written into the caches at batch.slot_mapping; or None (not
    handled, nothing written). batch: layers.attention.AttnBatch (read by attribute). q/k are normed
    (q_norm/k_norm, eps) then rotated (cos/sin) per head; positions visible as layers/attention.py says."""
    if q.dtype != torch.float32 or not q.is_cpu or not takes(batch, k_cache):
        return None
    ext = extension()
    if ext is None:
        return None
    return ext.attention(
        q,
        k,
        v,
        q_norm,
        k_norm,
        eps,
        cos,
        sin,
        k_cache,
        v_cache,
        batch.slot_mapping,
        batch.block_tables,
        batch.seq_of_token,
        batch.positions,
        window or 0,
        scale,
        sinks,
    )
