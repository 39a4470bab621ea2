"""CPU kernels computing y = x W^T straight from a weight's stored bytes (bf16, fp16, fp8, int8,
int4, mxfp4): the expert FFN of a whole MoE layer in one call, and dense projections / lm_head.

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, S slots of a pool, N x Kin one weight
    x [T, H] float32   slots [T, K] int64 (-1: pair skipped)   weights [T, K]
    pool: {"gate_up": [S, 2I, H], "down": [S, H, I]} plain, or a QuantMethod's parts {"gate.weight": [S, ...], ...}

Backends: "cpp" (csrc/expert_kernels.cpp, built by build.py; AVX2/FMA/F16C, threads through
ATen's parallel_for, so torch.set_num_threads / --threads sets them) or "torch" (the callers'
own torch code, used with a printed note when the extension cannot be built or loaded). Every
entry point returns None / False when it does not apply, and the caller computes with torch.
"""

from __future__ import annotations

import torch

from .build import extension, why
from .formats import Unsupported, plain_spec, quant_spec

SMALL_T = 16  # tokens of one weight at or below which the register-converting GEMV path runs
ROWS_PER_UNIT = 32  # rows of a weight per unit of work handed to a thread
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}


def backend() -> str:
    """'cpp' when the C++ kernels are in use, else 'torch'."""
    return "torch" if extension() is None else "cpp"


def _usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and extension() is not None


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [..., Kin] float32 @ w [N, Kin]^T for a bf16/fp16/fp32 weight, or None when the kernels
    do not apply (then the caller uses torch)."""
    if not _usable(x) or w.device.type != "cpu" or w.dim() != 2:
        return None
    try:
        spec = plain_spec(w.unsqueeze(0))
    except Unsupported:
        return None
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = extension().linear(x2, spec, 0, SMALL_T, ROWS_PER_UNIT)
    return y.view(*x.shape[:-1], w.shape[0])


def pool_specs(pool: dict[str, torch.Tensor], method, I: int, H: int) -> tuple:
    """(gate, up, down) specs of a pool; raises Unsupported."""
    if method is None:
        gu = pool["gate_up"]
        return plain_spec(gu[:, :I]), plain_spec(gu[:, I:]), plain_spec(pool["down"])
    return (quant_spec(method, pool, "gate", I, H), quant_spec(method, pool, "up", I, H),
            quant_spec(method, pool, "down", H, I))


def moe(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, pool: dict[str, torch.Tensor], method,
        out: torch.Tensor, I: int, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
        biases: tuple = (None, None, None)) -> bool:
    """out += the grouped expert FFN over pool slots (one call for the layer). False: not handled
    (a format or dtype the kernels do not read); `out` is then untouched."""
    if not _usable(x) or out.dtype != torch.float32 or not out.is_contiguous():
        return False
    try:
        specs = pool_specs(pool, method, I, x.shape[1])
    except Unsupported:
        return False
    if any(t.device.type != "cpu" for t in pool.values()):
        return False
    bias = [None if b is None else b.float().contiguous() for b in biases]
    extension().moe(x.contiguous(), slots.contiguous(), weights.float().contiguous(), *specs,
                    ACTIVATIONS[activation], alpha, limit, *bias, out, SMALL_T, ROWS_PER_UNIT)
    return True


__all__ = ["backend", "dense_linear", "moe", "pool_specs", "why", "Unsupported"]
