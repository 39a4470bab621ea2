"""GGUF block kernels (csrc/ggml_kernels.cpp) streaming Qwen3-30B-A3B-shaped experts through the fused MoE call.

Decode (T tokens, default 1) of MoE layers of Qwen3-30B-A3B's shape (hidden 2048, intermediate 768: gate /
up 768 x 2048, down 2048 x 768, SiLU, top-8 of 128 experts, 2 layers cycled), the experts' weights in GGUF
blocks of each --types entry (`q4_k_m`: q4_k gate / up with a q6_k down, as stock Q4_K_M stores half the
layers), beside the project's own 4-bit kernels at the same shape (`int4`: group 128 with zero points;
`mxfp4`: e2m1 codes with e8m0 scales per 32), in each CPU math and thread count, alternated round by round
in one process with a read probe (a float32 sum over --probe-mib MiB) taken in every round. Weight bytes
are one random buffer (bytes 0x20..0x3b: every fp16 scale a normal number, 2^-7..2^-1) viewed by every
type's pools, so all of them stream the same memory; nothing of a layer's top-8 is reused between calls
beyond chance (8 of 128 experts drawn per call).

    python bench/ggml_kernel_bench.py [--types q4_k q4_k_m q6_k q8_0 int4 mxfp4] [--threads 1 2]
                                      [--cpu-math exact fast] [--tokens 1] [--rounds 10]

One line per configuration: the kernel that ran (kernel_of of the gate projection), ms per layer, GB/s of
the expert bytes read (median over rounds) and its share of the round's read probe (median, range).

    python bench/ggml_kernel_bench.py --resident [--types ...] [--tokens 1 16 64 128]

--resident: the kernels alone, one 768 x 2048 weight of each type resident in L2, one thread, GB/s of its
bytes and GOPS (2 x tokens x rows x cols) over the calling thread's CPU time (robust to a busy machine: what
each kernel can compute, against which the streaming rates above are limited by memory); in fast math for
the types with prefill strips (from get_strip_tokens() tokens) also the row kernels they replace (`rows_`,
strips off), alternated round by round, and strips_over_rows (their time ratio).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import hardware_line
from kernel_bench import read_bandwidth

from expertcache import kernels
from expertcache.kernels.formats import GGUF_TYPES, INT4, MXFP4

H, I, S, L, TOPK = 2048, 768, 128, 2, 8
MIXES = {"q4_k_m": ("q4_k", "q4_k", "q6_k")}  # gate, up, down types of a named mix
OWN = {"int4": INT4, "own-mxfp4": MXFP4}  # the project's 4-bit formats (GGUF's mxfp4 is "mxfp4")


def _projections(t: str) -> tuple[str, str, str]:
    return MIXES.get(t, (t, t, t))


def _row_bytes(t: str, k: int) -> int:
    _, qk, nbytes = GGUF_TYPES[t]
    return k // qk * nbytes


def _proj_bytes(t: str, n: int, k: int) -> int:
    return n * (k // 2 if t in OWN else _row_bytes(t, k))


def _pool_specs(t: str, buf: torch.Tensor, E: int = L * S) -> tuple[tuple, int]:
    """-> ((gate, up, down) specs over `buf` for L layers of S experts, stacked [E, ...]), bytes per expert."""
    types_ = _projections(t)
    shapes = ((I, H), (I, H), (H, I))
    specs, off = [], 0
    for pt, (n, k) in zip(types_, shapes):
        nbytes = E * _proj_bytes(pt, n, k)
        data = buf[off : off + nbytes]
        off += nbytes
        if pt in OWN:
            codes = data.view(E, n, k // 2)
            if pt == "int4":
                scale = torch.rand(E, n, k // 128) * 0.01
                zero = torch.randint(6, 10, (E, n, k // 128)).to(torch.uint8)
                specs.append((INT4, codes, scale, zero, n, k, 128, 1))
            else:
                e8m0 = torch.randint(118, 124, (E, n, k // 32)).to(torch.uint8)
                specs.append((MXFP4, codes, None, e8m0, n, k, 32, 1))
        else:
            code, qk, _ = GGUF_TYPES[pt]
            specs.append((code, data.view(E, n, _row_bytes(pt, k)), None, None, n, k, qk, 1))
    return tuple(specs), off // (E)


def _cpu_time(fn, rounds: int) -> float:
    """Median seconds of the calling thread's CPU time per call of fn (5 calls a round)."""
    ts = []
    for _ in range(rounds):
        c = time.thread_time()
        for _ in range(5):
            fn()
        ts.append((time.thread_time() - c) / 5)
    return statistics.median(ts)


