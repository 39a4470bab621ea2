"""The expert cache's host cost per MoE layer per decode step: resident vs tiered decode of one model.

Every configuration is built in one process and timed in alternating rounds (medians), so the
difference is the cache step itself: (1 / tiered tok/s - 1 / resident tok/s) / MoE layers, in µs
per MoE layer per decode step (`step_us_per_layer`, wall time), and the same from the process's CPU
time per decoded token (`step_cpu_us_per_layer`: every thread's, so it holds on a loaded machine
where wall time does not). Defaults: the shipped demo model (6 MoE layers, 32 experts, top-4),
one thread, the tiered cache at device_memory=75% with every expert in host RAM, the default
policy and lru. Prefill tok/s of each configuration is printed too (a 128-token prompt).

A line names the model, the prefetch mode in effect and which planner decided (`planner=native`: the
C++ core, experts/policy.py `native_core`; `python`: EXPERTCACHE_PLANNER=python or no C++ kernels);
then one line per configuration:

    config=tiered-lru decode_tok_s=... prefill_tok_s=... step_us_per_layer=... step_cpu_us_per_layer=...

    python bench/cache_step.py [--model DIR] [--threads 1] [--rounds 7] [--gen 48] [--device-memory 75%]
                               [--policies default lru] [--prefetch off]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # this checkout's expertcache, not an installed one
from common import hardware_line, timed_generate


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the shipped demo model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gen", type=int, default=48, help="decode tokens per round")
    ap.add_argument("--prompt-len", type=int, default=128, help="prefill tokens per round")
    ap.add_argument("--device-memory", default="75%")
    ap.add_argument("--host-memory", default="100%")
    ap.add_argument("--policies", nargs="+", default=["default", "lru"])
    ap.add_argument(
        "--prefetch", default=None, help="the tiered configurations' prefetch (default: the engine's)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from expertcache import LLM, SamplingParams
    from expertcache.demo import demo_model_dir

    model_dir = args.model or str(demo_model_dir(progress=False))
    torch.manual_seed(0)
    print(hardware_line())
    llms = {"resident": LLM(model_dir, prefix_caching=False)}
    for p in args.policies:
        kw = {} if p == "default" else {"cache_policy": p}
        if args.prefetch is not None:
            kw["prefetch"] = args.prefetch
        llms[f"tiered-{p}"] = LLM(
            model_dir,
            prefix_caching=False,
            device_memory=args.device_memory,
            host_memory=args.host_memory,
            **kw,
        )
    cache = llms["tiered-" + args.policies[0]].experts
    moe_layers = len(cache.layers)
    gen = torch.Generator().manual_seed(0)
    vocab = llms["resident"].cfg.vocab_size
    decode_prompt = torch.randint(3, vocab, (8,), generator=gen).tolist()
    prefill_prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
    decode = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for llm in llms.values():  # warm-up: kernels built, caches filled
        llm.generate([decode_prompt], decode)
        llm.generate([prefill_prompt], one)
    dec = {k: [] for k in llms}
    cpu = {k: [] for k in llms}
    pre = {k: [] for k in llms}
    for r in range(args.rounds):
        order = list(llms) if r % 2 == 0 else list(llms)[::-1]
        for k in order:
            c0 = time.process_time()
            dec[k].append(timed_generate(llms[k], [decode_prompt], decode)["decode_tok_s"])
            cpu[k].append((time.process_time() - c0) / args.gen)
            pre[k].append(timed_generate(llms[k], [prefill_prompt], one)["prefill_tok_s"])
    base, base_cpu = statistics.median(dec["resident"]), statistics.median(cpu["resident"])
    print(
        f"model={model_dir} moe_layers={moe_layers} threads={args.threads} device_memory={args.device_memory} "
        f"host_memory={args.host_memory} prefetch={args.prefetch or 'default'} ({cache.prefetch_mode}) "
        f"planner={cache.planner.implementation} rounds={args.rounds} gen={args.gen}"
    )
    for k in llms:
        d, p = statistics.median(dec[k]), statistics.median(pre[k])
        us = (1 / d - 1 / base) / moe_layers * 1e6
        cus = (statistics.median(cpu[k]) - base_cpu) / moe_layers * 1e6
        print(
            f"config={k} decode_tok_s={d:.1f} prefill_tok_s={p:.1f} step_us_per_layer={us:.1f} "
            f"step_cpu_us_per_layer={cus:.1f}",
            flush=True,
        )
    for llm in llms.values():
        llm.close()


if __name__ == "__main__":
    main()
