"""One checkpoint or GGUF file through one source tree of expertcache: prefill and decode tok/s of a fixed
prompt, every expert resident, fast math, 2 threads. Run it from two trees alternately to compare a change
on the same file (the figures of docs/real-scale.md "GGUF's 4-bit types get the prefill strips").

    python bench/source_ab.py TREE MODEL [ROUNDS] [PROMPT]     # TREE: a checkout whose expertcache is timed

One line: tree, model file, prompt tokens, median prefill / decode tok/s of ROUNDS (default 3) of a
PROMPT-token prompt (default 128) after a warm-up of 8 and PROMPT tokens, and how many prefill matmul calls
each path made (kernels.prefill_gemm.CALLS); prefill_tok_per_cpu_s: the prompt's tokens over the process's
CPU seconds (all threads) of a generate of one token, median of ROUNDS (less sensitive to a busy machine).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def main():
    tree, path = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    prompt_len = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    sys.path[:0] = [tree, str(Path(tree) / "bench")]  # the tree's expertcache and its bench/common.py
    torch.set_num_threads(2)
    from common import hardware_line, timed_generate

    from expertcache import LLM, SamplingParams
    from expertcache.kernels import prefill_gemm

    print(hardware_line())
    llm = LLM(
        path,
        max_model_len=max(256, prompt_len + 32),
        kv_cache_memory="64MiB",
        prefix_caching=False,
        cpu_math="fast",
    )
    prompt = torch.randint(3, 2000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    for n in (8, prompt_len):
        llm.generate([prompt[:n]], SamplingParams(max_tokens=2, temperature=0.0))
    pp, tg = [], []
    for _ in range(rounds):
        r = timed_generate(llm, [prompt], SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))
        pp.append(r["prefill_tok_s"])
        tg.append(r["decode_tok_s"])
    cpu = []  # the process's CPU seconds (every thread) of the prompt and one token: robust to a busy machine
    for _ in range(rounds):
        c0 = time.process_time()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        cpu.append(time.process_time() - c0)
    pp.sort()
    tg.sort()
    cpu.sort()
    line = {
        "tree": Path(tree).name,
        "model": Path(path).name,
        "prompt": prompt_len,
        "prefill_tok_s": round(pp[len(pp) // 2], 1),
        "decode_tok_s": round(tg[len(tg) // 2], 2),
        "prefill_tok_per_cpu_s": round(prompt_len / cpu[len(cpu) // 2], 1),
        "prefill_calls": dict(prefill_gemm.CALLS),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
