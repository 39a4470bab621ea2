"""Decode-shaped weight streaming through the CPU kernels at the yardstick's shapes (bf16, T=1):
a MoE layer's top-8 experts (64 per layer, 16 layers cycled so nothing stays in cache), the fused
q/k/v and o projections, and lm_head, for several work-unit sizes (kernels.ROWS_PER_UNIT) run
alternately round by round in one process, so the comparison survives a noisy machine.

    python bench/stream_bench.py [--threads 2] [--rows 32 64 128] [--rounds 12]

One line per unit size: GB/s of weight bytes (wall clock, median over rounds) for the MoE layers,
the attention projections and lm_head, and the MoE's GB/s in CPU time of the calling thread with
--threads 1 (robust to being descheduled); plus the machine's read bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import hardware_line  # noqa: E402
from kernel_bench import read_bandwidth  # noqa: E402

from expertcache import kernels  # noqa: E402

L, S, H, I, K, V = 16, 64, 1024, 512, 8, 151936


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    bf = lambda *shape: (torch.randn(*shape) * 0.02).bfloat16()  # noqa: E731
    pools = [{"gate_up": bf(S, 2 * I, H), "down": bf(S, H, I)} for _ in range(L)]
    attn = [(bf(1536, H), bf(H, H)) for _ in range(L)]
    head = bf(V, H)
    print(hardware_line())
    print(f"memory: read_GBps={read_bandwidth():.1f} (256 MiB float32 sum, {a.threads} threads)")
    x, out, w = torch.randn(1, H), torch.zeros(1, H), torch.rand(1, K)
    moe_b, attn_b, head_b = L * K * 3 * I * H * 2, L * (1536 + H) * H * 2, V * H * 2
    res = {r: [] for r in a.rows}
    with kernels.cpu_threads("cpu"):
        for rnd in range(a.rounds + 2):
            slots = [torch.randperm(S)[:K][None] for _ in range(L)]
            for r in (a.rows if rnd % 2 else a.rows[::-1]):
                kernels.ROWS_PER_UNIT = r
                c0, t0 = time.thread_time(), time.perf_counter()
                for i in range(L):
                    kernels.moe(x, slots[i], w, pools[i], None, out)
                c1, t1 = time.thread_time(), time.perf_counter()
                for qkv, o in attn:
                    kernels.dense_linear(x, qkv)
                    kernels.dense_linear(x, o)
                t2 = time.perf_counter()
                kernels.dense_linear(x, head)
                t3 = time.perf_counter()
                if rnd >= 2:  # warm-up rounds dropped
                    res[r].append((moe_b / (t1 - t0), moe_b / (c1 - c0), attn_b / (t2 - t1), head_b / (t3 - t2)))
    for r, v in res.items():
        med = [statistics.median(x[i] for x in v) / 1e9 for i in range(4)]
        print(f"stream: rows_per_unit={r} threads={a.threads} moe_GBps={med[0]:.1f} moe_cpu_GBps={med[1]:.1f} "
              f"attn_GBps={med[2]:.1f} lm_head_GBps={med[3]:.1f}")


if __name__ == "__main__":
    main()
