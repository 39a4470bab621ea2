"""A MoE layer at prefill on the CPU's matrix units (kernels/prefill_gemm.py): under `--cpu-math fast`,
each expert routed at least its shape class's crossover of tokens is computed by torch's bf16 matmul
(its weights converted to bf16 once for the call where stored in another format); the other pairs are
left to the caller's path (the C++ kernels in one call, or the torch code for a pool they do not read),
their slots masked to -1. The crossover is measured against that path. Plain bf16 SiLU experts run in
one C++ call, each expert a unit of the kernels' threads (pool_experts); the others one at a time here.

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, S slots, n tokens routed to one expert
    x [T, H] float32   slots [T, K] int64 on the host (-1: pair skipped)   weights [T, K]
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels import prefill_gemm
from .ffn import expert_ffn


def _format(pool: dict[str, torch.Tensor], method) -> str | None:
    """The shape class's format of a pool: its QuantMethod's name, "bf16" for plain bf16 parts, else None
    (plain fp16 / fp32 pools stay on the kernels)."""
    if method is not None:  # types per layer (GGUF gguf-layers): the layer's parts name them
        return (
            method.name if not hasattr(method, "block_method") else f"{method.name}:{','.join(sorted(pool))}"
        )
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


def _on_pool_threads(pool: dict[str, torch.Tensor], method, ffn) -> bool:
    """Whether the experts go to the C++ loop on the kernels' threads (csrc/pool_gemm.cpp experts_bf16, the
    same numerics as bf16_expert): plain bf16 parts [out, in], contiguous, no biases, SiLU; else bf16_expert
    in Python, one expert at a time."""
    ext = kernels.extension()
    return (
        ext is not None
        and method is None
        and not ffn.transposed
        and ffn.act == "silu"
        and set(pool) == {"gate_up", "down"}
        and all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in pool.values())
    )


def pool_experts(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    take: torch.Tensor,
    ffn,
    out: torch.Tensor,
) -> None:
    """out += the experts of the slots in `take` (bool [S]) for their pairs, on the kernels' threads, each
    expert one unit (the caller checked _on_pool_threads)."""
    with torch.no_grad():
        kernels.extension().experts_bf16(
            x.contiguous(),
            slots.to(torch.int64).contiguous(),
            weights.float().contiguous(),
            pool["gate_up"],
            pool["down"],
            take,
            ffn.interleaved,
            out,
        )


def _intermediate(pool: dict[str, torch.Tensor], method, ffn) -> int:
    """I of a pool (the rows of one expert's gate)."""
    if method is None:
        gu = pool["gate_up"]
        return gu.shape[2 if ffn.transposed else 1] // 2
    if ffn.fused_quant:
        return kernels.pool_primary(pool, method, "gate_up").shape[1] // 2
    return kernels.pool_primary(pool, method, "gate").shape[1]  # every format's primary is [S, rows, ...]


def prefill_moe(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    method,
    ffn,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The experts of many tokens on the bf16 matmul -> (out, rest): out (a new zeroed one where `out` is
    None) holding their pairs, rest the slots with those pairs masked to -1 for the caller's own path
    (the kernels, or the torch code where they do not read the pool); None: no expert goes to the
    matmul (fast math off, the path off, too few tokens per expert, a plain pool not bf16), nothing done."""
    T = slots.shape[0]
    if not kernels.prefill_step(T) or not slots.is_cpu or not x.is_cpu or x.dtype != torch.float32:
        return None
    fmt = _format(pool, method)
    if fmt is None or any(t.device.type != "cpu" for t in pool.values()):
        return None
    flat = slots.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=1)
    if int(counts.max()) < prefill_gemm.MIN_T:
        return None
    H, I = x.shape[1], _intermediate(pool, method, ffn)
    on_kernel = kernels.moe_args(pool, method, H, ffn) is not None  # else the torch code computes the rest
    threaded = _on_pool_threads(pool, method, ffn) and (
        out is None or (out.dtype == torch.float32 and out.is_contiguous())
    )

    probe = partial(_probe, pool, method, ffn, H, on_kernel, threaded)
    cross = prefill_gemm.crossover("expert" if on_kernel else "expert-torch", fmt, I, H, probe)
    big = (counts >= max(cross, prefill_gemm.MIN_T)).nonzero().flatten()
    if big.numel() == 0:
        return None
    out = _matmul_experts(x, slots, weights, pool, method, ffn, big, threaded, out)
    prefill_gemm.CALLS["expert"] += big.numel()
    return out, slots.masked_fill(torch.isin(slots, big), -1)


def _probe(pool: dict[str, torch.Tensor], method, ffn, H: int, on_kernel: bool, threaded: bool) -> tuple:
    """The crossover's probe for a pool: (the caller's path, the matmul path), each a function of n tokens
    (prefill_gemm.PROBE_T) routed to slot 0 as a pool of one."""
    one = {n: t[:1] for n, t in pool.items()}  # slot 0, as a pool of one
    w0 = {n: t[0] for n, t in pool.items()}
    xs = {n: torch.randn(n, H) for n in prefill_gemm.PROBE_T}
    route = {n: (torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1)) for n in prefill_gemm.PROBE_T}
    base = (
        (lambda n: kernels.moe_out(xs[n], *route[n], one, method, ffn))
        if on_kernel
        else (lambda n: expert_ffn(xs[n], w0, method, ffn))
    )
    if threaded:
        yes = torch.ones(1, dtype=torch.bool)
        return base, (lambda n: pool_experts(xs[n], *route[n], one, yes, ffn, torch.zeros(n, H)))
    return base, (lambda n: bf16_expert(xs[n], w0, method, ffn))


def _matmul_experts(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    method,
    ffn,
    big: torch.Tensor,
    threaded: bool,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """out (a new zeroed one where None) += the experts of the slots `big` for their pairs on the bf16
    matmul: on the kernels' threads where `threaded`, else one expert at a time here."""
    if out is None:
        out = torch.zeros_like(x)
    if threaded:
        take = torch.zeros(pool["gate_up"].shape[0], dtype=torch.bool)
        take[big] = True
        pool_experts(x, slots, weights, pool, take, ffn, out)
    else:
        for s in big.tolist():
            tok, k = (slots == s).nonzero(as_tuple=True)
            y = bf16_expert(x[tok], {n: t[s] for n, t in pool.items()}, method, ffn)
            out.index_put_((tok,), y * weights[tok, k, None].float(), accumulate=True)
    return out
