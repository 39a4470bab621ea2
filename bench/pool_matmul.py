"""Prefill's bf16 matmul inside a forward: on the kernels' own threads (csrc/pool_gemm.cpp, the engine's
path) against torch's OpenMP matmul with its thread count raised for the call (the path before), and the
C++ bf16 kernel, alternating in one process; checks the pool's output equals torch's bitwise first.

    python bench/pool_matmul.py [--threads 2] [--rows 5120] [--cols 2880] [--tokens 512 128 32 16] [--reps 8]

One line per token count: min / median ms of each path and the pool's GFLOP/s at the median. Run it
beside other work (e.g. a niced test run) to see what a descheduled OpenMP thread costs each path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import hardware_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=5120)
    ap.add_argument("--cols", type=int, default=2880)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 128, 32, 16])
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertcache import kernels
    from expertcache.kernels import prefill_gemm

    torch.manual_seed(0)
    w = (torch.randn(a.rows, a.cols) * 0.02).bfloat16()
    spec = kernels.plain_spec(w.unsqueeze(0))
    print(hardware_line(), flush=True)
    with kernels.cpu_threads("cpu"), kernels.cpu_math("fast"):  # a forward's arrangement: torch on 1 thread
        for n in a.tokens:
            x = torch.randn(n, a.cols)
            assert torch.equal(prefill_gemm.bf16_linear(x, w), F.linear(x.bfloat16(), w).float())

            def omp():
                with prefill_gemm.gemm_threads():
                    return F.linear(x.bfloat16(), w).float()

            paths = {
                "pool": lambda: prefill_gemm.bf16_linear(x, w),
                "openmp": omp,
                "kernel": lambda: kernels.quant_linear(x, spec),
            }  # the C++ bf16 kernel (vdpbf16ps)
            times = {k: [] for k in paths}
            for _ in range(a.reps):
                for k, f in paths.items():
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            gflops = 2 * n * a.rows * a.cols / med["pool"] / 1e9
            print(
                f"pool_matmul: rows={a.rows} cols={a.cols} tokens={n} threads={a.threads} "
                + " ".join(f"{k}_ms={min(v) * 1e3:.2f}/{med[k] * 1e3:.2f}" for k, v in times.items())
                + f" pool_GFLOPs={gflops:.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
