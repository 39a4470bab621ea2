"""Expert-parallel decode speed on CPU processes (gloo), single process vs N ranks, same run.

    .venv/bin/python bench/ep_speed.py [--ranks 2 3] [--rounds 2] [--batch 1 8]
    .venv/bin/python bench/ep_speed.py --peer [--ranks 2] [--budget 25%] [--redundant 8]

`--peer`: the peer tier on real transfers instead: N ranks with tiny per-rank budgets (--budget of
the experts in device slots and as much in host RAM) and --redundant replicas (so ranks share
experts), peer tier off (every miss reads the rank's disk) vs forced on (misses another rank holds
in memory come over loopback gloo); per configuration decode tok/s and, over the timed run and all
ranks, expert bytes read from disk, peer hits and bytes; the link the group measured at start.

A generated Qwen3-MoE checkpoint (8 layers, 32 experts top-4, hidden 512, moe intermediate 512)
is built once under /tmp. One process holds one expert-parallel group at a time, so each round
loads, runs and closes every configuration in turn (alternating rounds); medians per configuration. On a
2-core machine N ranks share the same 2 cores, so these
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
    ap.add_argument("--peer", action="store_true", help="peer tier off vs on under tiny per-rank budgets")
    ap.add_argument("--budget", default="25%", help="--peer: per-rank device budget (host the same)")
    ap.add_argument("--redundant", type=int, default=8, help="--peer: redundant experts per layer")
    args = ap.parse_args(argv)
    import checkpoints

    from expertcache import LLM, SamplingParams

    torch.set_num_threads(1)
    root = Path("/tmp/expertcache-bench-ep")
    model = root / "model"
    if not (model / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        checkpoints.make_checkpoint(
            root,
            "qwen3_moe",
            name="model",
            dtype=torch.bfloat16,
            num_experts=32,
            num_experts_per_tok=4,
            num_hidden_layers=8,
            hidden_size=512,
            moe_intermediate_size=512,
            intermediate_size=1024,
        )
    print(hardware_line())
    if args.peer:
        return peer_runs(args, model)
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


def _rank_totals(llm) -> tuple[int, int, int]:
    """(disk bytes read, peer hits, peer bytes in) summed over every rank, as of now."""
    ranks = llm.expert_stats()["expert_parallel"]["ranks"]
    tiers = [r["cache"]["per_tier"] for r in ranks]
    return (
        sum(t["disk"]["bytes_read"] for t in tiers),
        sum(t.get("peer", {}).get("hits", 0) for t in tiers),
        sum(t.get("peer", {}).get("bytes_in", 0) for t in tiers),
    )


def peer_runs(args, model: Path) -> None:
    from expertcache import LLM, SamplingParams
    from expertcache.parallel import ParallelConfig

    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = {B: [torch.randint(5, 300, (24,), generator=g).tolist() for _ in range(B)] for B in args.batch}
    configs = [(n, mode) for n in args.ranks for mode in ("off", "on")]
    runs = {(c, B): [] for c in configs for B in args.batch}
    moved = {(c, B): [] for c in configs for B in args.batch}
    links = {}
    for _ in range(args.rounds):
        for n, mode in configs:
            cfg = ParallelConfig(n, num_redundant_experts=args.redundant, peer_tier=mode)
            llm = LLM(str(model), expert_parallel=cfg, device_memory=args.budget, host_memory=args.budget)
            links[n] = next((line for line in llm.plan_lines if line.startswith("peer tier")), "")
            for B, p in prompts.items():
                llm.generate(p, SamplingParams(max_tokens=2, temperature=0))  # warm-up
                before = _rank_totals(llm)
                runs[(n, mode), B].append(timed_generate(llm, p, params)["decode_tok_s"])
                moved[(n, mode), B].append([a - b for a, b in zip(_rank_totals(llm), before)])
            llm.close()
    for n in args.ranks:
        print(f"ep_speed_peer ranks={n} link: {links[n]}")
    for B in args.batch:
        for n, mode in configs:
            med = statistics.median(runs[(n, mode), B])
            disk, hits, peer = (statistics.median(m[i] for m in moved[(n, mode), B]) for i in range(3))
            base = statistics.median(runs[(n, "off"), B])
            print(
                f"ep_speed_peer ranks={n} peer={mode} batch={B} budget={args.budget} redundant={args.redundant} "
                f"decode_tok_s={med:.2f} vs_peer_off={med / base:.2f}x disk_MB={disk / 1e6:.1f} "
                f"peer_hits={hits:.0f} peer_MB={peer / 1e6:.1f}"
            )


if __name__ == "__main__":
    main()
