"""The torch code of the experts: how a model's experts compute from their parts (`ExpertFFN`), one
expert (`expert_ffn`), and a whole pool (`torch_moe`: one grouped GEMM for small batches, else a loop
over the active slots only, both grouped on the host). The "torch" MoE backend (experts/backends.py),
and what the others fall back to for a call they do not take.

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, S slots, A active (distinct) experts
    x [T, H]   slots [T, K] (slot index per routed pair, into the pool tensors; -1: skipped)   weights [T, K]
    gate_up pool [S, 2I, H]   down pool [S, H, I]   ([S, H, 2I] and [S, I, H] when ExpertFFN.transposed)

Tokens are grouped by slot on the host, from one host copy of the slots (experts/host_routing.py: no
other device read); the loop runs over the A active slots only (A <= min(T*K, S)), each a dense matmul
over the tokens routed to it. Pool tensors may be stored in a lower precision than x: each active slot
is converted once (the CPU has no fast bf16 matmul; see README "numerics"). Quantized pools (parts
"gate.weight", "gate.weight_scale", ...) go through the QuantMethod, which dequantizes into float32 and
multiplies.

`ExpertFFN` says how a model's experts compute from those parts: the activation (by name, from
ACTIVATIONS), the gate/up row order, the orientation of plain weights, and optional biases (parts
"gate_up_bias" [2I] and "down_bias" [H], added after each projection). The default is the
Llama-style SwiGLU: silu(gate) * up, gate rows first, weights [out, in], no biases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import kernels
from .host_routing import DeviceGroups, group_by_slot, to_host


def _silu(g: torch.Tensor, u: torch.Tensor, ffn: ExpertFFN) -> torch.Tensor:
    return F.silu(g) * u


def _clamped_swiglu(g: torch.Tensor, u: torch.Tensor, ffn: ExpertFFN) -> torch.Tensor:
    """GPT-OSS: (up + 1) * g * sigmoid(alpha * g), g clamped above at limit, up to [-limit, limit]."""
    g = g.clamp(max=ffn.limit)
    u = u.clamp(min=-ffn.limit, max=ffn.limit)
    return (u + 1) * (g * torch.sigmoid(g * ffn.alpha))


ACTIVATIONS = {"silu": _silu, "clamped_swiglu": _clamped_swiglu}


@dataclass(frozen=True)
class ExpertFFN:
    """act: ACTIVATIONS name. interleaved: gate_up rows alternate gate, up (gate = even rows) rather
    than all gate rows then all up rows. transposed: plain parts stored [in, out] (gate_up [H, 2I],
    down [I, H]). fused_quant: quantized parts are "gate_up.*" and "down.*" (not "gate.*", "up.*").
    alpha, limit: clamped_swiglu's parameters. kernel: "torch" or "triton", the MoE kernel asked for
    (a resolved MOE_KERNELS choice; "torch": the C++ kernels where they read the pool, else the torch
    code, experts/backends.py); kernel_fallback: the triton kernel was chosen by `auto`, so a failure of
    it (a compile error on a GPU it was never built for) falls back with a note for that configuration
    instead of ending the request."""

    act: str = "silu"
    interleaved: bool = False
    transposed: bool = False
    fused_quant: bool = False
    alpha: float = 1.0
    limit: float = float("inf")
    kernel: str = "torch"
    kernel_fallback: bool = False

    def __post_init__(self):
        if self.act not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.act!r}; choose one of {sorted(ACTIVATIONS)}")
        if self.kernel not in ("torch", "triton"):
            raise ValueError(f"ExpertFFN.kernel: 'torch' or 'triton', got {self.kernel!r}")

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2I] (after the gate_up projection and bias) -> [n, I]."""
        if self.interleaved:
            g, u = gate_up[..., ::2], gate_up[..., 1::2]
        else:
            g, u = gate_up.chunk(2, dim=-1)
        return ACTIVATIONS[self.act](g, u, self)


SWIGLU = ExpertFFN()


