"""The per-token work of a decode step other than streaming weights, and what the one-call attention
block (layers/block.py) saves: the layers as one stack call a step, as one block call each, and the
Python path, alternating in one process.

    python bench/overhead_bench.py [MODEL_DIR] [--rounds 12] [--tokens 48] [--threads 2] [--cpu-math fast]
                                   [--modes stack blocks python]

MODEL_DIR defaults to a "skeleton" built here once with transformers (the test extra): the
yardstick's structure (Qwen3-MoE, 16 layers, 64 experts top-8, 16 query / 4 kv heads, untied, bf16)
with tiny widths (hidden 64, expert intermediate 32, head_dim 16, vocab 2048), so its weights stay in
the caches and its decode time is the Python, dispatch and small ops a step makes. On the yardstick itself (MODEL_DIR =
~/.cache/expertcache-peers/yardstick) the same lines give the block's effect with the weight streams.
One line per mode: median decode tok/s and main-thread CPU ms per token; then, for each mode after the
first, the first's speedup over it: the ratio of the medians and the median of the per-round ratios. Batch 1, greedy, every weight resident.
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

SKELETON = Path.home() / ".cache" / "expertcache-bench" / "yardstick-skeleton"


def build_skeleton(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=32,
        moe_intermediate_size=32,
        head_dim=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_hidden_layers=16,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        vocab_size=2048,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-math", default="fast", choices=["exact", "fast"])
    ap.add_argument(
        "--modes", nargs="+", default=["stack", "blocks", "python"], choices=["stack", "blocks", "python"]
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertcache import LLM, SamplingParams

    model = Path(a.model) if a.model else build_skeleton(SKELETON)
    llm = LLM(
        str(model), max_model_len=512, kv_cache_memory="64MiB", prefix_caching=False, cpu_math=a.cpu_math
    )
    m = llm.model
    stack = m.stack
    if stack is None and "stack" in a.modes:
        sys.exit("this model has no stack of blocks (a layer without a block)")
    print(hardware_line())
    print(
        f"model: {model.name} blocks={sum(b is not None for b in m.blocks)}/{len(m.blocks)} cpu_math={a.cpu_math}"
    )
    prompt = [3 + i for i in range(9)]
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    tok_s: dict[str, list[float]] = {mode: [] for mode in a.modes}
    cpu_ms: dict[str, list[float]] = {mode: [] for mode in a.modes}
    for r in range(a.rounds):
        for mode in a.modes if r % 2 == 0 else a.modes[::-1]:
            m.fused_blocks, m.stack = mode != "python", stack if mode == "stack" else None
            t, c = time.perf_counter(), time.thread_time()
            llm.generate([prompt], params)
            tok_s[mode].append(a.tokens / (time.perf_counter() - t))
            cpu_ms[mode].append((time.thread_time() - c) / a.tokens * 1e3)
    m.fused_blocks, m.stack = True, stack
    for mode in a.modes:
        print(
            f"overhead: mode={mode} decode_tok_s={statistics.median(tok_s[mode]):.2f} "
            f"main_thread_cpu_ms_per_token={statistics.median(cpu_ms[mode]):.3f} rounds={a.rounds}"
        )
    first = a.modes[0]
    for mode in a.modes[1:]:
        pairs = [x / y for x, y in zip(tok_s[first], tok_s[mode])]
        print(
            f"overhead-summary: {first}_over_{mode}={statistics.median(tok_s[first]) / statistics.median(tok_s[mode]):.3f} "
            f"per_round_median={statistics.median(pairs):.3f} per_round_range={min(pairs):.2f}-{max(pairs):.2f}"
        )


if __name__ == "__main__":
    main()
