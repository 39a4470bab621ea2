"""Read-ahead on and off in the low-memory layout (bf16 slots of 13% of experts, no host tier), same run.

    python bench/prefetch_gate.py [--models big tinymoe] [--tokens 32]

"big" = 16 layers x 64 experts top-8, hidden 512, random weights (its next-layer router predicts
poorly: the per-layer gate should shut read-ahead off); "tinymoe" = the trained tinymoe-py16 on its
held-out text (predicts well: read-ahead should raise the hit rate). One line per configuration:
hit rate, read-ahead used/issued, GB read from disk, decode wall time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import hardware_line


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["big", "tinymoe"])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from expertcache import LLM, SamplingParams
    from expertcache.demo import build_demo_model

    print(hardware_line(), flush=True)
    for model in args.models:
        if model == "tinymoe":
            model_dir = str(Path(__file__).resolve().parents[2] / "shared/models/tinymoe-py16")
            prompt = torch.load(Path(model_dir) / "heldout_ids.pt").flatten()[:32].tolist()
        else:
            model_dir = build_demo_model(
                f"{tempfile.mkdtemp(prefix='expertcache-gate-')}/big",
                num_layers=16,
                num_experts=64,
                top_k=8,
                hidden=512,
                moe_intermediate=512,
                num_heads=8,
                num_kv_heads=4,
                num_shards=4,
            )
            prompt = torch.randint(3, 2000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
        for name, kw in (("off", {"prefetch": "off"}), ("gated", {}), ("ungated", {"prefetch_gate": None})):
            llm = LLM(str(model_dir), device_memory="13%", host_memory=0, low_memory=True, **kw)
            llm.generate([prompt[:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
            wall = time.perf_counter() - t0
            s = llm.expert_stats()
            print(
                f"model={model} readahead={name} hit_rate={s['hit_rate']:.3f} "
                f"used_issued={s['prefetch']['useful']}/{s['prefetch']['issued']} "
                f"disk_GB={s['per_tier']['disk']['bytes_read'] / 1e9:.2f} wall_s={wall:.2f}",
                flush=True,
            )
            llm.close()


if __name__ == "__main__":
    main()
