"""Expert-parallel decode speed on CPU processes (gloo), single process vs N ranks, same run.

    .venv/bin/python bench/ep_speed.py [--ranks 2 3] [--rounds 2] [--batch 1 8]

A generated Qwen3-MoE checkpoint (8 layers, 32 experts top-4, hidden 512, moe intermediate 512)
is built once under /tmp. One process holds one expert-parallel group at a time, so each round
loads, runs and closes every configuration in turn (alternating rounds); medians per configuration. On a 2-core machine N ranks share the same 2 cores, so these
figures measure the overhead of the collectives, not a speed-up: EP pays off when each rank has
its own device (or machine) and the experts do not fit in one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line, timed_generate  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    import checkpoints

    from expertcache import LLM, SamplingParams

    torch.set_num_threads(1)
    root = Path("/tmp/expertcache-bench-ep")
    model = root / "model"
    if not (model / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        checkpoints.make_checkpoint(root, "qwen3_moe", name="model", dtype=torch.bfloat16, num_experts=32,
                                    num_experts_per_tok=4, num_hidden_layers=8, hidden_size=512,
                                    moe_intermediate_size=512, intermediate_size=1024)
    print(hardware_line())
    configs = {"single": None, **{f"ep{n}": n for n in args.ranks}}
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = {B: [torch.randint(5, 300, (24,), generator=g).tolist() for _ in range(B)] for B in args.batch}
    runs = {(name, B): [] for name in configs for B in args.batch}
    for _ in range(args.rounds):
        for name, ranks in configs.items():
            llm = LLM(str(model), expert_parallel=ranks)
            for B, p in prompts.items():
                llm.generate(p, SamplingParams(max_tokens=2, temperature=0))  # warm-up
                runs[name, B].append(timed_generate(llm, p, params)["decode_tok_s"])
            llm.close()
    for B in args.batch:
        base = statistics.median(runs["single", B])
        for name in configs:
            med = statistics.median(runs[name, B])
            print(f"ep_speed config={name} batch={B} decode_tok_s={med:.2f} vs_single={med / base:.2f}x")


if __name__ == "__main__":
    main()
