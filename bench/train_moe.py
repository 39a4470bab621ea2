"""Train a small Qwen3-MoE with a different expert count and top_k than tinymoe-py16, for routing traces
that no cache policy was tuned on (bench/policy_bench.py).

    python bench/train_moe.py OUT_DIR [--experts 32] [--top-k 4] [--steps 120] [--threads 2]

Data: the first `--train-ids` ids of tinymoe-py16's heldout_ids.pt (same tokenizer, vocab 4096);
policy_bench.py traces this model on ids after them. A few minutes of CPU: the point is learned,
skewed, token-dependent routing (load-balancing loss on, as in real MoE training), not a good model.
Prints one line per 20 steps and the final loss; saves a Hugging Face checkpoint (bf16) + tokenizer.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

TINYMOE = Path(__file__).resolve().parents[2] / "shared/models/tinymoe-py16"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--train-ids", type=int, default=120_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        output_router_logits=True,
        max_position_embeddings=2048,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
    )
    model = Qwen3MoeForCausalLM(cfg)
    ids = torch.load(TINYMOE / "heldout_ids.pt").flatten()[: args.train_ids]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps, pct_start=0.1)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    model.train()
    for step in range(args.steps):
        start = torch.randint(0, len(ids) - args.seq - 1, (args.batch,), generator=g)
        x = torch.stack([ids[s : s + args.seq] for s in start.tolist()])
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == args.steps - 1:
            print(
                f"step {step} t={time.perf_counter() - t0:.0f}s loss={out.loss.item():.3f} "
                f"aux={out.aux_loss.item():.3f}",
                flush=True,
            )
    out_dir = Path(args.out)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINYMOE / f, out_dir / f)
    print(
        f"saved {out_dir}: {args.layers} layers x {args.experts} experts, top-{args.top_k}, "
        f"{time.perf_counter() - t0:.0f}s"
    )


if __name__ == "__main__":
    main()
