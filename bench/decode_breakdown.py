"""Where a decode token's time goes: the engine's pieces timed in one process (each wrapped with a
wall-clock timer; CPU ops are synchronous, so the sums are exact), batch 1, every weight resident.

    python bench/decode_breakdown.py [MODEL_DIR] [--lm-head int8] [--dense int8] [--cpu-math auto|exact|fast] [--threads 2]
                                     [--tokens 64] [--prompt 9] [--rounds 3] [--fused-blocks]
                                     [--kv-cache-memory 64MiB] [--device-memory 100%]
    python bench/decode_breakdown.py MODEL_DIR --moe-gap [--cpu-math fast] [--threads 2] [--tokens 16] [--rounds 5]

MODEL_DIR defaults to the peer benchmark's yardstick (~/.cache/expertcache-peers/yardstick, built by
bench/peers/llama_cpp_bench.py). One line per piece (the last round): ms per decode step, calls per
step, us per call; nested pieces overlap (experts.forward is inside moe_total, the kernels inside both).

--moe-gap: the fused MoE call's expert bytes per second in the model against the same layers' experts
through the same call in a loop, every weight resident, configurations alternating round by round in
one process. The MoE job's time comes from the kernels' thread pool (EXPERTCACHE_POOL_STATS=1,
csrc/thread_pool.h): the same clock in the model (whichever path calls the kernel: the one-call layer
stack of csrc/decode_block.cpp or the Python path) and in the loops, with the job's split into the caller's
own units, its wait for the helper's last units and
the delay until the helper took its first unit. Configurations: `model` (greedy decode of --tokens
tokens), `loop` (every layer's MoE call with random distinct experts, --tokens times, nothing between),
`loop-attn` (the same with the layer's attention projections and, per token, lm_head between:
their bytes stream through the caches as in the model), `loop-6` (layers 0-5 only: the experts of 6
layers, as a 6-layer checkpoint holds them), `loop-spin` (`loop` with the attention projections' time
slept instead, the helper idle as long as between two MoE calls in the model), `loop-model-inputs`
(the model's own MoE inputs and routing of its warm-up decode, replayed back to back). Lines: `gap:` per
configuration (median of rounds; `model`: its decode steps only, a prompt-only run's MoE jobs taken off):
wall-clock us per MoE job and its GB/s of expert bytes, and the same
in CPU time (`cpu_us`: the threads' CPU time in the job's units; `expert_GBps_cpu`: the bytes over that
time divided by the threads, the rate with no thread descheduled: on a shared machine the figure to
compare); `pages:` the process's memory on 2 MiB pages.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import hardware_line, memory_pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "model", nargs="?", default=str(Path.home() / ".cache" / "expertcache-peers" / "yardstick")
    )
    ap.add_argument("--lm-head", default=None)
    ap.add_argument(
        "--cpu-math",
        default="auto",
        choices=["auto", "exact", "fast"],
        help="auto: LLM's default on this CPU (the lines name the math it resolved to)",
    )
    ap.add_argument("--dense", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--prompt", type=int, default=9, help="prompt tokens (--prompt 128 --tokens 0: a prefill alone)"
    )
    ap.add_argument(
        "--kv-cache-memory",
        default="64MiB",
        help="LLM(kv_cache_memory=...): a 48-layer model needs more than 64MiB",
    )
    ap.add_argument(
        "--device-memory",
        default="100%",
        help="LLM(device_memory=...): 100%% holds every expert (the measurements assume them resident)",
    )
    ap.add_argument(
        "--fused-blocks", action="store_true", help="the one-call attention block (default: the Python path)"
    )
    ap.add_argument(
        "--moe-gap", action="store_true", help="the MoE call in the model against loops (see above)"
    )
    a = ap.parse_args()
    if a.moe_gap:
        os.environ["EXPERTCACHE_POOL_STATS"] = "1"  # read by the pool at its first job
        torch.set_num_threads(a.threads)
        moe_gap(a)
        return
    torch.set_num_threads(a.threads)
    import expertcache.kernels as K
    from expertcache import LLM, SamplingParams
    from expertcache.layers import attention
    from expertcache.models import transformer

    llm = LLM(
        a.model,
        max_model_len=max(512, a.prompt + a.tokens + 8),
        kv_cache_memory=a.kv_cache_memory,
        device_memory=a.device_memory,
        prefix_caching=False,
        lm_head=a.lm_head,
        cpu_math=a.cpu_math,
        dense=a.dense,
    )
    a.cpu_math = llm.config.kernels.cpu_math  # auto resolved
    prompt = [3 + i % 2000 for i in range(a.prompt)]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    spent, calls = collections.Counter(), collections.Counter()

    def wrap(obj, name, key):
        f = getattr(obj, name)

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                spent[key] += time.perf_counter() - t0
                calls[key] += 1

        setattr(obj, name, timed)

    m = llm.model
    m.fused_blocks = a.fused_blocks
    for obj, name, key in [
        (attention.Attention, "__call__", "attention"),
        (m, "_moe", "moe_total"),
        (m.experts, "forward", "experts.forward"),
        (m, "_route", "route"),
        (m, "forward", "forward"),
        (transformer, "linear", "lm_head"),
        (K, "moe_out", "kernels.moe"),
        (K, "attn_block", "kernels.attn_block"),
        (K, "dense_linear", "kernels.dense_linear"),
        (K, "quant_linear", "kernels.quant_linear"),
        (attention, "attend", "kernels.attend"),
    ]:
        wrap(obj, name, key)
    params = SamplingParams(max_tokens=a.tokens + 1, temperature=0.0, ignore_eos=True)
    print(hardware_line())
    for _ in range(a.rounds):
        spent.clear()
        calls.clear()
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        wall = time.perf_counter() - t0
    steps = calls["forward"]
    print(
        f"decode: model={Path(a.model).name} steps={steps} tok_s={steps / wall:.2f} (wall, the prompt's step included)"
    )
    for key, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(
            f"piece: name={key} ms_per_step={v / steps * 1e3:.3f} calls_per_step={calls[key] / steps:.1f} "
            f"us_per_call={v / calls[key] * 1e6:.1f}"
        )
    print(f"piece: name=outside_forward ms_per_step={(wall - spent['forward']) / steps * 1e3:.3f}")


def pool_stats(lib, reset: bool = True) -> dict[int, tuple]:
    """The pool's per-site sums (thread_pool.h) -> site: (jobs, units, helper units, ns, caller work ns,
    caller wait ns, ns to a helper's first unit, CPU ns in units)."""
    buf = (ctypes.c_int64 * (9 * 64))()
    n = lib.expertcache_pool_stats(buf, 64, int(reset))
    return {buf[9 * i]: tuple(buf[9 * i + 1 : 9 * i + 9]) for i in range(n)}


