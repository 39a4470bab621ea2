"""Where a decode token's time goes: the engine's pieces timed in one process (each wrapped with a
wall-clock timer; CPU ops are synchronous, so the sums are exact), batch 1, every weight resident.

    python bench/decode_breakdown.py [MODEL_DIR] [--lm-head int8] [--dense int8] [--cpu-math fast] [--threads 2] [--tokens 64] [--prompt 9] [--rounds 3] [--fused-blocks]

MODEL_DIR defaults to the peer benchmark's yardstick (~/.cache/expertcache-peers/yardstick, built by
bench/peers/llama_cpp_bench.py). One line per piece (the last round): ms per decode step, calls per
step, us per call; nested pieces overlap (experts.forward is inside moe_total, the kernels inside both).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import hardware_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(Path.home() / ".cache" / "expertcache-peers" / "yardstick"))
    ap.add_argument("--lm-head", default=None)
    ap.add_argument("--cpu-math", default="exact", choices=["exact", "fast"])
    ap.add_argument("--dense", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=9, help="prompt tokens (--prompt 128 --tokens 0: a prefill alone)")
    ap.add_argument("--fused-blocks", action="store_true", help="the one-call attention block (default: the Python path)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import expertcache.kernels as K
    import expertcache.layers.attention as attention
    import expertcache.models.transformer as transformer
    from expertcache import LLM, SamplingParams

    llm = LLM(a.model, max_model_len=max(512, a.prompt + a.tokens + 8), kv_cache_memory="64MiB", prefix_caching=False, lm_head=a.lm_head,
              cpu_math=a.cpu_math, dense=a.dense)
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
    for obj, name, key in [(attention.Attention, "__call__", "attention"), (m, "_moe", "moe_total"),
                           (m.experts, "forward", "experts.forward"), (m, "_route", "route"),
                           (m, "forward", "forward"), (transformer, "linear", "lm_head"),
                           (K, "moe_out", "kernels.moe"), (K, "attn_block", "kernels.attn_block"),
                           (K, "dense_linear", "kernels.dense_linear"),
                           (K, "quant_linear", "kernels.quant_linear"), (attention, "attend", "kernels.attend")]:
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
    print(f"decode: model={Path(a.model).name} steps={steps} tok_s={steps / wall:.2f} (wall, the prompt's step included)")
    for key, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"piece: name={key} ms_per_step={v / steps * 1e3:.3f} calls_per_step={calls[key] / steps:.1f} "
              f"us_per_call={v / calls[key] * 1e6:.1f}")
    print(f"piece: name=outside_forward ms_per_step={(wall - spent['forward']) / steps * 1e3:.3f}")


if __name__ == "__main__":
    main()
