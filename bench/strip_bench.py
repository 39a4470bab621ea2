"""The 4-bit strips of the fast math (csrc/nibble_kernels.cpp: from `get_strip_tokens()` tokens of a
weight, 32 rows decoded once per 512 features with the rows in the lanes) against the pairs of rows they
replace (`set_strip_tokens(0)`), and where the CPU has AMX the strips on AMX against the strips on VNNI
(`set_amx`), alternating round by round in one process so the comparison survives a busy machine:

- per weight (--shapes ROWSxCOLS, MXFP4 and int4 group 128, random codes) and token count: ms per call and
  GOPS (2 x T x rows x cols per second) in the calling thread's CPU time with --threads 1 (robust to being
  descheduled), in wall-clock time with more threads, beside torch's bf16 matmul of the same shape
  (oneDNN; the prefill route of kernels/prefill_gemm.py);
- with --moe: whole MoE layers through the fused call (kernels.moe) at prefill token counts, gpt-oss-20b's
  (32 experts top-4, hidden 2880, intermediate 2880, MXFP4 as shipped: interleaved gate_up with biases,
  clamped SwiGLU) and Qwen3-30B-A3B's (128 experts top-8, hidden 2048, intermediate 768, int4 group 128
  with zero points, SiLU), tokens routed uniformly at random: ms per layer (wall and CPU time) and GOPS
  (CPU time with --threads 1, else wall).

The peak line: torch's bf16 matmul at 512 x 2880 x 2880 (GFLOP/s, CPU time), the machine's matrix-unit
figure the kernels are compared with.

    python bench/strip_bench.py [--threads 1] [--shapes 2880x2880 768x2048 2048x768]
                                [--tokens 4 8 16 32 64 128]
    python bench/strip_bench.py --moe [--moe-tokens 128 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import hardware_line  # noqa: E402
from stream_bench import SHAPES, _int4_pool, _mxfp4_pool  # noqa: E402

from expertcache import kernels  # noqa: E402
from expertcache.experts.compute import ExpertFFN  # noqa: E402
from expertcache.kernels.formats import INT4, MXFP4  # noqa: E402
from expertcache.quant import make_quant_method  # noqa: E402

WAYS = {
    "strips-amx": (4, True),
    "strips": (4, False),
    "pairs": (0, False),
}  # (set_strip_tokens, set_amx) per way


def ways(ext) -> dict:
    """The ways this CPU has: the strips on AMX only where it has AMX-TILE/INT8."""
    return {w: v for w, v in WAYS.items() if ext.amx_supported() or not v[1]}


def _spec(fmt: str, n: int, k: int) -> tuple:
    """A random weight [n, k] in the kernels' spec (MXFP4: e8m0 around 2^-6; int4: group 128, zero points)."""
    codes = torch.randint(0, 256, (1, n, k // 2), dtype=torch.uint8)
    if fmt == "mxfp4":
        return (MXFP4, codes, None, torch.randint(118, 124, (1, n, -(-k // 32))).to(torch.uint8), n, k, 32, 1)
    ng = -(-k // 128)
    zero = torch.randint(6, 10, (1, n, ng)).to(torch.uint8)
    return (INT4, codes, torch.rand(1, n, ng) * 0.01, zero, n, k, 128, 1)


def _timed(fn) -> tuple[float, float]:
    c, t = time.thread_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t, time.thread_time() - c


def _alternate(runs: dict, reps: int) -> dict:
    """{name: fn} run round by round (order reversed every other round)
    -> {name: (median wall s, median cpu s)}."""
    for fn in runs.values():
        fn()
    res = {k: [] for k in runs}
    names = list(runs)
    for r in range(reps):
        for k in names if r % 2 else names[::-1]:
            res[k].append(_timed(runs[k]))
    return {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in res.items()
    }


def _way(ext, setting: tuple, fn):
    def run():
        ext.set_strip_tokens(setting[0])
        ext.set_amx(setting[1])
        return fn()

    return run


def _ratios(med: dict, at: int) -> str:
    """strips over pairs (and AMX over the VNNI strips where both ran), from times column `at`."""
    out = f" strips_over_pairs={med['pairs'][at] / med['strips'][at]:.2f}"
    if "strips-amx" in med:
        out += f" amx_over_strips={med['strips'][at] / med['strips-amx'][at]:.2f}"
    return out


def peak(reps: int) -> float:
    """torch's bf16 matmul, 512 x 2880 x 2880: GFLOP/s (CPU time on one thread, else wall)."""
    x, w = torch.randn(512, 2880).bfloat16(), torch.randn(2880, 2880).bfloat16()
    wall, cpu = _alternate({"mm": lambda: F.linear(x, w)}, reps)["mm"]
    return 2 * 512 * 2880 * 2880 / (cpu if torch.get_num_threads() == 1 else wall) / 1e9


def weights(a, ext) -> None:
    math = kernels.CPU_MATHS["fast"]
    for fmt in a.formats:
        for shape in a.shapes:
            n, k = map(int, shape.split("x"))
            spec = _spec(fmt, n, k)
            wb = torch.randn(n, k).bfloat16()
            for T in a.tokens:
                x = torch.randn(T, k)
                xb = x.bfloat16()
                call = partial(ext.linear, x, spec, 0, 1 << 30, n, math)  # the whole weight in one unit
                runs = {w: _way(ext, s, call) for w, s in ways(ext).items()}
                runs["torch_bf16"] = lambda: F.linear(xb, wb)
                med = _alternate(runs, a.reps)
                ext.set_strip_tokens(WAYS["strips"][0])
                gop, at = 2 * T * n * k / 1e9, 1 if a.threads == 1 else 0
                print(
                    f"strip: format={fmt} rows={n} cols={k} T={T} kernel={ext.kernel_of(spec, math)} "
                    + " ".join(f"{w}_ms={med[w][at] * 1e3:.3f} {w}_GOPS={gop / med[w][at]:.0f}" for w in runs)
                    + _ratios(med, at),
                    flush=True,
                )


def moe(a, ext) -> None:
    for fmt in ("mxfp4", "int4"):
        name, _, S, H, I, K = SHAPES[fmt]
        if fmt == "mxfp4":
            method = make_quant_method("mxfp4")
            ffn = ExpertFFN(act="clamped_swiglu", interleaved=True, fused_quant=True, alpha=1.702, limit=7.0)
            pool = _mxfp4_pool(S, H, I)
        else:
            method, ffn, pool = make_quant_method("int4", group_size=128), None, _int4_pool(S, H, I)
        for T in a.moe_tokens:
            x = torch.randn(T, H)
            slots = torch.stack([torch.randperm(S)[:K] for _ in range(T)])
            w = torch.rand(T, K)

            def layer():
                out = torch.zeros(T, H)
                with kernels.cpu_math("fast"):
                    assert kernels.moe(x, slots, w, pool, method, out, ffn)

            with kernels.cpu_threads("cpu"):
                med = _alternate({way: _way(ext, s, layer) for way, s in ways(ext).items()}, a.reps)
            ext.set_strip_tokens(WAYS["strips"][0])
            gop = 2 * T * K * 3 * H * I / 1e9
            at = 1 if a.threads == 1 else 0  # GOPS: the calling thread's CPU time on one thread, else wall
            print(
                f"moe: format={fmt} shape={name} T={T} experts={S} top_k={K} "
                f"tokens_per_expert={T * K / S:.0f} threads={a.threads} "
                + " ".join(
                    f"{way}_ms={med[way][0] * 1e3:.1f} {way}_cpu_ms={med[way][1] * 1e3:.1f} "
                    f"{way}_GOPS={gop / med[way][at]:.0f}"
                    for way in med
                )
                + _ratios(med, 1),
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--formats", nargs="+", default=["mxfp4", "int4"], choices=["mxfp4", "int4"])
    ap.add_argument("--shapes", nargs="+", default=["2880x2880", "768x2048", "2048x768"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    ap.add_argument("--moe", action="store_true", help="whole MoE layers instead of single weights")
    ap.add_argument("--moe-tokens", type=int, nargs="+", default=[128, 512])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(hardware_line())
    if kernels.backend() != "cpp":
        sys.exit(f"the C++ kernels are not available: {kernels.why()}")
    if kernels.cpu_math_unavailable("fast") or not kernels.extension().avx512_supported():
        sys.exit("the 4-bit strips need the fast math's AVX-512 (F/BW/VL/VNNI/BF16)")
    ext = kernels.extension()
    saved = ext.get_strip_tokens(), ext.get_amx()
    clock = "CPU time" if a.threads == 1 else "wall clock"
    print(
        f"peak: torch_bf16_matmul_GFLOPs={peak(a.reps):.0f} (512 x 2880 x 2880, {clock}, {a.threads} threads)"
    )
    try:
        moe(a, ext) if a.moe else weights(a, ext)
    finally:
        ext.set_strip_tokens(saved[0])
        ext.set_amx(saved[1])


if __name__ == "__main__":
    main()
