"""GPT-OSS-like checkpoint: decode and prefill tok/s, every expert resident vs 25% in the fastest tier.

    .venv/bin/python bench/gpt_oss_bench.py [--formats mxfp4 bf16] [--repeats 3] [--prompt-len 128 --gen 32] [--threads 1]

The checkpoint is generated once (cached under --dir, checked by a manifest) in the layout
openai/gpt-oss-* ship, scaled down with gpt-oss-20b's shape ratios: 12 layers alternating
sliding-window (128) and full attention, 32 experts top-4, hidden = expert intermediate size
(640; 2880 in the real model), 16 query heads of 64 over 2 kv heads (8:1, as 64:8), sinks,
q/k/v/o biases, router and expert biases, YaRN; dense weights bf16; experts MXFP4
(`*_blocks`/`*_scales`, as shipped) or bf16 (fused gate_up_proj [E, H, 2I] as transformers saves them).
Random weights (fixed seed): routing is the model's own router.

Configurations: resident (every expert in the fastest tier) and 25% (8 of 32 experts per layer in
the fastest tier, the rest in host RAM), per format. All of them stay loaded; runs go round-robin,
each reports its median. One `result` line per configuration, after the hardware line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import hardware_line, timed_generate  # noqa: E402

SHAPE = dict(
    layers=12,
    experts=32,
    top_k=4,
    hidden=640,
    intermediate=640,
    heads=16,
    kv_heads=2,
    head_dim=64,
    vocab=32000,
    window=128,
    seed=0,
)


def config_json(s: dict, fmt: str) -> dict:
    cfg = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "head_dim": s["head_dim"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "num_hidden_layers": s["layers"],
        "num_local_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "vocab_size": s["vocab"],
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s["layers"])],
        "sliding_window": s["window"],
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "rope_theta": 150000,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "pad_token_id": 1,
    }
    if fmt == "mxfp4":
        cfg["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }
    return cfg


def build(out: Path, s: dict, fmt: str) -> Path:
    """Write the checkpoint unless `out` already holds it (same manifest)."""
    from safetensors.torch import save_file

    from expertcache.quant.mxfp4 import quantize_mxfp4

    manifest = {**s, "format": fmt}
    if (out / "manifest.json").exists() and json.loads((out / "manifest.json").read_text()) == manifest:
        return out
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(s["seed"])
    H, I, E, V = s["hidden"], s["intermediate"], s["experts"], s["vocab"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

    def rnd(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    t = {
        "model.embed_tokens.weight": rnd(V, H, std=1.0),
        "lm_head.weight": rnd(V, H, std=H**-0.5),
        "model.norm.weight": (1 + rnd(H, std=0.1).float()).bfloat16(),
    }
    for i in range(s["layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = (1 + rnd(H, std=0.1).float()).bfloat16()
        t[f"{p}.post_attention_layernorm.weight"] = (1 + rnd(H, std=0.1).float()).bfloat16()
        for n, o, inp in (("q", q, H), ("k", kv, H), ("v", kv, H), ("o", H, q)):
            t[f"{p}.self_attn.{n}_proj.weight"] = rnd(o, inp, std=inp**-0.5)
            t[f"{p}.self_attn.{n}_proj.bias"] = rnd(o, std=0.02)
        t[f"{p}.self_attn.sinks"] = rnd(s["heads"], std=1.0)
        t[f"{p}.mlp.router.weight"] = rnd(E, H, std=2 * H**-0.5)
        t[f"{p}.mlp.router.bias"] = rnd(E, std=0.1)
        gate_up = torch.randn(E, H, 2 * I, generator=g) * H**-0.5  # [E, in, out] as transformers holds it
        down = torch.randn(E, I, H, generator=g) * I**-0.5 / s["layers"] ** 0.5
        t[f"{p}.mlp.experts.gate_up_proj_bias"] = rnd(E, 2 * I, std=0.02)
        t[f"{p}.mlp.experts.down_proj_bias"] = rnd(E, H, std=0.02)
        if fmt == "mxfp4":  # shipped: [E, out, in/32, 16] blocks, [E, out, in/32] e8m0 scales
            for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
                packed = [quantize_mxfp4(w[e].T.contiguous()) for e in range(E)]
                t[f"{p}.mlp.experts.{name}_blocks"] = torch.stack([b for b, _ in packed])
                t[f"{p}.mlp.experts.{name}_scales"] = torch.stack([c for _, c in packed])
        else:
            t[f"{p}.mlp.experts.gate_up_proj"] = gate_up.bfloat16()
            t[f"{p}.mlp.experts.down_proj"] = down.bfloat16()
    save_file(
        {k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(config_json(s, fmt), indent=2))
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["mxfp4", "bf16"], choices=["mxfp4", "bf16"])
    ap.add_argument("--dir", default="/tmp/expertcache-bench/gpt-oss-like")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="round-robin runs per configuration (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    from expertcache import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    print(hardware_line(), flush=True)
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    rng = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, SHAPE["vocab"], (args.prompt_len,), generator=rng).tolist()
        for _ in range(args.repeats)
    ]
    llms = {}
    for fmt in args.formats:
        path = build(Path(args.dir) / fmt, SHAPE, fmt)
        for name, kw in (("resident", {}), ("25%", {"device_memory": "25%", "host_memory": "100%"})):
            llm = LLM(str(path), device="cpu", kv_cache_memory="64MiB", **kw)
            llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
            llms[fmt, name] = llm
    runs = {k: [] for k in llms}
    for prompt in prompts:
        for k, llm in llms.items():
            runs[k].append(timed_generate(llm, [prompt], params))
    ref = {}
    for (fmt, name), llm in llms.items():
        dec = statistics.median(r["decode_tok_s"] for r in runs[fmt, name])
        pre = statistics.median(r["prefill_tok_s"] for r in runs[fmt, name])
        toks = [list(r["outputs"][0].token_ids) for r in runs[fmt, name]]
        same = ref.setdefault(fmt, toks) == toks
        s = llm.expert_stats() or {}
        print(
            f"result model=gpt-oss-like-12L-32E-top4 experts={fmt} config={name} decode_tok_s={dec:.2f} "
            f"prefill_tok_s={pre:.1f} decode_runs={','.join(format(r['decode_tok_s'], '.1f') for r in runs[fmt, name])} "
            f"device_hit={s.get('hit_rate', 1.0):.3f} tokens_equal_resident={same} "
            f"expert_MB={llm.source.expert_nbytes / 1e6:.2f} experts_GB={llm.source.total_nbytes / 1e9:.3f}",
            flush=True,
        )
        llm.close()


if __name__ == "__main__":
    main()
