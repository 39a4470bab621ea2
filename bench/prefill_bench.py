"""Prefill on the bf16 matmul (kernels/prefill_gemm.py) on and off, alternating in one process, on a
gpt-oss-20b-shaped checkpoint with fewer layers: hidden 2880, 32 experts top-4 of intermediate 2880
(MXFP4 as shipped, or bf16), 64 query heads of 64 over 8 kv heads, q/k/v/o and expert biases, sinks,
clamped SwiGLU; vocab 32000 (only the last token's logits are computed at prefill). `--cpu-math fast`.

    python bench/prefill_bench.py [--layers 2] [--formats mxfp4 bf16] [--prompt-lens 128 512] [--repeats 3]
                                  [--threads N]

The first prefill with the path on measures each shape class's crossover (cached per machine), so a
warm-up prefill of every length runs on and off before timing. One `result` line per (format, prompt
length, path): prefill tok/s (median of the repeats, runs alternating on / off), the runs, and whether
the first generated token equals the kernel path's; then the crossover table the runs used. Prefix
caching is off, so every run prefills its whole prompt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import hardware_line, timed_generate  # noqa: E402
from bench.gpt_oss_bench import build  # noqa: E402

SHAPE = dict(
    layers=2,
    experts=32,
    top_k=4,
    hidden=2880,
    intermediate=2880,
    heads=64,
    kv_heads=8,
    head_dim=64,
    vocab=32000,
    window=128,
    seed=0,
)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/expertcache-bench/prefill-gpt-oss-shape")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--formats", nargs="+", default=["mxfp4"], choices=["mxfp4", "bf16"])
    ap.add_argument("--prompt-lens", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    from expertcache import LLM, SamplingParams
    from expertcache.kernels import prefill_gemm

    if args.threads:
        torch.set_num_threads(args.threads)
    print(hardware_line(), flush=True)
    shape = {**SHAPE, "layers": args.layers}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = torch.Generator().manual_seed(1)
    for fmt in args.formats:
        path = build(Path(args.dir) / f"{fmt}-{args.layers}L", shape, fmt)
        llm = LLM(
            str(path),
            device="cpu",
            cpu_math="fast",
            kv_cache_memory="256MiB",
            max_model_len=max(args.prompt_lens) + 8,
            prefix_caching=False,
        )  # every run prefills it all
        for n in args.prompt_lens:
            warm, *prompts = [
                torch.randint(3, shape["vocab"], (n,), generator=rng).tolist()
                for _ in range(args.repeats + 1)
            ]
            runs, first = {True: [], False: []}, {True: [], False: []}
            for on in (True, False):  # warm-up; with the path on, the crossovers measured at first use
                prefill_gemm.enable(on)
                timed_generate(llm, [warm], params)
            calls = dict(prefill_gemm.CALLS)
            for prompt in prompts:
                for on in (True, False):
                    prefill_gemm.enable(on)
                    r = timed_generate(llm, [prompt], params)
                    runs[on].append(r["prefill_tok_s"])
                    first[on].append(r["outputs"][0].token_ids[0])
            used = {k: v - calls[k] for k, v in prefill_gemm.CALLS.items()}
            for on in (True, False):
                print(
                    f"result model=gpt-oss-20b-shape-{args.layers}L experts={fmt} prompt_len={n} "
                    f"prefill_gemm={'on' if on else 'off'} prefill_tok_s={statistics.median(runs[on]):.1f} "
                    f"runs={','.join(format(r, '.1f') for r in runs[on])} "
                    f"first_token_equal_off={first[on] == first[False]}"
                    + (
                        f" matmul_calls_dense={used['dense']} matmul_calls_expert={used['expert']}"
                        if on
                        else ""
                    ),
                    flush=True,
                )
            print(
                f"speedup model=gpt-oss-20b-shape-{args.layers}L experts={fmt} prompt_len={n} "
                f"on_over_off={statistics.median(runs[True]) / statistics.median(runs[False]):.2f}",
                flush=True,
            )
        prefill_gemm.enable(True)
        llm.close()
    for key, t in sorted(prefill_gemm.table().items()):
        print(f"crossover class={key} tokens={'never' if t == prefill_gemm.NEVER else t}", flush=True)


if __name__ == "__main__":
    main()
