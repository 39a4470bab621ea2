"""Hybrid linear-attention MoE: prefill/decode tok/s, all experts resident vs 25% in the fastest tier,
and the per-sequence state bytes against the KV a full-attention model of the same shape needs.

The checkpoint is generated once (transformers' Qwen3_5MoeForCausalLM, its own random init, bf16
on disk): 12 layers, 3 of 4 Gated DeltaNet, 64 experts top-8 with a shared expert, Qwen3.5-35B-A3B
ratios at 1/4 width. Configurations run in alternating rounds; each line is the median of --rounds:

    config=resident batch=1 prompt_len=256 gen=32 prefill_tok_s=... decode_tok_s=...
    state model=... layers=... linear=... state_bytes_per_seq=... kv_bytes_4k=... full_attn_kv_bytes_4k=... ...

    python bench/hybrid_bench.py [--dir /tmp/expertcache-hybrid-bench] [--rounds 3] [--batch 1 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from common import hardware_line, timed_generate

SHAPE = dict(  # Qwen3.5-35B-A3B at 1/4 width, 12 layers
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)


def build(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    from transformers import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def state_line(name: str, cfg, dtype=torch.bfloat16) -> str:
    """State bytes per sequence vs KV bytes at 4k / 32k tokens: this model, and all layers full attention."""
    from expertcache.engine.kv_cache import KVCache
    from expertcache.engine.state_cache import StateCache

    state = StateCache.bytes_per_sequence(cfg, dtype)
    per_tok = KVCache.bytes_per_block(len(cfg.attention_layer_ids), 1, cfg.kv_token_shapes, dtype)
    full_tok = KVCache.bytes_per_block(cfg.num_layers, 1, cfg.kv_token_shapes, dtype)
    parts = [
        f"state model={name} layers={cfg.num_layers} linear={sum(cfg.linear_attn.layers)} "
        f"dtype={str(dtype).removeprefix('torch.')} state_bytes_per_seq={state}"
    ]
    for n, label in ((4096, "4k"), (32768, "32k")):
        hybrid, full = state + n * per_tok, n * full_tok
        parts.append(
            f"hybrid_bytes_{label}={hybrid} full_attn_kv_bytes_{label}={full} ratio_{label}={full / hybrid:.2f}"
        )
    return " ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/expertcache-hybrid-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads (1 on an oversubscribed machine)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    from expertcache import LLM, SamplingParams
    from expertcache.models.qwen3_next import parse_next, parse_qwen35

    print(hardware_line())
    path = build(Path(args.dir))
    configs = {"resident": {}, "fastest_25pct": {"device_memory": "25%"}}
    llms = {name: LLM(str(path), max_num_seqs=max(args.batch), **kw) for name, kw in configs.items()}
    vocab = llms["resident"].cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (max(args.batch), args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results = {(n, b): [] for n in configs for b in args.batch}
    for llm in llms.values():
        llm.generate([prompts[0][:16]], warm)
    for _ in range(args.rounds):
        for b in args.batch:
            for name, llm in llms.items():
                results[name, b].append(timed_generate(llm, prompts[:b], params))
    for (name, b), runs in results.items():
        pre = statistics.median(r["prefill_tok_s"] for r in runs)
        dec = statistics.median(r["decode_tok_s"] for r in runs)
        print(
            f"config={name} batch={b} prompt_len={args.prompt_len} gen={args.gen} "
            f"prefill_tok_s={pre:.1f} decode_tok_s={dec:.1f}",
            flush=True,
        )
    for llm in llms.values():
        llm.close()
    print(state_line("bench-12L", llms["resident"].cfg, torch.float32))
    print(state_line("bench-12L", llms["resident"].cfg))
    # the published shapes (transformers' default configs are Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B)
    print(state_line("Qwen3-Next-80B-A3B", parse_next(Qwen3NextConfig().to_dict())))
    print(state_line("Qwen3.5-35B-A3B", parse_qwen35(Qwen3_5MoeTextConfig().to_dict())))


if __name__ == "__main__":
    main()
