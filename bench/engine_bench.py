"""Prefill and decode tok/s of expertcache vs transformers on the same checkpoint, same run.

Both compute in float32 on the CPU (neither pays for the missing bf16 matrix
instructions); every expert resident. One line per (engine, batch):

    engine=expertcache batch=8 prompt_len=64 gen=32 prefill_tok_s=... decode_tok_s=...

    python bench/engine_bench.py [--model DIR] [--batch 1 8] [--prompt-len 64] [--gen 32]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import hardware_line, timed_generate


def run_transformers(model_dir, prompts, gen):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = torch.tensor(prompts)
    batch = len(prompts)
    kw = dict(do_sample=False, max_new_tokens=gen, min_new_tokens=gen, pad_token_id=0)
    with torch.inference_mode():
        model.generate(
            ids[:, :8],
            attention_mask=torch.ones_like(ids[:, :8]),
            **{**kw, "max_new_tokens": 4, "min_new_tokens": 4},
        )  # warm-up
        t0 = time.perf_counter()
        model(ids)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        total = time.perf_counter() - t0
    decode = max(total - prefill, 1e-9)
    return {"prefill_tok_s": ids.numel() / prefill, "decode_tok_s": batch * (gen - 1) / decode}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()
    from expertcache import LLM, SamplingParams
    from expertcache.demo import random_demo_dir

    model_dir = args.model or str(random_demo_dir())
    torch.manual_seed(0)
    print(hardware_line())
    llm = LLM(model_dir, prefix_caching=False)  # transformers has no prefix cache: compare like with like
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, llm.cfg.vocab_size, (max(args.batch), args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    for b in args.batch:
        ours = timed_generate(llm, prompts[:b], params)
        line = (
            f"engine=expertcache batch={b} prompt_len={args.prompt_len} gen={args.gen} "
            f"prefill_tok_s={ours['prefill_tok_s']:.1f} decode_tok_s={ours['decode_tok_s']:.1f}"
        )
        print(line, flush=True)
        if not args.no_transformers:
            ref = run_transformers(model_dir, prompts[:b], args.gen)
            print(
                f"engine=transformers batch={b} prompt_len={args.prompt_len} gen={args.gen} "
                f"prefill_tok_s={ref['prefill_tok_s']:.1f} decode_tok_s={ref['decode_tok_s']:.1f}",
                flush=True,
            )
            print(
                f"ratio batch={b} prefill={ours['prefill_tok_s'] / ref['prefill_tok_s']:.2f}x "
                f"decode={ours['decode_tok_s'] / ref['decode_tok_s']:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
