"""A `this-cpu` hardware profile from quick micro-measurements (a second or two in all).

- cpu_mem_gbs: a float32 tensor copy much larger than the caches (bytes read + written / s)
- cpu_gflops:  a float32 matmul (2 * n**3 FLOP / s); `gemv=True` measures one-row products
               [1, H] @ [H, I] instead, the shape of a decode step
- disk_gbs:    O_DIRECT reads of checkpoint files with the engine's DiskReader (page cache
               bypassed where the filesystem allows it; otherwise a warm-cache figure, flagged)
Each figure is the best of a few repetitions, measured with torch's current thread count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..experts.disk import DiskReader
from ..trace.profiles import BUILTIN, Profile


@dataclass
class Measured:
    profile: Profile
    threads: int
    disk_direct: bool  # False: reads went through the page cache, disk_gbs is optimistic
    notes: str


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def mem_gbs(mib: int = 256, reps: int = 3) -> float:
    src = torch.ones(mib << 18)  # float32: mib MiB
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), reps) / 1e9


def matmul_gflops(n: int = 512, reps: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n ** 3 / _best(lambda: a @ b, reps) / 1e9


def gemv_gflops(h: int = 256, i: int = 512, batch: int = 64, reps: int = 5) -> float:
    """One-row products against `batch` different weight matrices (cache-cold like experts)."""
    ws = [torch.randn(h, i) for _ in range(batch)]
    x = torch.randn(1, h)

    def run():
        for w in ws:
            x @ w

    run()
    return 2 * h * i * batch / _best(run, reps) / 1e9


def disk_gbs(files: list[Path], limit: int = 256 << 20, chunk: int = 4 << 20) -> tuple[float, bool]:
    """Sequential O_DIRECT reads of up to `limit` bytes over `files`; (GB/s, direct used)."""
    reader = DiskReader(o_direct=True, threads=1)
    buf = torch.empty(chunk, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    total = 0
    t0 = time.perf_counter()
    try:
        for f in files:
            size = f.stat().st_size
            for off in range(0, size - chunk + 1, chunk):
                reader.read_range(f, off, mv)
                total += chunk
                if total >= limit:
                    break
            if total >= limit:
                break
        dt = time.perf_counter() - t0
        direct = reader.direct_used
    finally:
        reader.close()
    if total == 0:
        raise ValueError("disk_gbs: the files are smaller than one read chunk")
    return total / dt / 1e9, direct


def measure_cpu_profile(model_dir: str | Path | None = None, name: str = "this-cpu", gemv: bool = False) -> Measured:
    """Profile(name, link 0, disk, cpu mem, cpu GFLOP/s) of this machine (no GPU terms)."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if model_dir else []
    disk, direct = disk_gbs(files) if files else (3.0, False)
    mem = mem_gbs()
    flops = gemv_gflops() if gemv else matmul_gflops()
    notes = "" if files else "disk not measured (no model dir): 3 GB/s assumed"
    if files and not direct:
        notes = "O_DIRECT refused: disk figure includes the page cache"
    prof = Profile(name, link_gbs=0.0, disk_gbs=round(disk, 3), cpu_mem_gbs=round(mem, 3), cpu_gflops=round(flops, 2),
                   layer_overhead_ms=BUILTIN["cpu-only"].layer_overhead_ms)  # dispatch cost: not measured here
    return Measured(prof, torch.get_num_threads(), direct, notes)
