"""Routing of the trained demo model next to a random-weight model of the same shape.

    python bench/demo_routing.py [--tokens 512] [--new 64] [--model DIR]

Both models read the same held-out text (the trained model's heldout.txt, never trained on) one
token per engine step (teacher-forced decode) and then generate greedily; their routing is recorded
(--record-routing) and replayed through the
engine's own cache policies. One line per model: token-to-token expert reuse (chance = top_k/E), then
one line per (model, slots per layer): LRU and MIN (offline optimum) hit rates. Fixed seed.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import hardware_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens of held-out text")
    ap.add_argument("--new", type=int, default=64, help="generated tokens")
    ap.add_argument("--capacities", default="4,8,16")
    ap.add_argument("--model", help="a trained demo checkpoint directory (default: the shipped one)")
    args = ap.parse_args()
    import json

    import torch

    from expertcache import LLM, SamplingParams, demo
    from expertcache.trace.format import RoutingTrace
    from expertcache.trace.replay import replay
    from expertcache.trace.stats import reuse_fraction

    torch.manual_seed(0)
    print(hardware_line())
    trained = pathlib.Path(args.model) if args.model else demo.demo_model_dir()
    p = json.loads((trained / demo.MANIFEST).read_text())["params"]
    work = pathlib.Path(tempfile.mkdtemp(prefix="expertcache-routing-"))
    sizes = {
        k: p[k]
        for k in (
            "num_layers",
            "num_experts",
            "top_k",
            "hidden",
            "moe_intermediate",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab",
        )
    }
    rnd = demo.build_demo_model(work / "random", num_shards=1, **sizes)
    shutil.copy(trained / "tokenizer.json", rnd / "tokenizer.json")  # the same tokens for both
    text = (trained / "heldout.txt").read_text()
    for name, path in (("trained", trained), ("random", rnd)):
        trace_path = work / f"{name}.npz"
        # one token per engine step (prefill in 1-token chunks): every step routes one token, as in
        # decode, so the trace is teacher-forced decode over the held-out text, then greedy tokens
        llm = LLM(str(path), record_routing=str(trace_path), max_num_batched_tokens=1)
        ids = llm.tokenizer.encode(text)[: args.tokens]
        llm.generate([ids], SamplingParams(max_tokens=args.new, temperature=0.0))
        llm.close()
        t = RoutingTrace.load(trace_path)
        print(
            f"model={name} rows={len(t)} reuse={reuse_fraction(t):.3f} chance={t.top_k / t.num_experts:.3f}"
        )
        for cap in (int(c) for c in args.capacities.split(",")):
            r = replay(t, "lru", cap)
            print(f"model={name} slots={cap} lru_hit={r.hit_rate:.3f} min_hit={r.min_hit_rate:.3f}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
