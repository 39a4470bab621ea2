"""The expert FFN of a MoE layer over slot buffers: out[t] = sum_k w[t,k] * down(act(gate(x), up(x))) for
expert ids[t,k], computed by the pool's MoE backend (experts/backends.py: triton, the C++ CPU kernels
or the torch code, chosen once per pool; its table says which runs where).

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, S slots
    x [T, H]   slots [T, K] (slot index per routed pair, into the pool tensors; -1: skipped)   weights [T, K]
    gate_up pool [S, 2I, H]   down pool [S, H, I]   ([S, H, 2I] and [S, I, H] when ExpertFFN.transposed)

`ExpertFFN` (experts/ffn.py) says how a model's experts compute from their parts; `ExpertFFN.kernel` is
the MoE kernel asked for (`--moe-kernel`, resolved once by `with_moe_kernel`): "torch" (the C++ kernels
where they read the pool, else the torch code) or "triton" (kernels/triton_moe.py: every format and the
GPT-OSS variant in two launches, no host read; on CUDA, or on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import ConfigError
from .backends import Backend, MoEOptions, backend_for, choose_backend
from .config import MOE_KERNELS
from .ffn import ACTIVATIONS, GROUPED_MM_MAX_PAIRS, SWIGLU, ExpertFFN, expert_ffn, grouped_mm_ok, torch_moe

__all__ = [
    "ACTIVATIONS",
    "GROUPED_MM_MAX_PAIRS",
    "SWIGLU",
    "Backend",
    "ExpertFFN",
    "MoEOptions",
    "choose_backend",
    "expert_ffn",
    "grouped_mm_ok",
    "moe_ffn",
    "torch_moe",
    "with_moe_kernel",
]


def with_moe_kernel(ffn: ExpertFFN, choice: str, device: torch.device | str, method=None) -> ExpertFFN:
    """`ffn` computing through the MoE kernel `choice` (MOE_KERNELS) on `device` for experts stored by
    `method`: auto is triton on CUDA where triton is importable and reads the format, else torch; an
    explicit triton that cannot run there is a ConfigError saying why."""
    if choice not in MOE_KERNELS:
        raise ConfigError(f"moe_kernel: must be one of {', '.join(MOE_KERNELS)}, got {choice!r}")
    device = torch.device(device)
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return replace(ffn, kernel="torch")
    from ..kernels import triton_moe

    why = triton_moe.unavailable_reason(device) or triton_moe.supported(method)
    if why is None:
        return replace(ffn, kernel="triton", kernel_fallback=choice == "auto")
    if choice == "auto":
        return replace(ffn, kernel="torch")
    raise ConfigError(f"moe_kernel='triton': {why}")


def moe_ffn(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    method=None,
    out: torch.Tensor | None = None,
    ffn: ExpertFFN = SWIGLU,
    host: bool = False,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Grouped expert FFN from pool tensors {part: [S, ...]}; pairs with slot -1 are skipped -> out (a new
    one where `out` is None). `host`: `slots` is a host tensor (derived from the layer's host copy of
    its ids, as TieredExperts does), so the torch code groups it with no device read; else it groups one
    host copy of it (experts/host_routing.py: the only device -> host read here); triton copies a host
    `slots` over. `backend`: the pool's backend as the builder chose it (choose_backend); None: chosen
    here, once per pool and configuration."""
    if backend is None:
        backend = backend_for(pool, x, method, ffn)
    return backend(x, slots, weights, pool, method, ffn, out, host)
