"""The CPU kernels per weight format and token count: the AVX2 GEMV path (conversion in registers),
the AVX2 tiled path (a tile converted once, reused for every token), the kernel the CPU dispatches to
(the AVX-512 kernels where a format has one: mxfp4 in both maths, bf16 / int8 in fast math) and
torch's float32 matmul on a pre-converted copy (what the engine did before) and torch's bf16 matmul
(oneDNN; the prefill candidate on CPUs with AVX-512 BF16 / AMX), plus the machine's read bandwidth.

    python bench/kernel_bench.py [--rows 8192] [--cols 1024] [--threads 2] [--tokens 1 4 16 64 300]
                                 [--formats bf16 mxfp4] [--cpu-math exact]

One line per (format, T): ms per call (median of --reps, rounds alternating the five; wall clock
and, robust to a busy machine with --threads 1, the calling thread's CPU time), the dispatched
kernel's name, weight GB/s and GFLOP/s of the best. The SMALL_T table in
expertcache/kernels/__init__.py is read off these lines. A weight small enough for the caches
(e.g. --rows 256 --cols 2880: 0.4 MB of mxfp4) measures the decode alone, without memory.
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

from expertcache import kernels  # noqa: E402
from expertcache.kernels.formats import quant_spec  # noqa: E402
from expertcache.quant import make_quant_method  # noqa: E402

FORMATS = [("bf16", {}), ("fp8", {}), ("int8", {}), ("int4", {}), ("mxfp4", {})]


def read_bandwidth(mib: int = 256, reps: int = 5, cpu_time: bool = False) -> float:
    """GB/s of a float32 sum over `mib` MiB (the threads torch uses); cpu_time: over the calling
    thread's CPU time instead of the wall clock (meaningful with one thread: robust to being
    descheduled on a busy machine)."""
    a = torch.ones(mib << 18)
    a.sum()
    clock = time.thread_time if cpu_time else time.perf_counter
    ts = []
    for _ in range(reps):
        t = clock()
        a.sum()
        ts.append(clock() - t)
    return a.numel() * 4 / statistics.median(ts) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 300])
    ap.add_argument("--formats", nargs="+", default=[f for f, _ in FORMATS], choices=[f for f, _ in FORMATS])
    ap.add_argument("--cpu-math", default="exact", choices=list(kernels.CPU_MATHS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(hardware_line())
    if kernels.backend() != "cpp":
        sys.exit(f"the C++ kernels are not available: {kernels.why()}")
    print(f"memory: read_GBps={read_bandwidth():.1f} (256 MiB float32 sum, {args.threads} threads)")
    ext, N, K = kernels.extension(), args.rows, args.cols
    if kernels.cpu_math_unavailable(args.cpu_math):
        sys.exit(f"--cpu-math {args.cpu_math}: {kernels.cpu_math_unavailable(args.cpu_math)}")
    math, saved = kernels.CPU_MATHS[args.cpu_math], ext.get_avx512()

    def on(avx512: bool, f):
        def run():
            ext.set_avx512(avx512)
            return f()

        return run

    for fmt, params in (f for f in FORMATS if f[0] in args.formats):
        m = make_quant_method(fmt, **params)
        parts = m.pack({"p.weight": torch.randn(N, K)})
        nbytes = sum(t.numel() * t.element_size() for t in parts.values())
        spec = quant_spec(m, {k: v.unsqueeze(0) for k, v in parts.items()}, "p", N, K)
        wf = m.dequantize(parts, "p")
        for T in args.tokens:
            x = torch.randn(T, K)
            unit, small_t = kernels.rows_per_unit(spec[0]), kernels.SMALL_T[spec[0]]
            xb, wb = x.bfloat16(), wf.bfloat16()  # torch's bf16 GEMM (oneDNN: AVX-512 BF16 / AMX)
            runs = {
                "gemv": on(False, lambda: ext.linear(x, spec, 0, 1 << 30, unit, 0)),
                "tiled": on(False, lambda: ext.linear(x, spec, 0, 0, unit, 0)),
                "dispatched": on(True, lambda: ext.linear(x, spec, 0, small_t, unit, math)),
                "torch_fp32": lambda: F.linear(x, wf),
                "torch_bf16": lambda: F.linear(xb, wb),
            }
            times = {k: [] for k in runs}
            cpu = {k: [] for k in runs}
            for f in runs.values():
                f()
            for _ in range(args.reps):
                for k, f in runs.items():
                    c, t = time.thread_time(), time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t)
                    cpu[k].append(time.thread_time() - c)
            ext.set_avx512(True)
            med = {k: statistics.median(v) for k, v in times.items()}
            mcpu = {k: statistics.median(v) for k, v in cpu.items()}
            best = min(("gemv", "tiled", "dispatched"), key=med.get)
            print(
                f"kernel: format={fmt} rows={N} cols={K} T={T} cpu_math={args.cpu_math} "
                f"dispatched={ext.kernel_of(spec, math)} gemv_ms={med['gemv'] * 1e3:.3f} "
                f"tiled_ms={med['tiled'] * 1e3:.3f} dispatched_ms={med['dispatched'] * 1e3:.3f} "
                f"torch_fp32_ms={med['torch_fp32'] * 1e3:.3f} torch_bf16_ms={med['torch_bf16'] * 1e3:.3f} "
                f"gemv_cpu_ms={mcpu['gemv'] * 1e3:.3f} "
                f"tiled_cpu_ms={mcpu['tiled'] * 1e3:.3f} dispatched_cpu_ms={mcpu['dispatched'] * 1e3:.3f} "
                f"best={best} weight_GBps={nbytes / med[best] / 1e9:.1f} "
                f"GFLOPs={2 * T * N * K / med[best] / 1e9:.1f}",
                flush=True,
            )
    ext.set_avx512(saved)


if __name__ == "__main__":
    main()
