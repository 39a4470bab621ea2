"""A MoE layer at prefill on the CPU's matrix units (kernels/prefill_gemm.py): under `--cpu-math fast`,
each expert routed at least its shape class's crossover of tokens is computed by torch's bf16 matmul
(its weights converted to bf16 once for the call where stored in another format), the other pairs by
the C++ kernels in one call, their slots masked to -1.

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, S slots, n tokens routed to one expert
    x [T, H] float32   slots [T, K] int64 on the host (-1: pair skipped)   weights [T, K]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels import prefill_gemm


def _format(pool: dict[str, torch.Tensor], method) -> str | None:
    """The shape class's format of a pool: its QuantMethod's name, "bf16" for plain bf16 parts, else None
    (plain fp16 / fp32 pools stay on the kernels)."""
    if method is not None:
        return method.name
    return "bf16" if pool["gate_up"].dtype == torch.bfloat16 else None


def _bias(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return y if b is None else y + b.float()


def _pair(g: torch.Tensor, u: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Separate gate and up outputs [n, I] as one gate_up [n, 2I] in the layout's row order (its bias's)."""
    return torch.stack([g, u], dim=-1).flatten(-2) if interleaved else torch.cat([g, u], dim=-1)


def bf16_expert(x: torch.Tensor, w: dict[str, torch.Tensor], method, ffn) -> torch.Tensor:
    """One expert on x [n, H] float32 with its parts `w` (one slot's) -> [n, H] float32: x and the
    activation rounded to bf16, the weights converted to bf16 (dequantized first where quantized),
    float32 sums, each projection's output rounded to bf16, biases added in float32."""
    bf = torch.bfloat16
    with prefill_gemm.gemm_threads():
        xb = x.to(bf)
        if method is None:
            gu, dn = (w["gate_up"].t(), w["down"].t()) if ffn.transposed else (w["gate_up"], w["down"])
            gu, dn = gu.to(bf), dn.to(bf)
            h = ffn.activate(_bias(F.linear(xb, gu).float(), w.get("gate_up_bias")))
        elif ffn.fused_quant:
            gu = method.dequantize(w, "gate_up").to(bf)
            h = ffn.activate(_bias(F.linear(xb, gu).float(), w.get("gate_up_bias")))
            dn = method.dequantize(w, "down").to(bf)
        else:
            g = F.linear(xb, method.dequantize(w, "gate").to(bf)).float()
            u = F.linear(xb, method.dequantize(w, "up").to(bf)).float()
            h = ffn.activate(_bias(_pair(g, u, ffn.interleaved), w.get("gate_up_bias")))
            dn = method.dequantize(w, "down").to(bf)
        return _bias(F.linear(h.to(bf), dn).float(), w.get("down_bias"))


def prefill_moe(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, pool: dict[str, torch.Tensor], method,
                ffn, out: torch.Tensor | None) -> torch.Tensor | None:
    """out (+)= the layer's experts with the experts of many tokens on the bf16 matmul -> the output
    (a new zeroed one where `out` is None); None: no expert goes to the matmul (fast math off, the path
    off, too few tokens per expert, a format or layout the kernels do not read), nothing computed."""
    T = slots.shape[0]
    if not kernels.prefill_step(T) or not slots.is_cpu or not x.is_cpu or x.dtype != torch.float32:
        return None
    fmt = _format(pool, method)
    args = None if fmt is None else kernels.moe_args(pool, method, x.shape[1], ffn)
    if args is None:
        return None
    flat = slots.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=1)
    if int(counts.max()) < prefill_gemm.MIN_T:
        return None
    H, I = x.shape[1], args[0][4]  # the gate spec's rows

    def probe():
        one = {n: t[:1] for n, t in pool.items()}  # slot 0, as a pool of one
        xs = {n: torch.randn(n, H) for n in prefill_gemm.PROBE_T}
        route = {n: (torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1)) for n in prefill_gemm.PROBE_T}
        w0 = {n: t[0] for n, t in pool.items()}
        return ((lambda n: kernels.moe_out(xs[n], *route[n], one, method, ffn)),
                (lambda n: bf16_expert(xs[n], w0, method, ffn)))

    cross = prefill_gemm.crossover("expert", fmt, I, H, probe)
    big = (counts >= max(cross, prefill_gemm.MIN_T)).nonzero().flatten()
    if big.numel() == 0:
        return None
    rest = slots.masked_fill(torch.isin(slots, big), -1)
    if out is None:
        out = kernels.moe_out(x, rest, weights, pool, method, ffn)
    elif not kernels.moe(x, rest, weights, pool, method, out, ffn):
        out = None
    if out is None:
        return None  # (not reached: moe_args said the kernel reads the pool)
    for s in big.tolist():
        tok, k = (slots == s).nonzero(as_tuple=True)
        y = bf16_expert(x[tok], {n: t[s] for n, t in pool.items()}, method, ffn)
        out.index_put_((tok,), y * weights[tok, k, None].float(), accumulate=True)
    prefill_gemm.CALLS["expert"] += big.numel()
    return out