def _add_bias(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return y if b is None else y + b.to(y.dtype)


def expert_ffn(
    x: torch.Tensor, w: dict[str, torch.Tensor], method=None, ffn: ExpertFFN = SWIGLU
) -> torch.Tensor:
    """One expert on x [n, H] with its parts `w` (gate_up [2I, H] + down [H, I], or quantized parts)."""
    if kernels.backend() == "cpp" and x.dtype == torch.float32 and x.device.type == "cpu":
        out = torch.zeros_like(x)  # a pool of one slot, every token routed to it with weight 1
        slot0, ones = torch.zeros(x.shape[0], 1, dtype=torch.long), x.new_ones(x.shape[0], 1)
        if kernels.moe(x, slot0, ones, {n: t.unsqueeze(0) for n, t in w.items()}, method, out, ffn):
            return out
    if method is not None:
        xf = x.float()
        if ffn.fused_quant:
            h = ffn.activate(_add_bias(method.linear(xf, w, "gate_up"), w.get("gate_up_bias")))
        else:
            h = ACTIVATIONS[ffn.act](method.linear(xf, w, "gate"), method.linear(xf, w, "up"), ffn)
        return _add_bias(method.linear(h, w, "down"), w.get("down_bias")).to(x.dtype)
    gate_up, down = w["gate_up"], w["down"]
    if gate_up.dtype != x.dtype:
        gate_up, down = gate_up.to(x.dtype), down.to(x.dtype)
    if ffn.transposed:
        h = ffn.activate(_add_bias(x @ gate_up, w.get("gate_up_bias")))
        return _add_bias(h @ down, w.get("down_bias"))
    h = ffn.activate(_add_bias(F.linear(x, gate_up), w.get("gate_up_bias")))
    return _add_bias(F.linear(h, down), w.get("down_bias"))


GROUPED_MM_MAX_PAIRS = 256  # measured: one grouped GEMM beats the per-slot loop below this (decode)


def grouped_mm_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's grouped_mm exists and runs here: any CPU dtype; on CUDA it needs compute capability
    >= 8.0 (and bf16/fp32), so a T4 / V100 takes the per-slot loop instead of failing every step."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0) and dtype in (torch.bfloat16, torch.float32)


def torch_moe(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    method,
    out: torch.Tensor,
    ffn: ExpertFFN,
    host: bool,
) -> torch.Tensor:
    """out += the pool's experts for their pairs, in torch (`host`: `slots` is a host tensor)."""
    T, K = slots.shape
    groups = group_by_slot(slots if host else to_host(slots))
    if not groups.active:
        return out
    if (
        method is None
        and T * K <= GROUPED_MM_MAX_PAIRS
        and grouped_mm_ok(x.device, x.dtype)
        and pool["gate_up"].dtype == x.dtype
    ):  # a stored-dtype pool is converted per active slot below
        return _grouped(x, groups.on(x.device, pool["gate_up"].shape[0]), weights, pool, out, ffn)
    g = groups.on(x.device)
    w = weights.reshape(-1)[g.order].to(x.dtype)
    start = 0
    for s, n in zip(groups.active, groups.counts):
        tok = g.token[start : start + n]
        y = expert_ffn(x[tok], {name: t[s] for name, t in pool.items()}, method, ffn)
        # index_put_ rather than index_add_: the latter takes milliseconds with 2 CPU threads here
        out.index_put_((tok,), y * w[start : start + n, None], accumulate=True)
        start += n
    return out


def _grouped(x, g: DeviceGroups, weights, pool, out, ffn):
    """Same result with two grouped GEMMs (torch's grouped_mm): no Python loop over experts."""
    gate_up, down = pool["gate_up"], pool["down"]
    if not ffn.transposed:  # grouped_mm takes [S, in, out]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    tok = g.token
    bias = {n: pool[n][g.slot] for n in ("gate_up_bias", "down_bias") if n in pool}  # [pairs, out]
    h = ffn.activate(_add_bias(F.grouped_mm(x[tok], gate_up, offs=g.offs), bias.get("gate_up_bias")))
    y = _add_bias(F.grouped_mm(h, down, offs=g.offs), bias.get("down_bias"))
    out.index_put_((tok,), y * weights.reshape(-1)[g.order, None].to(x.dtype), accumulate=True)
    return out
