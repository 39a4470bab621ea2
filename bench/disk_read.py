"""Disk tier throughput: whole experts read with the engine's DiskReader (O_DIRECT), by I/O threads.

    python bench/disk_read.py [--model DIR] [--threads 1 2 4 8] [--experts 64]

Default model: cache_bench's "big" (16 layers x 64 experts, 1.5 MB bf16 experts), built in a temp
dir. Each configuration reads a different random set of experts (no page cache with O_DIRECT).
One line per thread count: MB/s and whether O_DIRECT was used.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from concurrent.futures import wait

import torch
from common import hardware_line


def read_experts(source, chosen, threads: int) -> tuple[float, bool]:
    """Read the whole experts `chosen` [(layer, expert)] of `source` (an ExpertSource) with the engine's
    DiskReader on `threads` I/O threads -> (MB/s, whether O_DIRECT was used)."""
    from expertcache.loader.disk import DiskReader

    reader = DiskReader(threads=threads)
    bufs = [
        {p.name: torch.empty(p.shape, dtype=p.dtype) for p in source.layer_parts(layer, stored=True)}
        for layer, _ in chosen
    ]
    t0 = time.perf_counter()
    futs = [
        reader.submit(source.ranges(layer, e)[n], t)
        for (layer, e), b in zip(chosen, bufs)
        for n, t in b.items()
    ]
    wait(futs)
    for f in futs:
        f.result()
    dt = time.perf_counter() - t0
    direct = reader.direct_used
    reader.close()
    return len(chosen) * source.expert_nbytes / dt / 1e6, direct


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--experts", type=int, default=64, help="experts read per configuration")
    args = ap.parse_args()
    from expertcache.demo import build_demo_model
    from expertcache.experts.layout import ExpertSource
    from expertcache.loader.safetensors_index import TensorIndex
    from expertcache.models.registry import read_config

    print(hardware_line(), flush=True)
    model = args.model or str(
        build_demo_model(
            f"{tempfile.mkdtemp(prefix='expertcache-disk-')}/big",
            num_layers=16,
            num_experts=64,
            top_k=8,
            hidden=512,
            moe_intermediate=512,
            num_heads=8,
            num_kv_heads=4,
            num_shards=4,
        )
    )
    family, cfg, _ = read_config(model)
    source = ExpertSource(TensorIndex(model), cfg, family.names)
    pairs = [(layer, e) for layer in source.layers for e in range(cfg.num_experts)]
    random.Random(0).shuffle(pairs)
    if len(pairs) < args.experts * len(args.threads):
        raise SystemExit(f"{model} has {len(pairs)} experts, need {args.experts * len(args.threads)}")
    for k, threads in enumerate(args.threads):
        chosen = pairs[k * args.experts : (k + 1) * args.experts]
        mbs, direct = read_experts(source, chosen, threads)
        print(
            f"threads={threads} expert_MB={source.expert_nbytes / 1e6:.2f} experts={len(chosen)} "
            f"MB_per_s={mbs:.0f} o_direct={direct}",
            flush=True,
        )


if __name__ == "__main__":
    main()
