"""The expert FFN over slot buffers: out[t] = sum_k w[t,k] * down(silu(gate(x)) * up(x)) for expert ids[t,k].

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, S slots, A active (distinct) experts
    x [T, H]   slots [T, K] (slot index per routed pair, into the pool tensors)   weights [T, K]
    gate_up pool [S, 2I, H]   down pool [S, H, I]

On the CPU with float32 activations the whole layer is one call into the C++ kernels
(expertcache.kernels: every format read straight from its stored bytes). Otherwise (CUDA, the
pure-torch fallback): tokens are grouped by slot with one argsort; the loop runs over the A active
slots only (A <= min(T*K, S)), each a dense matmul over the tokens routed to it.
Pool tensors may be stored in a lower precision than x: each active slot is
converted once. Quantized pools (parts "gate.weight", "gate.weight_scale", ...) go through the
QuantMethod, which dequantizes into float32 and multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels


def group_by_slot(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """-> (active slot ids [A], pair order [T*K] sorted by slot, counts per active slot)."""
    flat = slots.reshape(-1)
    order = torch.argsort(flat, stable=True)
    active, counts = torch.unique_consecutive(flat[order], return_counts=True)
    return active, order, counts.tolist()


def expert_ffn(x: torch.Tensor, w: dict[str, torch.Tensor], method=None) -> torch.Tensor:
    """One expert on x [n, H] with its parts `w` (gate_up [2I, H] + down [H, I], or quantized parts)."""
    if kernels.backend() == "cpp" and x.dtype == torch.float32 and x.device.type == "cpu":
        out = torch.zeros_like(x)  # a pool of one slot, every token routed to it with weight 1
        slot0, ones = torch.zeros(x.shape[0], 1, dtype=torch.long), x.new_ones(x.shape[0], 1)
        if kernels.moe(x, slot0, ones, {n: t.unsqueeze(0) for n, t in w.items()}, method, out):
            return out
    if method is not None:
        xf = x.float()
        h = F.silu(method.linear(xf, w, "gate")) * method.linear(xf, w, "up")
        return method.linear(h, w, "down").to(x.dtype)
    gate_up, down = w["gate_up"], w["down"]
    if gate_up.dtype != x.dtype:
        gate_up, down = gate_up.to(x.dtype), down.to(x.dtype)
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down)


GROUPED_MM_MAX_PAIRS = 256  # measured: one grouped GEMM beats the per-slot loop below this (decode)


def moe_ffn(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, pool: dict[str, torch.Tensor],
            method=None, out: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped expert FFN from pool tensors {part: [S, ...]}. `mask` [T, K] (bool) limits to some pairs."""
    T, K = slots.shape
    out = torch.zeros_like(x) if out is None else out
    if mask is not None:
        slots = torch.where(mask, slots, -1)
    if kernels.moe(x, slots, weights, pool, method, out):
        return out
    if (method is None and T * K <= GROUPED_MM_MAX_PAIRS and hasattr(F, "grouped_mm")
            and pool["gate_up"].dtype == x.dtype):  # a stored-dtype pool is converted per active slot below
        return _grouped(x, slots, weights, pool["gate_up"], pool["down"], out)
    active, order, counts = group_by_slot(slots)
    token_of = order // K
    w = weights.reshape(-1)[order].to(x.dtype)
    start = 0
    for s, n in zip(active.tolist(), counts):
        if s >= 0:
            tok = token_of[start:start + n]
            y = expert_ffn(x[tok], {name: t[s] for name, t in pool.items()}, method)
            # index_put_ rather than index_add_: the latter takes milliseconds with 2 CPU threads here
            out.index_put_((tok,), y * w[start:start + n, None], accumulate=True)
        start += n
    return out


def _grouped(x, slots, weights, gate_up, down, out):
    """Same result with two grouped GEMMs (torch's grouped_mm): no Python loop over experts."""
    K = slots.shape[1]
    flat = slots.reshape(-1)
    pairs = torch.nonzero(flat >= 0).squeeze(1)
    order = pairs[torch.argsort(flat[pairs], stable=True)]
    offs = torch.cumsum(torch.bincount(flat[order], minlength=gate_up.shape[0]), 0).to(torch.int32)
    tok = order // K
    g, u = F.grouped_mm(x[tok], gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = F.grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=offs)
    out.index_put_((tok,), y * weights.reshape(-1)[order, None].to(x.dtype), accumulate=True)
    return out