def resident(a) -> None:
    """Each type's kernel alone on one weight in L2 (gate's shape, 768 x 2048), one thread, CPU time; in fast
    math where the type has prefill strips, the strips beside the row kernels they replace
    (set_strip_tokens(0)), alternated round by round."""
    ext = kernels.extension()
    buf = torch.randint(0x20, 0x3C, (I * H * 4,), dtype=torch.uint8)  # 3 projections of up to 8.5 bits
    ext.set_threads(1)
    strips_from = ext.get_strip_tokens()
    for T in a.tokens:
        x = torch.randn(T, H)
        for t in a.types:
            spec = _pool_specs(t, buf, E=1)[0][0]
            nbytes = spec[1].nbytes
            for m in a.cpu_math:
                math = kernels.CPU_MATHS[m]
                kernel = ext.kernel_of(spec, math)
                ways = {"": strips_from}
                if kernel.endswith("+strips") and strips_from:
                    ways["rows_"] = 0  # the same call, strips off
                res = {w: [] for w in ways}
                for r in range(a.rounds * 2 + 1):
                    for w, st in ways.items() if r % 2 else list(ways.items())[::-1]:
                        ext.set_strip_tokens(st)
                        call = partial(ext.linear, x, spec, 0, 16, 1 << 20, math)
                        call()
                        if r:
                            res[w].append(_cpu_time(call, 1))
                ext.set_strip_tokens(strips_from)
                med = {w: statistics.median(v) for w, v in res.items()}
                line = " ".join(
                    f"{w}cpu_GBps={nbytes / s / 1e9:.1f} {w}GOPS={2 * T * I * H / s / 1e9:.0f}"
                    for w, s in med.items()
                )
                if "rows_" in med:
                    line += f" strips_over_rows={med['rows_'] / med['']:.2f}"
                print(
                    f"resident: type={t} shape={I}x{H} cpu_math={m} threads=1 tokens={T} kernel={kernel} "
                    f"weight_MB={nbytes / 1e6:.2f} {line}",
                    flush=True,
                )
    ext.set_threads(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--types",
        nargs="+",
        default=["q4_k", "q4_k_m", "q6_k", "q8_0", "q5_k", "iq4_xs", "q4_0", "mxfp4", "int4", "own-mxfp4"],
    )
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cpu-math", nargs="+", default=["exact", "fast"], choices=list(kernels.CPU_MATHS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1], help="several only with --resident")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--probe-mib", type=int, default=1024)
    ap.add_argument("--resident", action="store_true", help="the kernels alone on a weight in L2 (CPU time)")
    a = ap.parse_args()
    if kernels.backend() != "cpp":
        sys.exit(f"the C++ kernels are not available: {kernels.why()}")
    for m in a.cpu_math:
        if kernels.cpu_math_unavailable(m):
            sys.exit(f"--cpu-math {m}: {kernels.cpu_math_unavailable(m)}")
    for t in a.types:
        if t not in GGUF_TYPES and t not in MIXES and t not in OWN:
            sys.exit(
                f"--types: unknown type {t!r} (GGUF: {', '.join(GGUF_TYPES)}, mixes: {', '.join(MIXES)}, "
                f"the project's: {', '.join(OWN)})"
            )
    torch.manual_seed(0)
    print(hardware_line())
    if a.resident:
        resident(a)
        return
    if len(a.tokens) > 1:
        sys.exit("--tokens: one count without --resident")
    a.tokens = a.tokens[0]
    need = max(
        sum(L * S * _proj_bytes(pt, n, k) for pt, (n, k) in zip(_projections(t), ((I, H), (I, H), (H, I))))
        for t in a.types
    )
    buf = torch.randint(0x20, 0x3C, (need,), dtype=torch.uint8)
    pools = {t: _pool_specs(t, buf) for t in a.types}
    ext = kernels.extension()
    x, w = torch.randn(a.tokens, H), torch.rand(a.tokens, TOPK)
    configs = [(t, m, n) for t in a.types for m in a.cpu_math for n in a.threads]
    res = {c: [] for c in configs}
    probes = {n: [] for n in a.threads}
    for rnd in range(a.rounds + 2):
        slots = [torch.stack([torch.randperm(S)[:TOPK] + j * S for _ in range(a.tokens)]) for j in range(L)]
        distinct = sum(len(torch.unique(s)) for s in slots) / L  # experts read per layer
        probe = {}
        for n in a.threads:
            torch.set_num_threads(n)
            probe[n] = read_bandwidth(mib=a.probe_mib, reps=3)
            if rnd >= 2:
                probes[n].append(probe[n])
        torch.set_num_threads(1)
        for t, m, n in configs if rnd % 2 else configs[::-1]:
            specs, per_expert = pools[t]
            ext.set_threads(n)
            small_t = kernels.SMALL_T.get(specs[0][0], 16)
            t0 = time.perf_counter()
            for j in range(L):
                ext.moe(
                    x,
                    slots[j],
                    w,
                    *specs,
                    0,
                    1.0,
                    float("inf"),
                    None,
                    None,
                    None,
                    None,
                    small_t,
                    256,
                    kernels.CPU_MATHS[m],
                )
            dt = (time.perf_counter() - t0) / L
            if rnd >= 2:
                gbps = distinct * per_expert / dt / 1e9
                res[t, m, n].append((dt, gbps, gbps / probe[n]))
    ext.set_threads(0)
    for n in a.threads:
        print(
            f"memory: threads={n} read_GBps={statistics.median(probes[n]):.1f} "
            f"({a.probe_mib} MiB float32 sum, median of {len(probes[n])} rounds)"
        )
    for (t, m, n), v in res.items():
        specs, per_expert = pools[t]
        kernel = "/".join(dict.fromkeys(ext.kernel_of(s, kernels.CPU_MATHS[m]) for s in specs))
        share = [x[2] for x in v]
        print(
            f"ggml: type={t} shape=qwen3-30b-a3b cpu_math={m} threads={n} tokens={a.tokens} kernel={kernel} "
            f"expert_MB={per_expert / 1e6:.2f} ms_per_layer={statistics.median(x[0] for x in v) * 1e3:.2f} "
            f"moe_GBps={statistics.median(x[1] for x in v):.1f} of_round_read={100 * statistics.median(share):.0f}% "
            f"({100 * min(share):.0f}-{100 * max(share):.0f})"
        )


if __name__ == "__main__":
    main()