def huge_pages_line() -> str:
    return "pages: " + " ".join(f"{k}={v:.2f}" for k, v in memory_pages().items())


def moe_gap(a) -> None:
    import expertcache.kernels as K
    from expertcache import LLM, SamplingParams
    from expertcache.layers.basic import linear

    llm = LLM(
        a.model,
        max_model_len=max(512, a.prompt + a.tokens + 8),
        kv_cache_memory=a.kv_cache_memory,
        device_memory=a.device_memory,
        prefix_caching=False,
        lm_head=a.lm_head,
        cpu_math=a.cpu_math,
        dense=a.dense,
    )
    a.cpu_math = llm.config.kernels.cpu_math  # auto resolved
    m, src = llm.model, llm.source
    prompt = [3 + i % 2000 for i in range(a.prompt)]
    params = SamplingParams(max_tokens=a.tokens + 1, temperature=0.0, ignore_eos=True)
    recorded = []  # the model's own MoE inputs (layer, x, ids, weights), for `loop-model-inputs`
    forward = m.experts.forward

    def record(i, x, ids, w):
        if x.shape[0] == 1:
            recorded.append((i, x.clone(), ids.clone(), w.float().clone()))
        return forward(i, x, ids, w)

    m.experts.forward = record
    llm.generate([prompt], params)  # warm-up
    m.experts.forward = forward
    ext = K.extension()
    lib = ctypes.CDLL(ext.__file__)
    H, E, k = m.cfg.hidden_size, src.cfg.num_experts, src.cfg.top_k
    args = {i: m.experts.kernel_moe_args(i, H) for i, layer in enumerate(m.layers) if "router" in layer}
    layers = [i for i, v in args.items() if v is not None]
    if not layers:
        raise SystemExit(
            f"--moe-gap: no MoE layer of {a.model} runs on the fused MoE kernel (experts not resident?)"
        )
    attn = {
        i: (m.layers[i]["attn"].w.get("qkv_proj.weight"), m.layers[i]["attn"].w.get("o_proj.weight"))
        for i in layers
    }
    per_call = src.expert_nbytes * k
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(len(layers), 1, H, generator=g)
    w = torch.full((1, k), 1.0 / k)
    print(hardware_line())
    print(huge_pages_line())
    with K.cpu_threads("cpu"), K.cpu_math(a.cpu_math):
        math = K._math[0]

        def call(i, x):
            out = torch.zeros(1, H)
            ids = torch.randperm(E, generator=g)[:k][None]
            ext.moe(x, ids, w, *args[i][:9], out, *args[i][9:], math)
            return out

        pool_stats(lib)
        call(layers[0], xs[0])
        site = max(pool_stats(lib).items(), key=lambda kv: kv[1][3])[
            0
        ]  # the MoE job (its add is serial at T=1)
        x_attn = torch.randn(1, H, generator=g)
        qkv_t = []

        def loop(which, with_attn=False, sleep=0.0):
            for _ in range(a.tokens):
                for j, i in enumerate(which):
                    call(i, xs[j])
                    if with_attn and attn[i][0] is not None:
                        t0 = time.perf_counter()
                        q = linear(x_attn, attn[i][0])
                        linear(torch.zeros(1, attn[i][1].shape[1]), attn[i][1])
                        qkv_t.append(time.perf_counter() - t0)
                        del q
                    if sleep:
                        time.sleep(sleep)
                if with_attn:
                    linear(x_attn, m.lm_head)

        def replay():
            for i, x, ids, wt in recorded:
                out = torch.zeros(1, H)
                ext.moe(
                    x.contiguous(),
                    ids.to(torch.int64),
                    wt.contiguous(),
                    *args[i][:9],
                    out,
                    *args[i][9:],
                    math,
                )

        prompt_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        configs = {
            "model": lambda: llm.generate([prompt], params),
            "loop-model-inputs": replay,
            "loop": lambda: loop(layers),
            "loop-attn": lambda: loop(layers, with_attn=True),
            "loop-6": lambda: loop(layers[:6]),
            "loop-spin": lambda: loop(layers, sleep=statistics.median(qkv_t) if qkv_t else 1e-3),
        }
        res = {c: [] for c in configs}
        for r in range(a.rounds):
            for c in list(configs) if r % 2 == 0 else list(configs)[::-1]:
                prompt_step = (0,) * 8
                if c == "model":  # the prompt's step (9 tokens: most experts) counted apart and taken off
                    pool_stats(lib)
                    llm.generate([prompt], prompt_only)
                    prompt_step = pool_stats(lib).get(site, prompt_step)
                pool_stats(lib)
                t0 = time.perf_counter()
                configs[c]()
                wall = time.perf_counter() - t0
                got = pool_stats(lib).get(site, (0,) * 8)
                jobs, units, hu, ns, work, wait, start, cpu = (x - y for x, y in zip(got, prompt_step))
                if jobs:
                    res[c].append(
                        (
                            ns / jobs / 1e3,
                            per_call * jobs / ns,
                            work / jobs / 1e3,
                            wait / jobs / 1e3,
                            start / jobs / 1e3,
                            hu / units,
                            wall,
                            jobs,
                            per_call * jobs * a.threads / cpu,
                            cpu / jobs / 1e3,
                        )
                    )
    loop_gbps = statistics.median(v[1] for v in res["loop"])
    loop_cpu = statistics.median(v[8] for v in res["loop"])
    for c, v in res.items():
        if not v:
            continue
        med = [statistics.median(x[j] for x in v) for j in range(10)]
        print(
            f"gap: config={c} model={Path(a.model).name} cpu_math={a.cpu_math} threads={a.threads} rounds={len(v)} "
            f"moe_calls={med[7]:.0f} expert_MB_per_call={per_call / 1e6:.1f} moe_us={med[0]:.0f} "
            f"expert_GBps={med[1]:.1f} of_loop={med[1] / loop_gbps:.0%} caller_work_us={med[2]:.0f} "
            f"caller_wait_us={med[3]:.0f} helper_start_us={med[4]:.0f} helper_units={med[5]:.0%} "
            f"cpu_us={med[9]:.0f} expert_GBps_cpu={med[8]:.1f} cpu_of_loop={med[8] / loop_cpu:.0%} "
            f"wall_s={med[6]:.2f}"
        )
    print(huge_pages_line())


if __name__ == "__main__":
    main()
