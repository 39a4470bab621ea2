"""The Triton MoE kernels compiled when a CUDA engine is built, so no request waits for a compile.

`warm_up_moe(model)` calls kernels/triton_moe.py `warm_up` once for each distinct device pool the model's
experts are computed from by the Triton backend (one layer's pool stands for every layer of its format,
layout and dtype), for the decode and prefill launch configurations. Pair counts are not specialised on,
so every later batch reuses what this compiled.
"""

from __future__ import annotations

import torch

WARM_CONFIGS = ("decode", "prefill")


def device_pools(experts) -> list[dict[str, torch.Tensor]]:
    """The device pools {part: [S, ...]} a provider computes from, one per layer (resident pools, or a
    tiered cache's device tier); [] for a provider without its own device pools."""
    pools = getattr(experts, "pools", None)
    if isinstance(pools, dict):
        return list(pools.values())
    dev = getattr(experts, "dev", None)
    if dev is not None and hasattr(dev, "layer"):
        return [dev.layer(i) for i in range(len(experts.layers))]
    return []


def warm_up_moe(model, configs=WARM_CONFIGS) -> int:
    """Compile the Triton kernels of each distinct pool configuration of `model`'s experts on a CUDA
    device -> the number of kernel calls made (0 on a CPU device, or where another backend computes)."""
    if model.device.type != "cuda":
        return 0
    from ..experts.backends import MoEOptions, choose_backend
    from ..kernels import triton_moe

    experts, cfg, seen, calls = model.experts, model.cfg, set(), 0
    method, ffn = experts.source.method, experts.source.ffn
    for pool in device_pools(experts):
        key = tuple((n, t.dtype, tuple(t.shape)) for n, t in pool.items())
        first = next(iter(pool.values()))
        if key in seen or first.shape[0] == 0:
            continue
        seen.add(key)
        options = MoEOptions.for_ffn(method, ffn, model.dtype, cfg.hidden_size)
        if choose_backend(pool, first.device, options).kind.name != "triton":
            continue
        calls += triton_moe.warm_up(pool, method, ffn, model.dtype, cfg.top_k, configs)
    return calls
