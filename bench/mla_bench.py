"""A DeepSeek-V3-like model: prefill/decode tok/s all-resident (MLA path auto / naive / absorbed) and
with 25% of the experts in the fastest tier; KV bytes per token of the latent cache vs expanded heads.

The checkpoint (built once with transformers' DeepseekV3ForCausalLM, random weights, bf16, cached in
--dir): 12 layers (the first dense), hidden 512, 8 heads, MLA q_lora 192 / kv_lora 128 / nope 32 /
rope 16 / v 32, 64 routed experts (moe intermediate 128) + 1 shared, top-6 of 8 groups keeping 4
(noaux_tc with a correction bias), routed_scaling_factor 2.5. Every configuration is loaded at once and
run in round-robin rounds; one line per configuration with the median:

    config=resident-auto batch=1 prompt_len=128 gen=32 prefill_tok_s=... decode_tok_s=...

    python bench/mla_bench.py [--dir /tmp/mla-bench] [--rounds 3] [--batch 1] [--prompt-len 128] [--gen 32]
                              [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from common import hardware_line, timed_generate

SHAPE = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1536,
    moe_intermediate_size=128,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=64,
    n_shared_experts=1,
    num_experts_per_tok=6,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=1,
    pad_token_id=0,
    num_nextn_predict_layers=0,
)


def build(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**SHAPE), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # routing far from uniform
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/mla-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 on a busy machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from expertcache import LLM, SamplingParams
    from expertcache.engine.kv_cache import KVCache

    path = build(Path(args.dir))
    print(hardware_line())
    configs = {
        "resident-auto": dict(path="auto"),
        "resident-naive": dict(path="naive"),
        "resident-absorbed": dict(path="absorbed"),
        "experts-25%-fastest-tier": dict(path="auto", device_memory="25%"),
    }
    llms = {}
    for name, c in configs.items():
        kw = {k: v for k, v in c.items() if k != "path"}
        llm = LLM(str(path), prefix_caching=False, **kw)
        for layer in llm.model.layers:
            layer["attn"].path = c["path"]
        llms[name] = llm
    cfg = next(iter(llms.values())).cfg
    m = cfg.mla
    latent = KVCache.bytes_per_block(cfg.num_layers, 1, cfg.kv_token_shapes, torch.bfloat16)
    expanded = cfg.num_layers * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2
    print(f"kv_bytes_per_token bf16 latent={latent} expanded_heads={expanded} ratio={expanded / latent:.1f}")

    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results: dict[str, list[dict]] = {n: [] for n in llms}
    tokens = {}
    for r in range(args.rounds):
        prompts = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
        for name, llm in llms.items():
            llm.generate([prompts[0][:8]], warm)
            out = timed_generate(llm, prompts, params)
            results[name].append(out)
            tokens.setdefault(r, {})[name] = [o.token_ids for o in out["outputs"]]
    same = all(len({tuple(map(tuple, t)) for t in per.values()}) == 1 for per in tokens.values())
    for name, rows in results.items():
        pre = statistics.median(x["prefill_tok_s"] for x in rows)
        dec = statistics.median(x["decode_tok_s"] for x in rows)
        print(
            f"config={name} batch={args.batch} prompt_len={args.prompt_len} gen={args.gen} "
            f"prefill_tok_s={pre:.1f} decode_tok_s={dec:.2f}"
        )
    print(f"identical_tokens_across_configs={same}")
    for llm in llms.values():
        llm.close()


if __name__ == "__main__":
    main()
