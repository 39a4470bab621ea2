"""Shared bits of the benchmark scripts: the hardware line and engine timing."""

from __future__ import annotations

import os
import platform
import time

import torch


def hardware_line() -> str:
    cpu = platform.processor() or "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    from expertcache import kernels

    return (
        f"hardware: cpu={cpu!r} cores={os.cpu_count()} torch_threads={torch.get_num_threads()} "
        f"gpu={gpu!r} torch={torch.__version__} cpu_kernels={kernels.backend()}"
    )


def memory_pages() -> dict[str, float]:
    """This process's anonymous memory, the part of it on 2 MiB pages and its resident set, in GB
    (/proc/self/smaps_rollup)."""
    rows = dict(line.split(":", 1) for line in open("/proc/self/smaps_rollup").read().splitlines()[1:])
    keys = {"anon_GB": "Anonymous", "anon_huge_GB": "AnonHugePages", "rss_GB": "Rss"}
    return {k: int(rows.get(v, "0 kB").split()[0]) / 1e6 for k, v in keys.items()}


def timed_generate(llm, prompts, params) -> dict:
    """Run one batch through the engine. Prefill tok/s from the engine's own counters (the prompt's
    forward passes); decode tok/s end to end: the generate call's wall time less the prefill's, so
    scheduling, sampling and detokenising count as they do in an end-to-end timing of another engine."""
    c = llm.engine.counters
    before = (c.prompt_tokens, c.generated_tokens, c.prefill_seconds, c.decode_seconds)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    pt, gt, ps, ds = (
        a - b
        for a, b in zip((c.prompt_tokens, c.generated_tokens, c.prefill_seconds, c.decode_seconds), before)
    )
    decoded = gt - len(prompts)  # the first token of each sequence comes out of prefill
    ds = max(wall - ps, 1e-9) if ds else 0.0
    return {
        "prefill_tok_s": pt / ps if ps else 0.0,
        "decode_tok_s": decoded / ds if ds else 0.0,
        "outputs": outs,
    }
