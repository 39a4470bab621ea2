"""The read-time repack of a shipped int4 expert (GPTQ, AWQ, compressed-tensors) into the int4 layout.

    python bench/repack_bench.py [--hidden 2048] [--inter 768] [--group 128] [--repeats 20] [--threads 1]

A disk-streamed tier repacks every expert it reads (experts/layout.py `ExpertSource.convert`), so
this is CPU time added to each miss. Default shape: one Qwen3-30B-A3B expert (gate/up [768, 2048],
down [2048, 768]), random codes (the repack does the same work for any values). One line per format:
shipped MB per expert, ms per expert (median of --repeats after a warm-up), MB/s of shipped bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import hardware_line


def shipped(fmt: str, N: int, K: int, G: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random stored tensors of one [N, K] linear in `fmt`'s layout (suffix -> tensor)."""

    def words(*shape):
        return torch.randint(-(1 << 31), 1 << 31, shape, dtype=torch.int64, generator=gen).to(torch.int32)

    ng = K // G
    scales = torch.rand(ng, N, generator=gen).to(torch.float16) / 100
    if fmt == "gptq":
        return {
            "qweight": words(K // 8, N),
            "qzeros": words(ng, N // 8),
            "scales": scales,
            "g_idx": (torch.arange(K) // G).to(torch.int32),
        }
    if fmt == "awq":
        return {"qweight": words(K, N // 8), "qzeros": words(ng, N // 8), "scales": scales}
    return {
        "weight_packed": words(N, K // 8),
        "weight_scale": scales.T.contiguous().to(torch.bfloat16),
        "weight_shape": torch.tensor([N, K]),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from expertcache.quant.awq import AWQ
    from expertcache.quant.compressed import PackQuantized
    from expertcache.quant.gptq import GPTQ

    torch.set_num_threads(args.threads)
    print(hardware_line(), f"threads={args.threads}")
    H, I, G = args.hidden, args.inter, args.group
    methods = {
        "gptq": GPTQ(bits=4, group_size=G, sym=False),
        "awq": AWQ(group_size=G),
        "compressed-tensors": PackQuantized(bits=4, group_size=G, symmetric=True),
    }
    for fmt, method in methods.items():
        gen = torch.Generator().manual_seed(0)
        tier = method.tier(max(H, I))
        raw = {}
        for proj, (N, K) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            raw.update({f"{proj}.{k}": v for k, v in shipped(fmt, N, K, G, gen).items()})
        nbytes = sum(t.nbytes for t in raw.values())

        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        dst = {
            k: torch.empty(spec.shape, dtype=spec.dtype)
            for proj, shape in shapes.items()
            for k, spec in tier.layout(proj, shape).items()
        }

        def once():  # what ExpertSource.convert does: repack, then write the tier's parts
            for proj in shapes:
                for suffix, t in method.repack(raw, proj, tier).items():
                    dst[f"{proj}.{suffix}"].copy_(t)

        once()  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        print(
            f"repack format={fmt} shape=H{H}xI{I} group={G} shipped_mb={nbytes / 1e6:.3f} ms_per_expert={ms:.2f} "
            f"mb_per_s={nbytes / 1e6 / (ms / 1e3):.0f}"
        )


if __name__ == "__main__":
    main()
