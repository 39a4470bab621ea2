"""The fused MoE's host side per call, without a GPU: aten ops besides the Triton launches (counted with a
TorchDispatchMode, the launches stubbed) for the device alignment and for a host alignment, and the
host alignment's microseconds, at decode and prefill shapes.

    python bench/triton_host_cost.py [--rounds 7]

One line per shape: `triton_host_cost T=.. K=.. S=.. ops_device_align=.. ops_host_align=..
ops_host_align_sent=.. host_align_us=..` (median of alternating rounds; fixed seed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors; nothing is launched (the kernels are stubbed)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import hardware_line  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from expertcache.kernels import triton_moe as M  # noqa: E402

SHAPES = ((1, 8, 32), (4, 8, 32), (16, 8, 128), (2048, 8, 128))  # (T, K, S)


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def ops(fn) -> int:
    with Count() as c:
        fn()
    return c.n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    print(hardware_line(), flush=True)
    real = M.launches
    M.launches = lambda *a: [(_NoLaunch(), g, ar, c, o) for _k, g, ar, c, o in real(*a)]
    rng = np.random.default_rng(0)
    H, I = 64, 32
    for T, K, S in SHAPES:
        pool = {"gate_up": torch.randn(S, 2 * I, H), "down": torch.randn(S, H, I)}
        sl = np.stack([rng.permutation(S)[:K] for _ in range(T)])
        slots, x, w, out = torch.from_numpy(sl), torch.randn(T, H), torch.rand(T, K), torch.zeros(T, H)
        sent = M.alignment_to(M.host_alignment(sl, S), "cpu")
        dev = ops(lambda: M.fused_moe(x, slots, w, pool, out=out))
        host = ops(
            lambda: M.fused_moe(
                x, None, w, pool, out=out, alignment=M.alignment_to(M.host_alignment(sl, S), "cpu")
            )
        )
        host_sent = ops(lambda: M.fused_moe(x, None, w, pool, out=out, alignment=sent))
        n = max(1, 2000 // max(1, T))
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            for _ in range(n):
                M.host_alignment(sl, S)
            times.append((time.perf_counter() - t) / n * 1e6)
        print(
            f"triton_host_cost T={T} K={K} S={S} ops_device_align={dev} ops_host_align={host} "
            f"ops_host_align_sent={host_sent} host_align_us={sorted(times)[len(times) // 2]:.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
