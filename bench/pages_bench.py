"""Weights on 4 KiB pages against weights on 2 MiB (transparent huge) pages (expertcache/hostmem.py):
the same checkpoint loaded twice in one process, once per page size, decode and prefill alternating
round by round, so the ratio survives a noisy machine.

    python bench/pages_bench.py [MODEL_DIR] [--rounds 10] [--tokens 32] [--prompt 128] [--threads 2]
                                [--cpu-math fast] [--dense int8] [--lm-head int8]

MODEL_DIR defaults to the peer benchmark's yardstick (~/.cache/expertcache-peers/yardstick, built by
bench/peers/llama_cpp_bench.py); it needs twice the model's bytes of memory. Batch 1, greedy, every
weight resident. One line per page size: the process's resident huge-page bytes after its load,
median decode tok/s and prefill tok/s; then the ratios of the medians and the per-round medians.
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


def anon_huge_bytes() -> int:
    """The process's anonymous memory on huge pages (the kernel's own count, /proc/self/smaps_rollup)."""
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "model", nargs="?", default=str(Path.home() / ".cache" / "expertcache-peers" / "yardstick")
    )
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-math", default="fast", choices=["exact", "fast"])
    ap.add_argument("--dense", default=None)
    ap.add_argument("--lm-head", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertcache import LLM, SamplingParams, hostmem

    if not hostmem.enabled:
        sys.exit("this platform has no MADV_HUGEPAGE: nothing to compare")
    print(hardware_line())
    llms, huge = {}, {}
    for pages in ("4KiB", "2MiB"):
        hostmem.enabled = pages == "2MiB"
        before = anon_huge_bytes()
        llms[pages] = LLM(
            a.model,
            max_model_len=1024,
            kv_cache_memory="64MiB",
            prefix_caching=False,
            cpu_math=a.cpu_math,
            dense=a.dense,
            lm_head=a.lm_head,
        )
        huge[pages] = anon_huge_bytes() - before
    hostmem.enabled = True
    decode = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    prefill = SamplingParams(max_tokens=1, temperature=0.0)
    short = [3 + i for i in range(9)]
    long = [3 + i % 2000 for i in range(a.prompt)]
    for llm in llms.values():  # warm-up
        llm.generate([short], SamplingParams(max_tokens=2, temperature=0.0))
    dec: dict[str, list[float]] = {p: [] for p in llms}
    pre: dict[str, list[float]] = {p: [] for p in llms}
    for r in range(a.rounds):
        for pages in list(llms) if r % 2 == 0 else list(llms)[::-1]:
            llm = llms[pages]
            t = time.perf_counter()
            llm.generate([short], decode)
            dec[pages].append(a.tokens / (time.perf_counter() - t))
            t = time.perf_counter()
            llm.generate([long], prefill)
            pre[pages].append(a.prompt / (time.perf_counter() - t))
    for pages in llms:
        print(
            f"pages: weights_on={pages} anon_huge_MiB={huge[pages] / 2**20:.0f} "
            f"decode_tok_s={statistics.median(dec[pages]):.2f} prefill_tok_s={statistics.median(pre[pages]):.1f} "
            f"cpu_math={a.cpu_math} dense={a.dense} lm_head={a.lm_head} rounds={a.rounds}"
        )
    for name, v in (("decode", dec), ("prefill", pre)):
        pairs = [x / y for x, y in zip(v["2MiB"], v["4KiB"])]
        print(
            f"pages-summary: {name}_speedup={statistics.median(v['2MiB']) / statistics.median(v['4KiB']):.3f} "
            f"per_round_median={statistics.median(pairs):.3f} per_round_range={min(pairs):.2f}-{max(pairs):.2f}"
        )


if __name__ == "__main__":
    main()
