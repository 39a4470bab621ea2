"""Decode-shaped weight streaming through the CPU kernels at the yardstick's shapes (T=1): a MoE
layer's top-8 experts (64 per layer, 16 layers cycled so nothing stays in cache), the fused q/k/v and
o projections, and lm_head, for several work-unit sizes (kernels.ROWS_PER_UNIT: rows of 2-byte weights;
other formats take the rows of about the same bytes, kernels.UNIT_ROWS) and CPU maths
(`--cpu-math`) run alternately round by round in one process, so the comparison survives a noisy
machine. --format int8 quantizes the experts, the attention projections and lm_head (group 128).
--format mxfp4 streams MoE layers of gpt-oss-20b's shape instead (32 experts top-4, hidden 2880,
intermediate 2880, MXFP4 experts as shipped: interleaved gate_up with biases, clamped SwiGLU; random
codes, 3 layers cycled), --format int4 those of Qwen3-30B-A3B (128 experts top-8, hidden 2048,
intermediate 768, split gate / up, SiLU; int4 group 128 with zero points, as community
quantizations ship it; 2 layers cycled), on each ISA of --isa (avx512: the kernels the CPU dispatches
to; avx2: the fallback), and prints the kernel that ran. --prefetch: rows ahead a single row's stream
prefetches in the AVX-512 kernels (0: none), alternated like the other settings.

    python bench/stream_bench.py [--threads 2] [--rows 256] [--cpu-math exact fast] [--format bf16] [--rounds 12]
    python bench/stream_bench.py --format mxfp4 --cpu-math exact fast --isa avx512 avx2
    python bench/stream_bench.py --format int4 --cpu-math exact fast --isa avx512 avx2

One line per configuration: GB/s of weight bytes (wall clock, median over rounds) for the MoE layers,
the attention projections and lm_head, and the MoE's GB/s in CPU time of the calling thread with
--threads 1 (robust to being descheduled); plus the machine's read bandwidth, and for --format mxfp4 /
int4 each rate's share of it (of_read: wall clock against the probe's; cpu_of_read_cpu: CPU time
against the probe's in CPU time; of_round_read / cpu_of_round_read_cpu: the median over rounds of each
round's rate against a probe taken in that round, with its range, since a shared machine's memory
bandwidth drifts within a run).
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
from expertcache.experts.compute import ExpertFFN  # noqa: E402
from expertcache.layers.basic import QuantizedWeight, linear  # noqa: E402
from expertcache.quant import make_quant_method  # noqa: E402

L, S, H, I, K, V = 16, 64, 1024, 512, 8, 151936


def _int8(w: torch.Tensor, proj: str) -> dict[str, torch.Tensor]:
    """bf16 [S, N, K] -> int8 pool parts {proj.weight, proj.weight_scale} (group 128)"""
    m = make_quant_method("int8", group_size=128)
    parts = [m.pack({f"{proj}.weight": w[s].float()}) for s in range(w.shape[0])]
    return {k: torch.stack([p[k] for p in parts]) for k in parts[0]}


def _mxfp4_pool(S: int, H: int, I: int) -> dict[str, torch.Tensor]:
    """A gpt-oss expert pool as shipped (random codes, e8m0 scales around 2^-6)."""
    codes = lambda n, k: torch.randint(0, 256, (S, n, k // 32, 16), dtype=torch.uint8)  # noqa: E731
    scales = lambda n, k: torch.randint(118, 124, (S, n, k // 32)).to(torch.uint8)  # noqa: E731
    return {
        "gate_up.weight_blocks": codes(2 * I, H),
        "gate_up.weight_scales": scales(2 * I, H),
        "down.weight_blocks": codes(H, I),
        "down.weight_scales": scales(H, I),
        "gate_up_bias": torch.randn(S, 2 * I) * 0.1,
        "down_bias": torch.randn(S, H) * 0.1,
    }


def _int4_pool(S: int, H: int, I: int, group: int = 128) -> dict[str, torch.Tensor]:
    """A Qwen-style int4 expert pool (split gate / up; random codes, scales and zero points)."""

    def parts(proj: str, n: int, k: int) -> dict[str, torch.Tensor]:
        return {
            f"{proj}.weight": torch.randint(0, 256, (S, n, k // 2), dtype=torch.uint8),
            f"{proj}.weight_scale": torch.rand(S, n, k // group) * 0.01,
            f"{proj}.weight_zero": torch.randint(6, 10, (S, n, k // group)).to(torch.uint8),
        }

    return {**parts("gate", I, H), **parts("up", I, H), **parts("down", H, I)}


SHAPES = {  # format -> (shape name, layers cycled, experts, hidden, intermediate, top-k)
    "mxfp4": ("gpt-oss-20b", 3, 32, 2880, 2880, 4),
    "int4": ("qwen3-30b-a3b", 2, 128, 2048, 768, 8),
}


def shaped_main(a) -> None:
    """MoE layers of a real model's shape (SHAPES), T=1, per (cpu math, ISA): GB/s of expert bytes."""
    name, Lm, Sm, Hm, Im, Km = SHAPES[a.format]
    if a.format == "mxfp4":
        method = make_quant_method("mxfp4")
        ffn = ExpertFFN(act="clamped_swiglu", interleaved=True, fused_quant=True, alpha=1.702, limit=7.0)
        pools = [_mxfp4_pool(Sm, Hm, Im) for _ in range(Lm)]
    else:
        method, ffn = make_quant_method("int4", group_size=128), None
        pools = [_int4_pool(Sm, Hm, Im) for _ in range(Lm)]
    per_expert = sum(t[0].nbytes for k, t in pools[0].items() if "bias" not in k)
    moe_b = Lm * Km * per_expert
    ext = kernels.extension()
    spec = kernels.moe_args(pools[0], method, Hm, ffn)[0]
    print(hardware_line())
    read_cpu = read_bandwidth(cpu_time=True) if a.threads == 1 else None
    read = read_bandwidth()
    cpu = f" read_cpu_GBps={read_cpu:.1f} (in CPU time)" if read_cpu else ""
    print(f"memory: read_GBps={read:.1f} (256 MiB float32 sum, {a.threads} threads){cpu}")
    x, out, w = torch.randn(1, Hm), torch.zeros(1, Hm), torch.rand(1, Km)
    configs = [(r, m, i, p) for r in a.rows for m in a.cpu_math for i in a.isa for p in a.prefetch]
    res = {c: [] for c in configs}
    saved, saved_pf = ext.get_avx512(), ext.get_prefetch_rows()
    try:
        with kernels.cpu_threads("cpu"):
            for rnd in range(a.rounds + 2):
                slots = [torch.randperm(Sm)[:Km][None] for _ in range(Lm)]
                # this round's probes, against which its rates are taken (the machine's share changes)
                probe = read_bandwidth() * 1e9, read_bandwidth(cpu_time=True) * 1e9 if read_cpu else None
                for r, m, i, p in configs if rnd % 2 else configs[::-1]:
                    kernels.ROWS_PER_UNIT = r
                    ext.set_avx512(i == "avx512")
                    ext.set_prefetch_rows(p)
                    with kernels.cpu_math(m):
                        c0, t0 = time.thread_time(), time.perf_counter()
                        for j in range(Lm):
                            assert kernels.moe(x, slots[j], w, pools[j], method, out, ffn)
                        c1, t1 = time.thread_time(), time.perf_counter()
                    if rnd >= 2:
                        wall, cpu_t = moe_b / (t1 - t0), moe_b / (c1 - c0)
                        res[r, m, i, p].append(
                            (
                                wall,
                                cpu_t,
                                (t1 - t0) / Lm,
                                wall / probe[0],
                                cpu_t / probe[1] if probe[1] else 0.0,
                            )
                        )
        for (r, m, i, p), v in res.items():
            ext.set_avx512(i == "avx512")
            med = [statistics.median(x[k] for x in v) for k in range(5)]
            kernel = ext.kernel_of(spec, kernels.CPU_MATHS[m])
            print(
                f"stream: format={a.format} shape={name} cpu_math={m} isa={i} kernel={kernel} rows_per_unit={r} "
                f"prefetch_rows={p} threads={a.threads} expert_MB={per_expert / 1e6:.1f} top_k={Km} "
                f"ms_per_layer={med[2] * 1e3:.2f} moe_GBps={med[0] / 1e9:.1f} "
                f"moe_cpu_GBps={med[1] / 1e9:.1f} of_read={100 * med[0] / (read * 1e9):.0f}% "
                f"of_round_read={100 * med[3]:.0f}% ({100 * min(x[3] for x in v):.0f}-{100 * max(x[3] for x in v):.0f})"
                + (
                    f" cpu_of_read_cpu={100 * med[1] / (read_cpu * 1e9):.0f}% cpu_of_round_read_cpu={100 * med[4]:.0f}%"
                    if read_cpu
                    else ""
                )
            )
    finally:
        ext.set_avx512(saved)
        ext.set_prefetch_rows(saved_pf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[kernels.ROWS_PER_UNIT])
    ap.add_argument("--cpu-math", nargs="+", default=["exact"], choices=list(kernels.CPU_MATHS))
    ap.add_argument("--format", default="bf16", choices=["bf16", "int8", *SHAPES])
    ap.add_argument(
        "--isa", nargs="+", default=["avx512"], choices=["avx512", "avx2"], help="mxfp4 / int4 only"
    )
    ap.add_argument("--prefetch", type=int, nargs="+", default=[4], help="rows ahead (AVX-512 kernels)")
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args()
    for m in a.cpu_math:
        if kernels.cpu_math_unavailable(m):
            sys.exit(f"--cpu-math {m}: {kernels.cpu_math_unavailable(m)}")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.format in SHAPES:
        shaped_main(a)
        return
    bf = lambda *shape: (torch.randn(*shape) * 0.02).bfloat16()  # noqa: E731
    method = make_quant_method("int8", group_size=128) if a.format == "int8" else None
    if method is None:
        pools = [{"gate_up": bf(S, 2 * I, H), "down": bf(S, H, I)} for _ in range(L)]
        head, moe_b = bf(V, H), L * K * 3 * I * H * 2
    else:
        pools = [
            {**_int8(bf(S, I, H), "gate"), **_int8(bf(S, I, H), "up"), **_int8(bf(S, H, I), "down")}
            for _ in range(L)
        ]
        head = QuantizedWeight(bf(V, H).float(), method)
        moe_b = L * K * sum(t[0].nbytes for t in pools[0].values())
    attn = [(bf(1536, H), bf(H, H)) for _ in range(L)]
    if method is not None:  # as --dense int8
        attn = [tuple(QuantizedWeight(w.float(), method) for w in pair) for pair in attn]
    size = lambda w: w.nbytes if method is not None else w.numel() * 2  # noqa: E731
    attn_b, head_b = sum(size(w) for pair in attn for w in pair), size(head)
    print(hardware_line())
    print(f"memory: read_GBps={read_bandwidth():.1f} (256 MiB float32 sum, {a.threads} threads)")
    x, out, w = torch.randn(1, H), torch.zeros(1, H), torch.rand(1, K)
    configs = [(r, m, p) for r in a.rows for m in a.cpu_math for p in a.prefetch]
    res = {c: [] for c in configs}
    saved_pf = kernels.extension().get_prefetch_rows()
    with kernels.cpu_threads("cpu"):
        for rnd in range(a.rounds + 2):
            slots = [torch.randperm(S)[:K][None] for _ in range(L)]
            for r, m, p in configs if rnd % 2 else configs[::-1]:
                kernels.ROWS_PER_UNIT = r
                kernels.extension().set_prefetch_rows(p)
                with kernels.cpu_math(m):
                    c0, t0 = time.thread_time(), time.perf_counter()
                    for i in range(L):
                        assert kernels.moe(x, slots[i], w, pools[i], method, out)
                    c1, t1 = time.thread_time(), time.perf_counter()
                    for qkv, o in attn:
                        linear(x, qkv)
                        linear(x, o)
                    t2 = time.perf_counter()
                    linear(x, head)
                    t3 = time.perf_counter()
                if rnd >= 2:  # warm-up rounds dropped
                    res[r, m, p].append(
                        (moe_b / (t1 - t0), moe_b / (c1 - c0), attn_b / (t2 - t1), head_b / (t3 - t2))
                    )
    kernels.extension().set_prefetch_rows(saved_pf)
    for (r, m, p), v in res.items():
        med = [statistics.median(x[i] for x in v) / 1e9 for i in range(4)]
        print(
            f"stream: format={a.format} cpu_math={m} rows_per_unit={r} prefetch_rows={p} threads={a.threads} moe_GBps={med[0]:.1f} "
            f"moe_cpu_GBps={med[1]:.1f} attn_GBps={med[2]:.1f} lm_head_GBps={med[3]:.1f}"
        )


if __name__ == "__main__":
    main()
